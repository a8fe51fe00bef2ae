"""The residual add in the forward kernel (`residual=`) on CPU: values and gradients, validation,
plans, vmap, and the CUDA lowering (faked H200): one jax_cake_fwd_residual call with the residual
aliased to the result and no separate add."""

import inspect
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_raises_naming, f64, faked_device, rand

import jax_cake as jc
from jax_cake import primitives
from jax_cake.primitives import call as gemm_calls, partitioning
from jax_cake.planner import variants
from jax_cake.planner import residual as residual_planner
from jax_cake.planner.residual import plan_residual


@pytest.fixture(autouse=True)
def fused_kernels_on(monkeypatch):
    """These tests check the fused path as it runs when enabled (the planner holds it back
    until the GPU check passes at every shape; test_held_back_kernels_plan_fwd_and_an_add)."""
    monkeypatch.setattr(residual_planner, "RESIDUAL_KERNELS_ENABLED", True)


def test_held_back_kernels_plan_fwd_and_an_add(monkeypatch):
    monkeypatch.setattr(residual_planner, "RESIDUAL_KERNELS_ENABLED", False)
    with faked_device():
        p = plan_residual(tokens=8192, d_in=14336, d_out=4096)
    assert p.op == "fwd" and p.uses_kernel and "held back" in p.reason

F32, BF16 = jnp.float32, jnp.bfloat16


def _bf16_ulp(v: np.ndarray) -> np.ndarray:
    """One bf16 rounding step (the spacing of bf16 numbers) at |v|."""
    e = np.floor(np.log2(np.maximum(np.abs(v), 2.0**-126)))
    return 2.0 ** (e - 7)


def _loss(project):
    def loss(x, w, r, dy):
        return jnp.sum(project(x, w, r).astype(F32) * dy.astype(F32))

    return loss


def _fused(x, w, r):
    return jc.dense_projection(x, w, residual=r)


def _unfused(x, w, r):
    return r + jc.dense_projection(x, w)


@pytest.mark.parametrize("lead", [(48,), (2, 24)])
@pytest.mark.parametrize("w_dtype", [F32, BF16])
def test_dense_values_and_gradients_are_r_plus_the_projection(lead, w_dtype):
    d_in, d_out = 64, 40
    x, w = rand(0, lead + (d_in,), BF16), rand(1, (d_out, d_in), w_dtype)
    r, dy = rand(2, lead + (d_out,), BF16), rand(3, lead + (d_out,), BF16)
    y = jax.jit(_fused)(x, w, r)
    assert y.dtype == BF16 and y.shape == lead + (d_out,)
    # The unfused op's values (the reference path rounds as the kernel: bf16(r + bf16(x w^T))).
    np.testing.assert_array_equal(f64(y), f64(_unfused(x, w, r)))
    # Within one bf16 rounding of the once-rounded r + x w^T (XLA's fused add): the
    # product's rounding (half a step at |x w^T|) on top of the sum's (half a step at |y|).
    product = np.einsum("...k,nk->...n", f64(x), f64(w.astype(BF16)))
    exact = f64(r) + product
    bound = 0.5 * _bf16_ulp(np.maximum(np.abs(exact), np.abs(f64(y)))) + 0.5 * _bf16_ulp(product)
    assert np.all(np.abs(f64(y) - exact) <= bound * (1 + 1e-6))
    grads = jax.jit(jax.grad(_loss(_fused), argnums=(0, 1, 2)))(x, w, r, dy)
    expected = jax.grad(_loss(_unfused), argnums=(0, 1, 2))(x, w, r, dy)
    for got, want, name in zip(grads, expected, ("dx", "dw", "dr")):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(f64(got), f64(want), err_msg=name)
    np.testing.assert_array_equal(f64(grads[2]), f64(dy))  # the residual's cotangent is dy
    assert grads[1].dtype == w_dtype


