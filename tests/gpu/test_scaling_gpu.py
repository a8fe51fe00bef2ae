"""Scaling on the GPU: jit with shardings, vmap and shard_map reach the jax_cake kernels,
and every result is within the contract of the float64 one.

Run with `pytest -m gpu tests/gpu/test_scaling_gpu.py` on a machine with an NVIDIA GPU and
the built library. The multi-GPU case runs where more than one GPU is visible.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_cake as jc

import gpu_helpers as h

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
        ct = jax.sharding.reshard(ct, jax.typeof(y).sharding)  # a NamedSharding: no mesh context needed
    return (y, *vjp(ct.astype(y.dtype)))


TOLS = (h.BF16_TOL, h.BF16_TOL, h.F32_TOL)  # y, dx (bf16), dw (FP32: w is an FP32 master)


def _assert_step_values(got, x, w, ct):
    """_step's y, dx, dw against float64 from the operands the kernels multiply (w and the
    cotangent rounded to bf16); sharded outputs are fetched whole first."""
    wb, dy = w.astype(BF16), ct.astype(BF16)
    refs = h.ref64(h.FWD2, x, wb), h.ref64(h.DGRAD2, dy, wb), h.ref64(h.WGRAD2, dy, x)
    assert [g.dtype for g in got] == [BF16, BF16, F32]
    for g, r, tol, what in zip(got, refs, TOLS, ("y", "dx", "dw"), strict=True):
        h.assert_close(jax.device_get(g), r, tol, what)


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
    _assert_step_values(got, x, w, ct)


def test_vmap_compiles_to_the_kernels_without_a_loop(gpu_library):
    x, w, ct = _inputs()
    xs, cts = x.reshape(4, T // 4, D_IN), ct.reshape(4, T // 4, D_OUT)
    # a loss linear in y: its cotangent is cts rounded to y's bf16, known without running y
    loss = lambda xs, w, cts: jnp.sum(jax.vmap(jc.dense_projection, in_axes=(0, None))(xs, w).astype(F32) * cts)
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))  # the value keeps the forward GEMM
    text = f.lower(xs, w, cts).compile().as_text()
    assert "while" not in text
    assert _kernel_calls(text) == {"fwd": 1, "dgrad": 1, "wgrad": 1}, _kernel_calls(text)
    value, (dx, dw) = f(xs, w, cts)
    assert np.isfinite(float(value))
    dy, wb = ct.astype(BF16), w.astype(BF16)
    h.assert_close(dx.reshape(T, D_IN), h.ref64(h.DGRAD2, dy, wb), h.BF16_TOL, "dx")
    h.assert_close(dw, h.ref64(h.WGRAD2, dy, x), h.F32_TOL, "dw")


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
    _assert_step_values(compiled(*args), x, w, ct)
