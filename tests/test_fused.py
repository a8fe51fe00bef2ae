"""fused_projections on the XLA path: values and gradients against separate
dense_projection calls and float64, validation, jit / grad / remat, shard_map, and the
CUDA lowering on a faked H200 (one custom call per GEMM).

Which comparisons are bitwise: with one weight, fused_projections runs exactly
dense_projection's three GEMMs, so every output is bitwise equal. With several
weights, y_i and dw_i are the same sums of the same products as the separate calls,
but of a GEMM of another shape (N = D = sum d_out_i in the forward, M = D in the wgrad),
and a GEMM may order the sum by blocks chosen from its shape (Eigen's K blocking on
CPU; tile and split counts on the GPU): they agree to FP32 summation-order differences
(FP32 dw_i ~1e-7 relative; bf16 outputs within one bf16 ulp). dx is another GEMM: one
FP32 sum over K = D rounded once, where the separate calls round each partial dx_i to
bf16 and add those in bf16; it is compared with float64 and must be at least as
accurate as the separate calls'.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_cake as jc
from helpers import f64, faked_device, rand, rel_err, cuda_text, custom_call_lines

BF, F32 = jnp.bfloat16, jnp.float32
BF16_ULP = 2.0**-7  # bf16 spacing relative to the value (8 significand bits)


def _value_and_vjp(fn, x, ws, dys):
    ys, vjp = jax.vjp(fn, x, ws)
    dx, dws = vjp(dys)
    return ys, dx, dws


def _fused(deterministic=True):
    return jax.jit(lambda x, ws: jc.fused_projections(x, ws, deterministic=deterministic))


def _separate(deterministic=True):
    return jax.jit(lambda x, ws: tuple(jc.dense_projection(x, w, deterministic=deterministic) for w in ws))


def _inputs(seed, lead, d_in, d_outs, dtypes):
    x = rand(seed, (*lead, d_in), BF)
    ws = tuple(rand(seed + 1 + i, (d, d_in), dt) for i, (d, dt) in enumerate(zip(d_outs, dtypes)))
    dys = tuple(rand(seed + 100 + i, (*lead, d), BF) for i, d in enumerate(d_outs))
    return x, ws, dys


def _assert_within_bf16_ulp(a, b):
    a, b = f64(a), f64(b)
    np.testing.assert_array_less(np.abs(a - b), BF16_ULP * np.abs(b) + 1e-30)


@pytest.mark.parametrize("w_dtype", [BF, F32])
@pytest.mark.parametrize("deterministic", [True, False])
def test_one_weight_is_bitwise_dense_projection(w_dtype, deterministic):
    x, ws, dys = _inputs(1, (2, 37), 64, (48,), (w_dtype,))
    got = _value_and_vjp(_fused(deterministic), x, ws, dys)
    want = _value_and_vjp(_separate(deterministic), x, ws, dys)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# (lead dims, d_in, d_outs, dtypes): four skinny heads, QKV with GQA widths, gate/up,
# mixed master / bf16 weights, a ragged token count and a d_in the kernels do not take.
CASES = [
    ((37,), 64, (48, 64, 48, 64), (F32,) * 4),
    ((2, 333), 128, (128, 32, 32), (F32,) * 3),
    ((1011,), 256, (96, 96), (BF, BF)),
    ((3, 5), 64, (8, 24, 16), (BF, F32, BF)),
    ((64,), 20, (12, 4), (F32, BF)),
]


@pytest.mark.parametrize("lead,d_in,d_outs,dtypes", CASES)
def test_values_and_gradients_match_separate_calls(lead, d_in, d_outs, dtypes):
    x, ws, dys = _inputs(2, lead, d_in, d_outs, dtypes)
    ys, dx, dws = _value_and_vjp(_fused(), x, ws, dys)
    ys_sep, dx_sep, dws_sep = _value_and_vjp(_separate(), x, ws, dys)

    assert [y.shape for y in ys] == [(*lead, d) for d in d_outs] and all(y.dtype == BF for y in ys)
    assert dx.shape == x.shape and dx.dtype == BF
    assert [(dw.shape, dw.dtype) for dw in dws] == [(w.shape, w.dtype) for w in ws]
    for y, y_sep in zip(ys, ys_sep):
        _assert_within_bf16_ulp(y, y_sep)
    for dw, dw_sep in zip(dws, dws_sep):
        if dw.dtype == F32:  # straight from the FP32 accumulator: only the summation order may differ
            assert rel_err(dw, f64(dw_sep)) < 1e-6
        else:
            _assert_within_bf16_ulp(dw, dw_sep)

    # dx: one FP32 sum over all d_out rows, against the float64 reference.
    x64 = f64(x).reshape(-1, d_in)
    w64 = np.concatenate([f64(w.astype(BF)) for w in ws])
    dy64 = np.concatenate([f64(d).reshape(-1, d.shape[-1]) for d in dys], axis=1)
    err, err_sep = rel_err(dx.reshape(-1, d_in), dy64 @ w64), rel_err(dx_sep.reshape(-1, d_in), dy64 @ w64)
    assert err < 1e-2 and err <= err_sep * 1.05, (err, err_sep)
    # Every output and gradient against float64 too.
    for y, w in zip(ys, ws):
        assert rel_err(y.reshape(-1, w.shape[0]), x64 @ f64(w.astype(BF)).T) < 1e-2
    for dw, d in zip(dws, dys):
        tol = 1e-5 if dw.dtype == F32 else 1e-2
        assert rel_err(dw, f64(d).reshape(-1, d.shape[-1]).T @ x64) < tol


def test_fp32_master_gradient_is_not_rounded_to_bf16():
    x, ws, dys = _inputs(3, (333,), 128, (64, 32), (F32, F32))
    _, _, dws = _value_and_vjp(_fused(), x, ws, dys)
    for dw in dws:
        assert dw.dtype == F32
        assert not np.array_equal(np.asarray(dw), np.asarray(dw.astype(BF).astype(F32)))


def test_forward_rounds_fp32_weights_to_bf16():
    x, ws, _ = _inputs(4, (16,), 32, (8, 16), (F32, F32))
    a = jc.fused_projections(x, ws)
    b = jc.fused_projections(x, [w.astype(BF) for w in ws])
    for u, v in zip(a, b):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_unused_output_gets_a_zero_cotangent():
    x, ws, _ = _inputs(5, (40,), 64, (16, 24), (F32, F32))
    grads = jax.jit(jax.grad(lambda x, ws: jnp.sum(jc.fused_projections(x, ws)[0].astype(F32) ** 2), argnums=(0, 1)))
    dx, (dw0, dw1) = grads(x, ws)
    ref_dx, ref_dw0 = jax.grad(lambda x, w: jnp.sum(jc.dense_projection(x, w).astype(F32) ** 2), argnums=(0, 1))(
        x, ws[0]
    )
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(ref_dx))
    np.testing.assert_array_equal(np.asarray(dw0), np.asarray(ref_dw0))
    assert not np.any(np.asarray(dw1))


# --- validation -------------------------------------------------------------------------


def _s(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


X = _s((8, 64), BF)
W = _s((32, 64), F32)

BAD = [
    # (x, ws, kwargs, error, words that must appear)
    (_s((8, 64), F32), [W], {}, TypeError, ["x must be bfloat16", "float32"]),
    (_s((), BF), [_s((4, 1), BF)], {}, ValueError, ["x must have rank >= 1"]),
    (X, W, {}, TypeError, ["ws must be a list or tuple", "(w,)"]),
    (X, {"q": W}, {}, TypeError, ["ws must be a list or tuple", "dict"]),
    (X, (), {}, ValueError, ["ws must hold at least one weight"]),
    (X, [W, _s((16, 64), jnp.float16)], {}, TypeError, ["ws[1] must be bfloat16 or float32", "float16"]),
    (X, [W, _s((2, 16, 64), BF)], {}, ValueError, ["ws[1] must have rank 2", "[d_out, d_in]"]),
    (X, [W, W, _s((16, 48), BF)], {}, ValueError, ["ws[2].shape[1] (d_in=48)", "(d_in=64)"]),
    (X, [W, "w"], {}, TypeError, ["ws[1] must be an array", "str"]),
    (X, [W], {"deterministic": 1}, TypeError, ["deterministic must be a Python bool", "int"]),
]


@pytest.mark.parametrize("x,ws,kwargs,error,words", BAD)
def test_bad_input_raises_at_trace_time_naming_the_argument(x, ws, kwargs, error, words):
    with pytest.raises(error) as e:
        jax.eval_shape(lambda x: jc.fused_projections(x, ws, **kwargs), x)  # ws: bad before any use
    assert "fused_projections" in str(e.value)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_deterministic_is_keyword_only():
    with pytest.raises(TypeError):
        jc.fused_projections(jnp.ones((4, 8), BF), [jnp.ones((8, 8), BF)], True)


# --- jit, grad, remat -----------------------------------------------------------------------


def _mlp_loss(policy):
    """A gate/up + down block: the down projection's backward needs the fused outputs,
    which remat either recomputes or saves."""

    def block(x, wg, wu, wd):
        g, u = jc.fused_projections(x, (wg, wu))
        return jc.dense_projection(jax.nn.silu(g) * u, wd)

    block = jax.checkpoint(block, policy=policy)
    return jax.grad(lambda x, wg, wu, wd: jnp.sum(block(x, wg, wu, wd).astype(F32) ** 2), argnums=(0, 1, 2, 3))


def _count(text, op):
    return len(re.findall(rf"\b{op}\b", text))


@pytest.mark.parametrize("policy,dots", [(None, 7), (jc.remat.save_projections, 6)])
def test_checkpoint_with_save_projections_keeps_the_fused_forward(policy, dots):
    """2 projections x 3 GEMMs, plus the fused forward again unless the policy saves it."""
    args = (rand(7, (96, 64), BF), rand(8, (128, 64), F32), rand(9, (128, 64), F32), rand(10, (64, 128), F32))
    grads = jax.jit(_mlp_loss(policy))
    assert _count(grads.lower(*args).as_text(), "stablehlo.dot_general") == dots
    ref = jax.jit(_mlp_loss(jax.checkpoint_policies.everything_saveable))(*args)
    for a, b in zip(grads(*args), ref):  # remat recomputes the same values
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _skinny_step(x, ws):
    def loss(x, ws):
        return sum(jnp.sum(jnp.sin(y.astype(F32))) for y in jc.fused_projections(x, ws))

    return jax.grad(loss, argnums=(0, 1))(x, ws)


def test_cuda_lowering_is_one_custom_call_per_gemm_with_the_summed_plans():
    """4 skinny heads on a faked H200: fwd, dgrad and wgrad once each, on D = 224."""
    t, d_in = 16231, 4096
    ws = [_s((d, d_in), F32) for d in (48, 64, 48, 64)]
    text = cuda_text(_skinny_step, _s((t, d_in), BF), ws)
    fwd, dgrad, wgrad = (custom_call_lines(text, f"jax_cake_{op}") for op in ("fwd", "dgrad", "wgrad"))
    assert (len(fwd), len(dgrad), len(wgrad)) == (1, 1, 1), text
    assert "dot_general" not in text
    assert f"(tensor<1x{t}x{d_in}xbf16>, tensor<1x224x{d_in}xbf16>) -> tensor<1x{t}x224xbf16>" in fwd[0]
    assert f"(tensor<1x{t}x224xbf16>, tensor<1x224x{d_in}xbf16>) -> tensor<1x{t}x{d_in}xbf16>" in dgrad[0]
    with faked_device():
        plan = jc.plan("wgrad", tokens=t, d_in=d_in, d_out=224, out_dtype=F32)
    assert plan.uses_kernel
    assert f"-> (tensor<1x224x{d_in}xf32>, tensor<{plan.workspace_bytes}xui8>)" in wgrad[0]
    assert re.search(rf"\bsplits = {plan.splits} : i64", wgrad[0])


def test_wide_weights_take_one_wgrad_each_into_their_own_dtype():
    """gate/up-like widths (every d_out_i >= WIDE_D_OUT): one fwd and one dgrad over D, and
    each dw_i its own wgrad in w_i's dtype (no [D, d_in] buffer split afterwards)."""
    t, d_in, d_outs = 1024, 512, (1024, 512)
    ws = [_s((d_outs[0], d_in), F32), _s((d_outs[1], d_in), BF)]
    text = cuda_text(_skinny_step, _s((t, d_in), BF), ws)
    fwd, dgrad, wgrad = (custom_call_lines(text, f"jax_cake_{op}") for op in ("fwd", "dgrad", "wgrad"))
    assert (len(fwd), len(dgrad), len(wgrad)) == (1, 1, 2), text
    assert f"-> tensor<1x{t}x1536xbf16>" in fwd[0] and f"(tensor<1x{t}x1536xbf16>, " in dgrad[0]
    assert "-> (tensor<1x1024x512xf32>," in wgrad[0] or "-> (tensor<1x1024x512xf32>," in wgrad[1]
    assert any("-> (tensor<1x512x512xbf16>," in line for line in wgrad)
    # Values: each dw_i is the same GEMM as dense_projection's, so bitwise equal to it.
    x, ws, dys = _inputs(5, (256,), d_in, d_outs, (F32, BF))
    _, dx, dws = _value_and_vjp(_fused(), x, ws, dys)
    _, _, dws_sep = _value_and_vjp(_separate(), x, ws, dys)
    for dw, dw_sep in zip(dws, dws_sep):
        assert dw.dtype == dw_sep.dtype
        np.testing.assert_array_equal(np.asarray(dw, np.float32), np.asarray(dw_sep, np.float32))