def test_batched_values_and_gradients():
    b, t, d_in, d_out = 3, 32, 64, 16
    x, w = rand(4, (b, t, d_in), BF16), rand(5, (b, d_out, d_in), F32)
    r, dy = rand(6, (b, t, d_out), BF16), rand(7, (b, t, d_out), BF16)

    def fused(x, w, r):
        return jc.batched_projection(x, w, residual=r)

    def unfused(x, w, r):
        return r + jc.batched_projection(x, w)

    np.testing.assert_array_equal(f64(jax.jit(fused)(x, w, r)), f64(unfused(x, w, r)))
    grads = jax.grad(_loss(fused), argnums=(0, 1, 2))(x, w, r, dy)
    expected = jax.grad(_loss(unfused), argnums=(0, 1, 2))(x, w, r, dy)
    for got, want in zip(grads, expected):
        np.testing.assert_array_equal(f64(got), f64(want))


def test_with_grad_accumulator_or_out_sharding_the_add_is_separate_with_the_same_values():
    x, w, r = rand(8, (16, 32), BF16), rand(9, (24, 32), F32), rand(10, (16, 24), BF16)
    acc = jnp.zeros((24, 32), F32)
    want = f64(_unfused(x, w, r))
    np.testing.assert_array_equal(f64(jc.dense_projection(x, w, residual=r, grad_accumulator=acc)), want)
    mesh = jax.make_mesh((1,), ("d",), devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        y = jc.dense_projection(x, w, residual=r, out_sharding=jax.P("d", None))
    np.testing.assert_array_equal(f64(y), want)


def test_vmap_folds_into_the_kernel():
    v, t, d_in, d_out = 3, 16, 64, 32
    xs, rs = rand(11, (v, t, d_in), BF16), rand(12, (v, t, d_out), BF16)
    w = rand(13, (d_out, d_in), BF16)
    ys = jax.vmap(lambda x, r: jc.dense_projection(x, w, residual=r))(xs, rs)
    np.testing.assert_array_equal(f64(ys), f64(jax.vmap(lambda x, r: _unfused(x, w, r))(xs, rs)))
    # A shared residual, per-entry weights.
    ws = rand(14, (v, d_out, d_in), BF16)
    ys = jax.vmap(lambda x, w: jc.dense_projection(x, w, residual=rs[0]), in_axes=(None, 0))(xs[0], ws)
    np.testing.assert_array_equal(f64(ys), f64(jax.vmap(lambda w: _unfused(xs[0], w, rs[0]))(ws)))
    # On CUDA: one fused call for the whole vmapped batch, no loop.
    text = _cuda_text(
        jax.vmap(lambda x, w, r: jc.dense_projection(x, w, residual=r), in_axes=(0, None, 0)),
        jax.ShapeDtypeStruct((v, 1024, 512), BF16),
        jax.ShapeDtypeStruct((256, 512), BF16),
        jax.ShapeDtypeStruct((v, 1024, 256), BF16),
    )
    assert len(_calls(text, "jax_cake_fwd_residual")) == 1 and "stablehlo.while" not in text


def test_under_a_mesh_of_several_devices_the_values_hold():
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    t = 8 * jax.device_count()
    x, w, r = rand(15, (t, 32), BF16), rand(16, (16, 32), F32), rand(17, (t, 16), BF16)
    sharding = jax.NamedSharding(mesh, jax.P("d", None))
    xs, rs = jax.device_put(x, sharding), jax.device_put(r, sharding)
    with jax.set_mesh(mesh):
        y = jax.jit(_fused)(xs, w, rs)
    np.testing.assert_array_equal(f64(y), f64(_unfused(x, w, r)))


@pytest.mark.parametrize("r_spec", [jax.P(), jax.P(None, "data")], ids=["r_replicated", "r_on_d_out"])
def test_under_explicit_axes_a_residual_sharded_unlike_y_gives_the_unsharded_values(r_spec):
    """x on P("data") makes y token-sharded; r sharded otherwise is resharded to y for the
    add, and its cotangent comes back with r's sharding type."""
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    t = 8 * jax.device_count()
    x, w = rand(24, (t, 32), BF16), rand(25, (16, 32), F32)
    r, dy = rand(26, (t, 16), BF16), rand(27, (t, 16), BF16)
    want = _unfused(x, w, r)
    want_grads = jax.grad(_loss(_unfused), argnums=(0, 1, 2))(x, w, r, dy)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, jax.NamedSharding(mesh, jax.P("data", None)))
        ws = jax.device_put(w, jax.NamedSharding(mesh, jax.P()))
        rs = jax.device_put(r, jax.NamedSharding(mesh, r_spec))
        y = jax.jit(_fused)(xs, ws, rs)
        grads = jax.jit(jax.grad(_loss(_fused), argnums=(0, 1, 2)))(xs, ws, rs, dy)
        # dw sums over the data-sharded tokens per shard, then across shards: the unfused
        # op on the same x and w sums in that order (r replicated, so its own add is legal).
        r_rep = jax.device_put(r, jax.NamedSharding(mesh, jax.P()))
        dw_same_order = jax.jit(jax.grad(_loss(_unfused), argnums=1))(xs, ws, r_rep, dy)
    np.testing.assert_array_equal(f64(y), f64(want))
    for got, primal in zip(grads, (xs, ws, rs)):
        assert jax.typeof(got).sharding.spec == jax.typeof(primal).sharding.spec
    np.testing.assert_array_equal(f64(grads[0]), f64(want_grads[0]), err_msg="dx")
    np.testing.assert_array_equal(f64(grads[2]), f64(want_grads[2]), err_msg="dr")
    np.testing.assert_array_equal(f64(grads[1]), f64(dw_same_order), err_msg="dw")
    np.testing.assert_allclose(f64(grads[1]), f64(want_grads[1]), rtol=1e-5, atol=1e-5, err_msg="dw")


