"""Scaling on the GPU: jit with shardings, vmap and shard_map reach the jax_cake kernels.

Run with `pytest -m gpu tests/gpu/test_scaling_gpu.py` on a machine with an NVIDIA GPU and
the built library. The multi-GPU case runs where more than one GPU is visible.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_cake as jc

pytestmark = pytest.mark.gpu

BF16, F32 = jnp.bfloat16, jnp.float32
T, D_IN, D_OUT = 4096, 1024, 512  # aligned: every GEMM plans a kernel on sm_90a


def _inputs():
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (T, D_IN), F32).astype(BF16)
    w = jax.random.normal(kw, (D_OUT, D_IN), F32) / D_IN**0.5
    ct = jax.random.normal(kc, (T, D_OUT), F32)
    return x, w, ct


def _step(x, w, ct):
    y, vjp = jax.vjp(jc.dense_projection, x, w)
    if jax.typeof(y).sharding.mesh.axis_types and AxisType.Explicit in jax.typeof(y).sharding.mesh.axis_types:
        ct = jax.sharding.reshard(ct, jax.typeof(y).sharding.spec)
    return (y, *vjp(ct.astype(y.dtype)))


def _xla_step(x, w, ct):
    with jc.planner.force("xla"):
        return jax.jit(_step)(x, w, ct)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _kernel_calls(text):
    return {op: text.count(f"custom_call_target=\"jax_cake_{op}\"") for op in ("fwd", "dgrad", "wgrad")}


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_jit_with_named_sharding_on_one_gpu_runs_the_kernels(gpu_library, axis_type):
    mesh = jax.make_mesh((1,), ("data",), axis_types=(axis_type,), devices=jax.devices("gpu")[:1])
    x, w, ct = _inputs()
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in ((x, P("data")), (w, P()), (ct, P("data")))]
    with jax.set_mesh(mesh):
        compiled = jax.jit(_step).lower(*args).compile()
        got = compiled(*args)
    assert all(n >= 1 for n in _kernel_calls(compiled.as_text()).values()), _kernel_calls(compiled.as_text())
    want = _xla_step(x, w, ct)
    for g, r, tol in zip(got, want, (1e-2, 1e-2, 1e-5)):
        assert g.dtype == r.dtype and _rel(g, r) < tol


def test_vmap_compiles_to_the_kernels_without_a_loop(gpu_library):
    x, w, _ = _inputs()
    xs = x.reshape(4, T // 4, D_IN)
    loss = lambda xs, w: jnp.sum(jax.vmap(jc.dense_projection, in_axes=(0, None))(xs, w).astype(F32) ** 2)
    f = jax.jit(jax.grad(loss, argnums=(0, 1)))
    text = f.lower(xs, w).compile().as_text()
    assert "while" not in text
    assert _kernel_calls(text) == {"fwd": 1, "dgrad": 1, "wgrad": 1}, _kernel_calls(text)
    dx, dw = f(xs, w)
    with jc.planner.force("xla"):
        rdx, rdw = jax.jit(jax.grad(loss, argnums=(0, 1)))(xs, w)
    assert _rel(dx, rdx) < 1e-2 and _rel(dw, rdw) < 1e-5


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs two or more GPUs")
@pytest.mark.parametrize("case", ["dp", "tp_col", "fsdp"])
def test_data_tensor_and_fsdp_sharding_on_every_gpu(gpu_library, case):
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("d",))
    x_spec, w_spec, y_spec = {"dp": (P("d"), P(), P("d")), "tp_col": (P(), P("d"), P(None, "d")), "fsdp": (P("d"), P("d"), P("d"))}[case]
    x, w, ct = _inputs()
    named = lambda s: NamedSharding(mesh, s)
    args = [jax.device_put(a, named(s)) for a, s in ((x, x_spec), (w, w_spec), (ct, y_spec))]
    f = jax.jit(_step, out_shardings=(named(y_spec), named(x_spec), named(w_spec)))
    compiled = f.lower(*args).compile()
    text = compiled.as_text()
    assert all(v >= 1 for v in _kernel_calls(text).values()), _kernel_calls(text)
    gathers = [l for l in text.splitlines() if " all-gather(" in l or " all-gather-start(" in l]
    assert not any(f"[{T},{D_IN}]" in l or f"[1,{T},{D_IN}]" in l for l in gathers), gathers  # x never gathered
    got = compiled(*args)
    want = _xla_step(x, w, ct)
    for g, r, tol in zip(got, want, (1e-2, 1e-2, 1e-5)):
        assert _rel(g, r) < tol