def test_cuda_lowering_all_bf16_weights_take_a_bf16_wgrad():
    ws = [_s((d, 256), BF) for d in (64, 128)]
    wgrad = custom_call_lines(cuda_text(_skinny_step, _s((512, 256), BF), ws), "jax_cake_wgrad")
    assert len(wgrad) == 1 and "-> (tensor<1x192x256xbf16>," in wgrad[0]


# --- shard_map --------------------------------------------------------------------------------


def _shard_map_loss(ys):
    return sum(jnp.sum(jnp.sin(y.astype(F32))) for y in ys)


@pytest.mark.parametrize("w_dtype", [F32, BF])
def test_data_parallel_shard_map_matches_unsharded(w_dtype):
    mesh = jax.make_mesh((8,), ("dp",))
    x, ws, _ = _inputs(11, (8 * 37,), 64, (48, 16, 32), (w_dtype,) * 3)

    def local(x, ws):
        return jax.lax.psum(_shard_map_loss(jc.fused_projections(x, ws)), "dp")

    grads = jax.jit(
        jax.shard_map(jax.grad(local, argnums=(0, 1)), mesh=mesh, in_specs=(P("dp"), P()), out_specs=(P("dp"), P()))
    )
    dx, dws = grads(jax.device_put(x, NamedSharding(mesh, P("dp"))), ws)
    ref_dx, ref_dws = jax.jit(jax.grad(lambda x, ws: _shard_map_loss(jc.fused_projections(x, ws)), argnums=(0, 1)))(
        x, ws
    )
    assert dx.dtype == BF and all(dw.dtype == w_dtype for dw in dws)
    # dx rows are computed whole on their shard: the same sums as unsharded.
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(ref_dx))
    # dw: per-shard FP32 partial sums, reduced across shards in another order.
    for dw, ref in zip(dws, ref_dws):
        assert rel_err(dw, f64(ref)) < (1e-5 if w_dtype == F32 else 1e-2)


def test_fsdp_weights_under_explicit_axes():
    """Weights sharded on d_out over an Explicit mesh (FSDP): the gradients come back with
    their weights' sharding types, and equal the unsharded step."""
    from jax.sharding import AxisType, PartitionSpec as P

    x, ws, dys = _inputs(7, (64,), 32, (16, 24), (F32, F32))
    want = _value_and_vjp(_fused(), x, ws, dys)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, P("data"))
        wss = [jax.device_put(w, P("data")) for w in ws]
        dyss = tuple(jax.device_put(d, P("data")) for d in dys)
        got = jax.jit(lambda x, ws, dys: _value_and_vjp(_fused(), x, ws, dys))(xs, wss, dyss)
        assert [jax.typeof(dw).sharding.spec for dw in got[2]] == [P("data", None)] * 2
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel_err(a, f64(b)) < 1e-6