def test_output_keeps_the_checkpoint_name():
    x, w, r = rand(18, (8, 32), BF16), rand(19, (16, 32), BF16), rand(20, (8, 16), BF16)
    jaxpr = str(jax.make_jaxpr(_fused)(x, w, r))
    assert "jax_cake.output" in jaxpr


@pytest.mark.parametrize(
    "r_shape,r_dtype,error,words",
    [
        ((8, 16), F32, TypeError, ["residual", "bfloat16", "float32"]),
        ((8, 16), jnp.float16, TypeError, ["residual", "bfloat16", "float16"]),
        ((16, 8), BF16, ValueError, ["residual", "(8, 16)", "(16, 8)"]),
        ((1, 8, 16), BF16, ValueError, ["residual", "(8, 16)", "(1, 8, 16)"]),
    ],
)
def test_dense_validation_names_the_residual(r_shape, r_dtype, error, words):
    x, w = jnp.zeros((8, 32), BF16), jnp.zeros((16, 32), F32)
    r = jnp.zeros(r_shape, r_dtype)
    assert_raises_naming(error, "dense_projection: ", words, lambda: jc.dense_projection(x, w, residual=r))


def test_batched_validation_names_the_residual():
    x, w = jnp.zeros((2, 8, 32), BF16), jnp.zeros((2, 16, 32), BF16)
    with pytest.raises(ValueError, match=r"batched_projection: residual must have the output's shape \(2, 8, 16\)"):
        jc.batched_projection(x, w, residual=jnp.zeros((8, 16), BF16))
    with pytest.raises(TypeError, match="batched_projection: residual must be an array"):
        jc.batched_projection(x, w, residual=[0.0])
    # x and w are checked before the residual.
    with pytest.raises(TypeError, match="batched_projection: x must be bfloat16"):
        jc.batched_projection(x.astype(F32), w, residual=jnp.zeros((2, 8, 16), BF16))


def test_residual_is_a_keyword_of_both_ops():
    for fn in (jc.dense_projection, jc.batched_projection):
        param = inspect.signature(fn).parameters["residual"]
        assert param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is None
    assert "add_to" in primitives.fwd.__doc__


# --- plans ----------------------------------------------------------------------------------


@pytest.mark.parametrize("t,d_in,d_out", [(8192, 14336, 4096), (8192, 4096, 4096), (16384, 4096, 64), (1000, 512, 264)])
def test_plans_on_the_h200(t, d_in, d_out):
    with faked_device():
        p = plan_residual(tokens=t, d_in=d_in, d_out=d_out)
        fwd = jc.plan("fwd", tokens=t, d_in=d_in, d_out=d_out)
    assert p.op == "fwd_residual" and p.program == "fwd" and p.uses_kernel
    assert p.splits == 1 and p.reduction == "none" and p.schedule == "tiles" and p.cluster == (1, 1)
    assert variants.find_variant("fwd", p.tile, (1, 1), "bfloat16", "add") is not None
    assert variants.supports("fwd", p.tile, p.cluster, "bfloat16", 1, 0, accumulate=True)
    assert p.raster == fwd.raster and p.deterministic and "residual add" in p.reason
    # The forward's tile where the forward runs cooperative tiles (the add variants exist for all of them).
    if fwd.schedule == "tiles":
        assert p.tile == fwd.tile


def test_off_the_gpu_and_unaligned_the_plan_is_xla():
    assert not plan_residual(tokens=64, d_in=128, d_out=64).uses_kernel  # CPU
    with faked_device():
        p = plan_residual(tokens=100, d_in=4096, d_out=12)
        text = _step_text(100, 4096, 12)
    assert not p.uses_kernel
    assert "custom_call @jax_cake" not in text


def test_no_add_variant_falls_back_to_fwd_and_an_add(monkeypatch, caplog):
    real = variants.supports

    def no_add(*args, accumulate=False, **kwargs):
        return False if accumulate else real(*args, **kwargs)

    monkeypatch.setattr(variants, "supports", no_add)
    with faked_device(), caplog.at_level(logging.WARNING):
        p = plan_residual(tokens=4096, d_in=2048, d_out=1024, batch=2)
        text = _cuda_text(
            _fused,
            jax.ShapeDtypeStruct((4096, 2048), BF16),
            jax.ShapeDtypeStruct((1024, 2048), BF16),
            jax.ShapeDtypeStruct((4096, 1024), BF16),
        )
    assert p.op == "fwd" and p.uses_kernel and "separate add" in p.reason
    assert any("separate add" in rec.getMessage() for rec in caplog.records)
    assert _calls(text, "jax_cake_fwd_residual") == [] and len(_calls(text, "jax_cake_fwd")) == 1
    assert _adds(text, 4096, 1024), "the fallback must add the residual"


# --- the CUDA lowering -------------------------------------------------------------------------


def _cuda_text(fn, *args, donate=()) -> str:
    with faked_device():
        return jax.jit(fn, donate_argnums=donate).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _calls(text: str, target: str) -> list[str]:
    return [line for line in text.splitlines() if f"stablehlo.custom_call @{target}(" in line]


def _attr(call: str, name: str) -> int:
    return int(re.search(rf"\b{name} = (\d+) : i64", call).group(1))


def _adds(text: str, t: int, d_out: int) -> list[str]:
    """Elementwise adds over a [t, d_out] (or [1, t, d_out]) tensor, any dtype."""
    pattern = re.compile(rf"stablehlo\.add .*tensor<(1x)?{t}x{d_out}x(bf16|f32)>")
    return [line for line in text.splitlines() if pattern.search(line)]


def _step_text(t: int, d_in: int, d_out: int) -> str:
    """A jitted forward + backward of h = r + a w^T (the residual donated), lowered for CUDA."""

    def step(x, w, r, dy):
        y, vjp = jax.vjp(_fused, x, w, r)
        return (y,) + vjp(dy)

    args = (
        jax.ShapeDtypeStruct((t, d_in), BF16),
        jax.ShapeDtypeStruct((d_out, d_in), F32),
        jax.ShapeDtypeStruct((t, d_out), BF16),
        jax.ShapeDtypeStruct((t, d_out), BF16),
    )
    return _cuda_text(step, *args, donate=(2,))


@pytest.mark.parametrize("t,d_in,d_out", [(8192, 14336, 4096), (1000, 512, 264)])
def test_step_lowers_to_the_fused_call_in_place(t, d_in, d_out, kernel_rules_only):
    """The kernels' rules (the shipped table's xla rows send some FP32 dw to XLA's dot)."""
    text = _step_text(t, d_in, d_out)
    with faked_device():
        p = plan_residual(tokens=t, d_in=d_in, d_out=d_out)
    (call,) = _calls(text, "jax_cake_fwd_residual")
    # r (operand 2) is the result's buffer; the donated residual is the step's output y.
    alias = "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [], operand_index = 2"
    assert alias in call, call
    assert "tf.aliasing_output = 0" in text
    assert (_attr(call, "tile_m"), _attr(call, "tile_n"), _attr(call, "tile_k")) == p.tile
    assert (_attr(call, "cluster_m"), _attr(call, "cluster_n"), _attr(call, "splits")) == (1, 1, 1)
    assert _attr(call, "raster") == int(p.ffi_attributes()["raster"])
    assert f"-> tensor<1x{t}x{d_out}xbf16>" in call
    # No plain forward, no XLA GEMM, no separate add of the residual; the backward's GEMMs.
    assert _calls(text, "jax_cake_fwd") == []
    assert len(_calls(text, "jax_cake_dgrad")) == 1 and len(_calls(text, "jax_cake_wgrad")) == 1
    assert "dot_general" not in text
    assert _adds(text, t, d_out) == []


def test_batched_lowers_to_the_fused_call():
    b, t, d_in, d_out = 4, 512, 1024, 256
    text = _cuda_text(
        lambda x, w, r: jc.batched_projection(x, w, residual=r),
        jax.ShapeDtypeStruct((b, t, d_in), BF16),
        jax.ShapeDtypeStruct((b, d_out, d_in), BF16),
        jax.ShapeDtypeStruct((b, t, d_out), BF16),
        donate=(2,),
    )
    (call,) = _calls(text, "jax_cake_fwd_residual")
    assert "operand_index = 2" in call and f"-> tensor<{b}x{t}x{d_out}xbf16>" in call
    assert _adds(text, t, d_out) == [] and not re.search(rf"stablehlo\.add .*tensor<{b}x{t}x{d_out}x", text)


def test_under_a_mesh_of_several_devices_the_fused_call_falls_back_to_fwd_and_an_add(monkeypatch):
    """The fused call has no partitioning rule: outside shard_map on a mesh of several
    devices the forward (which has one) runs, then the add."""
    with faked_device():
        plan = plan_residual(tokens=64, d_in=128, d_out=64)
    assert plan.op == "fwd_residual"
    x, w, r = rand(21, (1, 64, 128), BF16), rand(22, (1, 64, 128), BF16), rand(23, (1, 64, 64), BF16)
    seen = []
    real = gemm_calls.call_sharded
    monkeypatch.setattr(gemm_calls, "call_sharded", lambda local, *a, **kw: seen.append(local.plan) or real(local, *a, **kw))
    with jax.set_mesh(jax.make_mesh((jax.device_count(),), ("d",))):
        assert not partitioning.unpartitioned(x, w, r)
        y = primitives.fwd(x, w, plan, add_to=r)
    assert [p.op for p in seen] == ["fwd"]
    np.testing.assert_array_equal(f64(y), f64(_unfused(x[0], w[0], r[0]))[None])


def test_sharded_inputs_under_jit_without_a_mesh_set_fall_back_to_fwd_and_an_add(monkeypatch):
    """No mesh in scope on a process of several devices is not 'nothing to partition':
    NamedSharding inputs under jit would have XLA replicate an unpartitioned fused call."""
    with faked_device():
        plan = plan_residual(tokens=64, d_in=128, d_out=64)
    assert plan.op == "fwd_residual"
    assert jax.device_count() > 1 and jax.sharding.get_abstract_mesh().empty
    assert not partitioning.unpartitioned()
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    x, w, r = rand(28, (1, 64, 128), BF16), rand(29, (1, 64, 128), BF16), rand(30, (1, 64, 64), BF16)
    tokens = jax.NamedSharding(mesh, jax.P(None, "d", None))
    xs, rs = jax.device_put(x, tokens), jax.device_put(r, tokens)
    seen = []
    real = gemm_calls.call_sharded
    monkeypatch.setattr(gemm_calls, "call_sharded", lambda local, *a, **kw: seen.append(local.plan) or real(local, *a, **kw))
    y = jax.jit(lambda x, w, r: primitives.fwd(x, w, plan, add_to=r))(xs, w, rs)
    assert [p.op for p in seen] == ["fwd"]
    np.testing.assert_array_equal(f64(y), f64(_unfused(x[0], w[0], r[0]))[None])
