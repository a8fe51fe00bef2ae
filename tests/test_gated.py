"""gated_projection and swiglu_mlp on the XLA path: values and gradients against float64
and, bitwise, against the explicit jnp composition of their defined semantics; validation;
jit / grad / remat with the policies; vmap; shard_map; d_ff sharded under jit; and the
CUDA lowering on a faked H200 (the custom calls, the remat counts, determinism).

The semantics (jax_cake.reference.gate / gate_grad, jax_cake.pipeline.gated):
g = bf16(x Wg^T), u = bf16(x Wu^T); h = bf16(act(g) * u) in FP32; dg = bf16(dh * u *
act'(g)), du = bf16(dh * act(g)) in FP32; dx one GEMM over K = 2F (the gate and up rows
interleaved); dW from the wgrad's FP32 accumulator in the weight's dtype.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_cake as jc
from helpers import assert_raises_naming, assert_same_values, f64, rand, rel_err, cuda_text, custom_call_lines
from jax_cake import contract
from jax_cake.pipeline.fused import WIDE_D_OUT
from test_partitioning import collectives

BF, F32 = jnp.bfloat16, jnp.float32
ACTS = ("silu", "gelu")


# --- references ------------------------------------------------------------------------------


def _bf16(a):
    return np.asarray(a, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def _act64(z, activation):
    """(act(z), act'(z)) in float64."""
    if activation == "silu":
        s = 1.0 / (1.0 + np.exp(-z))
        return z * s, s * (1.0 + z * (1.0 - s))
    # 0.5 (1 + tanh(y)) as sigmoid(2 y) = exp(-log(1 + exp(-2 y))): float64 rounds
    # 1 + tanh(y) to exactly 0 for z below about -7.2.
    c = np.sqrt(2.0 / np.pi)
    s = np.exp(-np.logaddexp(0.0, -2.0 * c * (z + 0.044715 * z**3)))
    return z * s, s + z * (2.0 * s * (1.0 - s)) * c * (1.0 + 3 * 0.044715 * z * z)


def _reference64(x, w_gate, w_up, dh, activation):
    """The defined semantics in float64 from the same bf16 operands: (h unrounded, dx, dWg,
    dWu), with g, u, dg, du rounded to bf16 where the definition rounds them."""
    X, Wg, Wu = (f64(a).reshape(-1, a.shape[-1]) for a in (x, w_gate.astype(BF), w_up.astype(BF)))
    G, U = _bf16(X @ Wg.T), _bf16(X @ Wu.T)
    A, S = _act64(G, activation)
    D = f64(dh).reshape(G.shape)
    DG, DU = _bf16(D * U * S), _bf16(D * A)
    return A * U, DG @ Wg + DU @ Wu, DG.T @ X, DU.T @ X


def _composition(x, w_gate, w_up, dh, activation):
    """The defined semantics as plain jnp (the GEMMs as lax.dot_general with FP32
    accumulation): (h, dx, dWg, dWu, dg, du). F < WIDE_D_OUT: one wgrad over the
    interleaved 2F rows; else one per weight."""
    f, d_in = w_gate.shape
    x2 = x.reshape(-1, d_in)
    wg, wu = w_gate.astype(BF), w_up.astype(BF)
    dot = lambda a, b: jnp.dot(a, b, preferred_element_type=F32)
    g, u = dot(x2, wg.T).astype(BF), dot(x2, wu.T).astype(BF)
    gf, uf = g.astype(F32), u.astype(F32)
    if activation == "silu":
        s = jax.nn.sigmoid(gf)
        act, slope = gf * s, s * (1.0 + gf * (1.0 - s))
    else:
        c, a = 0.7978845608028654, 0.044715
        s = jax.nn.sigmoid((2.0 * c) * (gf + a * (gf * gf * gf)))
        act = gf * s
        slope = s + gf * (2.0 * s * (1.0 - s)) * (c * (1.0 + 3.0 * a * (gf * gf)))
    h = (act * uf).astype(BF)
    dhf = dh.reshape(-1, f).astype(F32)
    dg, du = (dhf * uf * slope).astype(BF), (dhf * act).astype(BF)
    # Gate and up interleaved in blocks of b rows (16, the kernels' block, where it divides F;
    # these operands are on one device):
    # rows 2bj .. 2bj + b - 1 are Wg[bj .. bj + b - 1], the next b the same rows of Wu.
    b = contract.GATE_BLOCK if f % contract.GATE_BLOCK == 0 else 1
    w2 = jnp.stack([wg.reshape(f // b, b, d_in), wu.reshape(f // b, b, d_in)], axis=1).reshape(2 * f, d_in)
    d2 = jnp.stack([dg.reshape(-1, f // b, b), du.reshape(-1, f // b, b)], axis=2).reshape(-1, 2 * f)
    dx = jc.reference.dgrad(d2[None], w2[None])[0]  # the library's batched GEMM form
    if f >= WIDE_D_OUT:
        dwg, dwu = dot(dg.T, x2).astype(w_gate.dtype), dot(du.T, x2).astype(w_up.dtype)
    else:
        dw_dtype = BF if w_gate.dtype == BF and w_up.dtype == BF else F32
        dw = dot(d2.T, x2).astype(dw_dtype).reshape(f // b, 2, b, d_in)
        dwg, dwu = (dw[:, i].reshape(f, d_in).astype(w.dtype) for i, w in enumerate((w_gate, w_up)))
    lead = x.shape[:-1]
    return h.reshape(*lead, f), dx.reshape(x.shape), dwg, dwu, dg, du


def _gated_vjp(activation, deterministic=True):
    def step(x, wg, wu, dh):
        h, vjp = jax.vjp(lambda x, a, b: jc.gated_projection(x, a, b, activation=activation, deterministic=deterministic), x, wg, wu)
        return (h, *vjp(dh))

    return jax.jit(step)


def _inputs(seed, lead, d_in, f, w_dtype, d_out=None):
    x = rand(seed, (*lead, d_in), BF)
    wg, wu = ((0.1 * rand(seed + i, (f, d_in), F32)).astype(w_dtype) for i in (1, 2))
    dh = rand(seed + 3, (*lead, f), BF)
    if d_out is None:
        return x, wg, wu, dh
    wd = (0.1 * rand(seed + 4, (d_out, f), F32)).astype(w_dtype)
    dy = rand(seed + 5, (*lead, d_out), BF)
    return x, wg, wu, wd, dy


# (lead, d_in, F): F < WIDE_D_OUT (one wgrad over 2F) and F >= WIDE_D_OUT (one per weight)
CASES = [((2, 37), 64, 48), ((3, 5), 32, 8), ((256,), 64, WIDE_D_OUT)]


# --- values ------------------------------------------------------------------------------------


@pytest.mark.parametrize("lead,d_in,f", CASES)
@pytest.mark.parametrize("w_dtype", [F32, BF])
@pytest.mark.parametrize("activation", ACTS)
def test_gated_projection_matches_float64(activation, w_dtype, lead, d_in, f):
    x, wg, wu, dh = _inputs(1, lead, d_in, f, w_dtype)
    h, dx, dwg, dwu = _gated_vjp(activation)(x, wg, wu, dh)
    assert (h.shape, h.dtype, dx.shape, dx.dtype) == ((*lead, f), BF, x.shape, BF)
    assert (dwg.dtype, dwu.dtype, dwg.shape) == (w_dtype, w_dtype, wg.shape)
    H, DX, DWG, DWU = _reference64(x, wg, wu, dh, activation)
    assert rel_err(h.reshape(-1, f), H) < 1e-2
    assert rel_err(dx.reshape(-1, d_in), DX) < 1e-2
    # dW against float64 wgrads of the definition's dg, du (FP32, rounded to bf16: taken
    # from the composition, bitwise the op's; test below): only the wgrad's FP32 sum is left.
    *_, dg, du = _composition(x, wg, wu, dh, activation)
    X = f64(x).reshape(-1, d_in)
    tol = 1e-5 if w_dtype == F32 else 1e-2
    assert rel_err(dwg, f64(dg).T @ X) < tol and rel_err(dwu, f64(du).T @ X) < tol
    # Against the all-float64 reference (dg, du computed in float64): where float64 and the
    # definition's FP32 fall on two sides of a bf16 rounding boundary, that entry moves one
    # bf16 ulp (about 0.01 % of dg and du at F = 512): up to ~1e-4 in dW.
    tol = 3e-4 if w_dtype == F32 else 1e-2
    assert rel_err(dwg, DWG) < tol and rel_err(dwu, DWU) < tol


@pytest.mark.parametrize("lead,d_in,f", CASES)
@pytest.mark.parametrize("w_dtype", [F32, BF])
@pytest.mark.parametrize("activation", ACTS)
def test_gated_projection_matches_the_jnp_composition(activation, w_dtype, lead, d_in, f):
    """The XLA path runs the defined semantics (this pins them for a kernel): the same
    GEMMs, roundings and layout as the plain jnp composition. XLA's CPU fusions may round
    the FP32 activation differently inside the op's graph (seen on a 2-core machine: one
    element of h one bf16 step apart), so h and dx may differ from the composition's in under
    1 % of their elements (by under half a bf16 step relative, in norm), and the weight
    gradients within their dtype's contract (FP32 1e-5, bf16 half a step)."""
    x, wg, wu, dh = _inputs(2, lead, d_in, f, w_dtype)
    got = _gated_vjp(activation)(x, wg, wu, dh)
    want = jax.jit(lambda *a: _composition(*a, activation)[:4])(x, wg, wu, dh)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if i < 2:  # a few elements a bf16 step apart at most
            assert np.mean(a != b) < 1e-2 and rel_err(a, b) < 2.0**-8, ("h", "dx")[i]
        else:  # FP32: a few dg, du elements a bf16 step apart; bf16: a few roundings flipped
            assert rel_err(a, b) < (1e-5 if want[i].dtype == F32 else 2.0**-8)


def test_fp32_master_gradients_are_not_rounded_to_bf16():
    x, wg, wu, dh = _inputs(3, (333,), 64, 48, F32)
    _, _, dwg, dwu = _gated_vjp("silu")(x, wg, wu, dh)
    for dw in (dwg, dwu):
        assert dw.dtype == F32 and not np.array_equal(np.asarray(dw), np.asarray(dw.astype(BF).astype(F32)))


def test_mixed_weight_dtypes():
    x, wg, wu, dh = _inputs(4, (64,), 32, 24, F32)
    h, dx, dwg, dwu = _gated_vjp("gelu")(x, wg, wu.astype(BF), dh)
    assert (dwg.dtype, dwu.dtype) == (F32, BF)
    want = _gated_vjp("gelu")(x, wg, wu, dh)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(want[0]))  # the bf16 cast is the product's operand
    np.testing.assert_array_equal(np.asarray(dwg), np.asarray(want[2]))
    np.testing.assert_array_equal(np.asarray(dwu), np.asarray(want[3].astype(BF)))


def _mlp_vjp(activation, with_residual=False):
    def step(x, wg, wu, wd, dy, r):
        fn = lambda x, a, b, c, r: jc.swiglu_mlp(x, a, b, c, activation=activation, residual=r if with_residual else None)
        y, vjp = jax.vjp(fn, x, wg, wu, wd, r)
        return (y, *vjp(dy))

    return jax.jit(step)


@pytest.mark.parametrize("w_dtype", [F32, BF])
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_swiglu_mlp_matches_the_composition_and_float64(activation, w_dtype, with_residual):
    lead, d_in, f, d_out = (2, 45), 64, 96, 48
    x, wg, wu, wd, dy = _inputs(5, lead, d_in, f, w_dtype, d_out)
    r = rand(11, (*lead, d_out), BF)
    y, dx, dwg, dwu, dwd, dr = _mlp_vjp(activation, with_residual)(x, wg, wu, wd, dy, r)
    assert (y.shape, y.dtype, dwd.dtype) == ((*lead, d_out), BF, w_dtype)

    def composition(x, wg, wu, wd, dy, r):
        h = jc.gated_projection(x, wg, wu, activation=activation)
        y2 = jnp.dot(h.reshape(-1, f), wd.astype(BF).T, preferred_element_type=F32).astype(BF)
        if with_residual:
            y2 = (r.reshape(y2.shape).astype(F32) + y2.astype(F32)).astype(BF)
        dy2 = dy.reshape(-1, d_out)
        dh = jnp.dot(dy2, wd.astype(BF), preferred_element_type=F32).astype(BF).reshape(*lead, f)
        dwd = jnp.dot(dy2.T, h.reshape(-1, f), preferred_element_type=F32).astype(wd.dtype)
        _, dx, dwg, dwu, _, _ = _composition(x, wg, wu, dh, activation)
        return y2.reshape(*lead, d_out), dx, dwg, dwu, dwd, h

    cy, cdx, cdwg, cdwu, cdwd, h = jax.jit(composition)(x, wg, wu, wd, dy, r)
    for a, b in ((y, cy), (dx, cdx), (dwg, cdwg), (dwu, cdwu), (dwd, cdwd)):
        assert a.dtype == b.dtype
    for a, b in ((y, cy), (dwg, cdwg), (dwu, cdwu), (dwd, cdwd)):
        assert_same_values(a, b)
    # dx is one dot over K = 2F on both sides, but XLA's CPU dot may sum the FP32
    # products in another order for the op's batched [1, T, 2F] form than for the
    # composition's [T, 2F] (which depends on the host CPU: on an AMD EPYC, 2026-12-03,
    # one element of 5760 came out one bf16 step apart). Allow that: a single step, rarely.
    a, b = np.asarray(dx, np.float32), np.asarray(cdx, np.float32)
    step = np.spacing(np.abs(b).astype(jnp.bfloat16).astype(np.float32)) * 2.0**16  # bf16 ulp
    off = a != b
    assert off.mean() <= 1e-3 and np.all(np.abs(a - b)[off] <= np.maximum(step[off], 2.0**-133)), off.sum()
    if with_residual:
        np.testing.assert_array_equal(np.asarray(dr), np.asarray(dy))
    # float64: y from the bf16 h of the same definition, and the down projection's grads.
    H, Wd = f64(h).reshape(-1, f), f64(wd.astype(BF))
    Y = H @ Wd.T + (f64(r).reshape(-1, d_out) if with_residual else 0.0)
    assert rel_err(y.reshape(-1, d_out), Y) < 1e-2
    assert rel_err(dwd, f64(dy).reshape(-1, d_out).T @ H) < (1e-5 if w_dtype == F32 else 1e-2)
    DH = f64(dy).reshape(-1, d_out) @ Wd
    _, DX, _, _ = _reference64(x, wg, wu, DH, activation)
    assert rel_err(dx.reshape(-1, d_in), DX) < 2e-2  # dh rounded to bf16 once more


def test_leading_dims_are_tokens():
    x, wg, wu, dh = _inputs(6, (2, 3, 7), 32, 16, F32)
    got = _gated_vjp("silu")(x, wg, wu, dh)
    flat = _gated_vjp("silu")(x.reshape(42, 32), wg, wu, dh.reshape(42, 16))
    for a, b in zip(got, flat):
        np.testing.assert_array_equal(np.asarray(a, np.float32).reshape(np.shape(b)), np.asarray(b, np.float32))


# --- validation --------------------------------------------------------------------------------


def _s(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


X, W = _s((8, 64), BF), _s((32, 64), F32)
BAD = [
    # (x, w_gate, w_up, kwargs, error, words)
    (_s((8, 64), F32), W, W, {}, TypeError, ["x must be bfloat16", "float32"]),
    (_s((), BF), _s((4, 1), BF), _s((4, 1), BF), {}, ValueError, ["x must have rank >= 1"]),
    (X, "w", W, {}, TypeError, ["w_gate must be an array", "str"]),
    (X, W, _s((32, 64), jnp.float16), {}, TypeError, ["w_up must be bfloat16 or float32", "float16"]),
    (X, _s((2, 32, 64), F32), W, {}, ValueError, ["w_gate must have rank 2", "[d_ff, d_in]"]),
    (X, W, _s((32, 48), F32), {}, ValueError, ["w_up.shape[1] (d_in=48)", "(d_in=64)"]),
    (X, W, _s((16, 64), F32), {}, ValueError, ["w_gate and w_up must have the same shape", "(16, 64)"]),
    (X, W, W, {"activation": "relu"}, ValueError, ["activation must be", "'silu'", "'gelu'", "'relu'"]),
    (X, W, W, {"activation": jax.nn.silu}, ValueError, ["activation must be", "'silu' or 'gelu'"]),
    (X, W, W, {"deterministic": 1}, TypeError, ["deterministic must be a Python bool", "int"]),
]


@pytest.mark.parametrize("x,wg,wu,kwargs,error,words", BAD)
def test_bad_input_raises_at_trace_time_naming_the_argument(x, wg, wu, kwargs, error, words):
    for fn, call in (
        ("gated_projection", lambda: jax.eval_shape(lambda x: jc.gated_projection(x, wg, wu, **kwargs), x)),
        ("swiglu_mlp", lambda: jax.eval_shape(lambda x: jc.swiglu_mlp(x, wg, wu, _s((16, 32), F32), **kwargs), x)),
    ):
        assert_raises_naming(error, f"{fn}: ", words, call)


@pytest.mark.parametrize(
    "wd,residual,error,words",
    [
        ("w", None, TypeError, ["w_down must be an array"]),
        (_s((16, 32), jnp.int8), None, TypeError, ["w_down must be bfloat16 or float32", "int8"]),
        (_s((16, 32, 1), F32), None, ValueError, ["w_down must have rank 2", "[d_out, d_ff]"]),
        (_s((16, 24), F32), None, ValueError, ["w_down.shape[1] (d_ff=24)", "w_gate.shape[0] (d_ff=32)"]),
        (_s((16, 32), F32), _s((8, 16), F32), TypeError, ["residual must be bfloat16", "float32"]),
        (_s((16, 32), F32), _s((8, 32), BF), ValueError, ["residual must have the output's shape (8, 16)"]),
    ],
)
def test_swiglu_mlp_checks_the_down_weight_and_the_residual(wd, residual, error, words):
    call = lambda: jax.eval_shape(lambda x, r: jc.swiglu_mlp(x, W, W, wd, residual=r), X, residual)
    assert_raises_naming(error, "swiglu_mlp: ", words, call)


def test_options_are_keyword_only():
    x, w = jnp.ones((4, 8), BF), jnp.ones((8, 8), BF)
    with pytest.raises(TypeError):
        jc.gated_projection(x, w, w, "silu")
    with pytest.raises(TypeError):
        jc.swiglu_mlp(x, w, w, w, "silu")


# --- remat ---------------------------------------------------------------------------------------

POLICIES = {
    "plain": None,  # saves nothing but the checkpoint's inputs (x and the weights)
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "save_gated_preactivation": jc.remat.save_gated_preactivation,
    "save_projections": jc.remat.save_projections,
}


def _remat_grads(policy, mlp: bool, residual=False):
    def block(x, wg, wu, wd, r):
        if mlp:
            return jc.swiglu_mlp(x, wg, wu, wd, residual=r if residual else None)
        return jc.gated_projection(x, wg, wu)

    if policy != "none":
        block = jax.checkpoint(block, policy=policy)
    loss = lambda *a: jnp.sum(jnp.sin(block(*a).astype(F32)))
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("mlp", [False, True], ids=["gated", "mlp"])
def test_checkpoint_recomputes_the_same_values(policy, mlp):
    x, wg, wu, wd, _ = _inputs(7, (96,), 64, 48, F32, 32)
    r = rand(12, (96, 32), BF)
    got = jax.jit(_remat_grads(POLICIES[policy], mlp, residual=True))(x, wg, wu, wd, r)
    want = jax.jit(_remat_grads("none", mlp, residual=True))(x, wg, wu, wd, r)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _counts(text):
    """(forward, input-gradient, weight-gradient) GEMM calls; dx of the gated projection
    is a dgrad that reads the cotangent's halves (jax_cake_dgrad_gate_up)."""
    targets = (("fwd",), ("dgrad", "dgrad_gate_up"), ("wgrad",))
    return tuple(sum(len(custom_call_lines(text, f"jax_cake_{op}")) for op in ops) for ops in targets)


T, D_IN, F, D_OUT = 1024, 256, 128, 256
ARGS = (_s((T, D_IN), BF), _s((F, D_IN), F32), _s((F, D_IN), F32), _s((D_OUT, F), F32), _s((T, D_OUT), BF))


@pytest.mark.parametrize(
    "policy,gated_fwd,mlp_fwd",
    [
        ("plain", 2, 3),  # the gate/up GEMM again in the backward (h and gu recomputed)
        ("nothing_saveable", 2, 3),
        ("save_gated_preactivation", 1, 2),  # gu kept; h recomputed from it elementwise
        ("save_projections", 1, 2),
    ],
)
def test_checkpoint_policies_in_the_cuda_lowering(policy, gated_fwd, mlp_fwd):
    """Forward GEMMs in the lowered step: the down projection's forward runs once (its
    backward needs h, recomputed from gu without a GEMM where gu is saved)."""
    gated = cuda_text(_remat_grads(POLICIES[policy], False), *ARGS)
    assert _counts(gated) == (gated_fwd, 1, 1) and "dot_general" not in gated
    mlp = cuda_text(_remat_grads(POLICIES[policy], True), *ARGS)
    assert _counts(mlp) == (mlp_fwd, 2, 2) and "dot_general" not in mlp


# --- the CUDA lowering ---------------------------------------------------------------------------


def _step(x, wg, wu, wd, r):
    return _remat_grads("none", True, residual=True)(x, wg, wu, wd, r)


@pytest.mark.parametrize("f", [F, WIDE_D_OUT])
def test_cuda_lowering_one_fwd_over_2f_one_dgrad_over_k_2f(f):
    args = (_s((T, D_IN), BF), _s((f, D_IN), F32), _s((f, D_IN), BF), _s((D_OUT, f), F32), _s((T, D_OUT), BF))
    text = cuda_text(_step, *args)
    fwd, dgrad, wgrad = (custom_call_lines(text, f"jax_cake_{op}") for op in ("fwd", "dgrad", "wgrad"))
    assert "dot_general" not in text
    # the gate/up forward (the down projection's is the fused residual call)
    assert len(fwd) == 1 and f"(tensor<1x{T}x{D_IN}xbf16>, tensor<1x{2 * f}x{D_IN}xbf16>) -> tensor<1x{T}x{2 * f}xbf16>" in fwd[0]
    (residual,) = custom_call_lines(text, "jax_cake_fwd_residual")
    assert f"(tensor<1x{T}x{f}xbf16>, tensor<1x{D_OUT}x{f}xbf16>, tensor<1x{T}x{D_OUT}xbf16>)" in residual
    # dgrads: the down projection's dh, and ONE dx over K = 2F that reads dg, du and the
    # interleaved weight in place
    assert len(dgrad) == 1 and f"(tensor<1x{T}x{D_OUT}xbf16>, tensor<1x{D_OUT}x{f}xbf16>)" in dgrad[0]
    (dx,) = custom_call_lines(text, "jax_cake_dgrad_gate_up")
    halves = f"tensor<1x{T}x{f}xbf16>, tensor<1x{T}x{f}xbf16>, tensor<1x{2 * f}x{D_IN}xbf16>"
    assert f"({halves}) -> tensor<1x{T}x{D_IN}xbf16>" in dx
    shapes = sorted(re.search(r"-> \(tensor<([0-9x]+x[a-z0-9]+)>", c).group(1) for c in wgrad)
    if f < WIDE_D_OUT:  # one wgrad over 2F (FP32: one weight is FP32), split by rows
        assert shapes == sorted([f"1x{2 * f}x{D_IN}xf32", f"1x{D_OUT}x{f}xf32"])
    else:  # one per weight, straight into its dtype
        assert shapes == sorted([f"1x{f}x{D_IN}xf32", f"1x{f}x{D_IN}xbf16", f"1x{D_OUT}x{f}xf32"])


def test_deterministic_lowering_has_no_arrival_order_reduction():
    """deterministic=True: every wgrad plan of the gated op is a det program (no arrival-
    order split-K); forcing the split program shows the check sees one."""
    t, d_in, f = 16172, 4096, 24  # skinny 2F = 48: split-K over the tokens

    def step():  # a new function per trace: the plans are made at trace time
        loss = lambda *a: jnp.sum(jnp.sin(jc.gated_projection(*a).astype(F32)))
        return lambda x, wg, wu: jax.grad(loss, argnums=(0, 1, 2))(x, wg, wu)

    args = (_s((t, d_in), BF), _s((f, d_in), F32), _s((f, d_in), F32))
    (wgrad,) = custom_call_lines(cuda_text(step(), *args), "jax_cake_wgrad")
    reduction = int(re.search(r"\breduction = (\d+) : i64", wgrad).group(1))
    assert reduction != contract.REDUCTION_ARRIVAL and int(re.search(r"\bsplits = (\d+)", wgrad).group(1)) > 1
    with jc.planner.force("split"):
        (forced,) = custom_call_lines(cuda_text(step(), *args), "jax_cake_wgrad")
    assert int(re.search(r"\breduction = (\d+) : i64", forced).group(1)) == contract.REDUCTION_ARRIVAL


# --- vmap ----------------------------------------------------------------------------------------


def test_vmap_shared_weights_folds_into_tokens():
    """h and dx: the vmapped axis folds into the tokens (the same GEMMs as leading dims,
    bitwise); dW: one wgrad per vmapped entry, summed over the entries by vmap (another
    FP32 summation order)."""
    x, wg, wu, dh = _inputs(8, (3, 40), 32, 24, F32)
    vmapped = lambda x, a, b: jax.vmap(lambda x: jc.gated_projection(x, a, b))(x)
    got = _gated_vjp_of(vmapped)(x, wg, wu, dh)
    want = _gated_vjp_of(jc.gated_projection)(x, wg, wu, dh)
    for a, b in zip(got[:2], want[:2]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(got[2:], want[2:]):
        assert rel_err(a, f64(b)) < 1e-6


def _gated_vjp_of(fn):
    def step(x, wg, wu, dh):
        h, vjp = jax.vjp(fn, x, wg, wu)
        return (h, *vjp(dh))

    return jax.jit(step)


def test_vmap_per_entry_weights_matches_a_loop():
    x, wg, wu, dh = _inputs(9, (3, 40), 32, 24, F32)
    wg, wu = jnp.stack([wg, 1.5 * wg, -wg]), jnp.stack([wu, wu, 0.5 * wu])
    step = lambda x, a, b, d: _gated_vjp("gelu")(x, a, b, d)
    got = jax.jit(jax.vmap(step))(x, wg, wu, dh)
    for i in range(3):
        want = step(x[i], wg[i], wu[i], dh[i])
        for a, b in zip(got, want):
            tol = 1e-5 if b.dtype == F32 else 1e-2  # the batched GEMM may order FP32 sums otherwise
            assert rel_err(a[i], f64(b)) < tol


# --- shard_map and d_ff sharded under jit -----------------------------------------------------------


def _loss(h):
    return jnp.sum(jnp.sin(h.astype(F32)))


@pytest.mark.parametrize("case", ["dp", "tp"])
def test_shard_map_matches_unsharded(case):
    mesh = jax.make_mesh((8,), ("d",))
    x, wg, wu, _ = _inputs(10, (8 * 16,), 32, 64, F32)
    x_spec, w_spec = (P("d"), P()) if case == "dp" else (P(), P("d"))

    def local(x, a, b):
        return jax.lax.psum(_loss(jc.gated_projection(x, a, b)), "d")

    grads = jax.jit(
        jax.shard_map(
            jax.grad(local, argnums=(0, 1, 2)), mesh=mesh, in_specs=(x_spec, w_spec, w_spec), out_specs=(x_spec, w_spec, w_spec)
        )
    )
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    got = grads(put(x, x_spec), put(wg, w_spec), put(wu, w_spec))
    want = jax.jit(jax.grad(lambda *a: _loss(jc.gated_projection(*a)), argnums=(0, 1, 2)))(x, wg, wu)
    assert [g.dtype for g in got] == [BF, F32, F32]
    assert rel_err(got[0], f64(want[0])) < 1e-2
    for a, b in zip(got[1:], want[1:]):
        assert rel_err(a, f64(b)) < 1e-5


def _sharded_step(op):
    def step(x, wg, wu, wd, ct):
        y, vjp = jax.vjp(op, x, wg, wu, wd)
        if jax.typeof(y).sharding.mesh.axis_types and AxisType.Explicit in jax.typeof(y).sharding.mesh.axis_types:
            ct = jax.sharding.reshard(ct, jax.typeof(y).sharding.spec)
        return (y, *vjp(ct.astype(y.dtype)))

    return step


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("f", [64, WIDE_D_OUT])
@pytest.mark.parametrize("mlp", [False, True], ids=["gated", "mlp"])
def test_d_ff_sharded_gives_the_unsharded_values_and_gathers_nothing(mlp, f, explicit):
    """w_gate and w_up column-parallel on d_ff (P('model')), x replicated; for the MLP w_down
    row-parallel (P(None, 'model')). Each shard holds its gate and up rows together (the
    interleaved stack): the only collectives are the reductions over the sharded d_ff:
    dx's all-reduce (and the MLP's y), in FP32. No all-gather of x or of any weight."""
    t, d_in, d_out = 64, 32, 48
    mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Explicit if explicit else AxisType.Auto,))
    x, wg, wu, wd, ct = _inputs(20, (t,), d_in, f, F32, d_out)
    if mlp:
        op, y_spec = (lambda x, a, b, c: jc.swiglu_mlp(x, a, b, c)), P()
    else:
        op, y_spec = (lambda x, a, b, c: jc.gated_projection(x, a, b)), P(None, "model")
        ct = rand(21, (t, f), BF)
    specs = (P(), P("model"), P("model"), P(None, "model"), y_spec)
    named = lambda s: NamedSharding(mesh, s)
    out = None if explicit else tuple(map(named, (y_spec,) + specs[:4]))
    step = jax.jit(_sharded_step(op), out_shardings=out)
    args = [jax.device_put(a, named(s)) for a, s in zip((x, wg, wu, wd, ct), specs)]
    with jax.set_mesh(mesh):
        compiled = step.lower(*args).compile()
        got = compiled(*args)
    want = jax.jit(_sharded_step(op))(x, wg, wu, wd, ct)
    for a, b in zip(got[: 5 if mlp else 4], want):  # (the gated op leaves w_down's a zero)
        assert a.dtype == b.dtype
        tol = 1e-5 if b.dtype == F32 else 1e-2
        assert rel_err(a, f64(b)) < tol
    if explicit:
        assert [partitioning_spec(g) for g in got[2:4]] == [("model",), ("model",)]
    calls = _collectives(compiled.as_text())
    assert not any(kind == "all-gather" for kind, _ in calls), calls
    reduced = {(kind, _dims(s)[-2:]) for kind, s in calls}
    expected = {("all-reduce", (t, d_in))} | ({("all-reduce", (t, d_out))} if mlp else set())
    assert reduced == expected, calls
    assert all(s.startswith("f32") for _, s in calls), calls


_TUPLE_COLLECTIVE = re.compile(r"= \(([^=]*?)\) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)\(")


def _dims(shape: str) -> tuple[int, ...]:
    return tuple(int(d) for d in shape[shape.index("[") + 1 : -1].split(",") if d)


def _collectives(text):
    """test_partitioning.collectives, with each result of a combined (tuple) collective."""
    found = list(collectives(text))
    for m in map(_TUPLE_COLLECTIVE.search, text.splitlines()):
        if m:
            shapes = re.findall(r"[a-z0-9]+\[[0-9,]*\]", m.group(1))
            found = [c for c in found if c != (m.group(2), shapes[0])] + [(m.group(2), s) for s in shapes]
    return [(kind, shape) for kind, shape in found if not shape.endswith("[]")]


def partitioning_spec(a):
    spec = jax.typeof(a).sharding.spec
    return tuple(e for e in spec if e is not None)


@pytest.mark.parametrize("enabled", [False, True], ids=["held_back", "enabled"])
@pytest.mark.parametrize("activation", ["silu"])  # the compiled gated variants
def test_cuda_lowering_of_the_gated_kernel_epilogue(activation, enabled, monkeypatch):
    """At the Llama gate/up shape (the planner's 128x256 c2x1 forward) the epilogue runs on
    the gated ping-pong 128x192 c2x1 tile: ONE jax_cake_fwd_gated call writing gu and h,
    its activation code an attribute; switched off, the plain forward and an XLA pass."""
    from jax_cake.planner import gated as gated_planner

    monkeypatch.setattr(gated_planner, "GATED_EPILOGUE_ENABLED", enabled)
    t, d_in, f = 8192, 4096, 14336
    args = (_s((t, d_in), BF), _s((f, d_in), F32), _s((f, d_in), F32))
    text = cuda_text(lambda x, a, b: jc.gated_projection(x, a, b, activation=activation), *args)
    fused, plain = custom_call_lines(text, "jax_cake_fwd_gated"), custom_call_lines(text, "jax_cake_fwd")
    if not enabled:
        assert not fused and len(plain) == 1
        return
    assert not plain and len(fused) == 1
    assert f"-> (tensor<1x{t}x{2 * f}xbf16>, tensor<1x{t}x{f}xbf16>)" in fused[0]
    assert f"activation = {contract.ACTIVATION_CODES[activation]} : i64" in fused[0]
    assert "tile_n = 192 : i64" in fused[0] and "cluster_m = 2 : i64" in fused[0]
    assert f"schedule = {contract.SCHEDULE_PINGPONG} : i64" in fused[0]


# --- the gated plan's tile rule ------------------------------------------------------------


@pytest.mark.parametrize(
    "t, d_in, f, want",
    [
        (8192, 4096, 14336, ((128, 192, 64), (2, 1), "pingpong")),  # Llama-3-8B gate/up
        (16384, 8192, 28672, ((128, 192, 64), (2, 1), "pingpong")),  # Llama-3-70B
        (1024, 256, 512, None),  # small: the planner's narrower tile, then the pass
        (8192, 4096, 14328, None),  # d_ff not a multiple of 16
    ],
)
def test_plan_gated_puts_the_epilogue_on_the_wide_pingpong_tile(t, d_in, f, want):
    from helpers import H200

    from jax_cake.planner.gated import plan_gated

    p = plan_gated(tokens=t, d_in=d_in, d_out=2 * f, activation="silu", device=H200)
    if want is None:
        assert p.op == "fwd" and "then an XLA pass (" in p.reason, jc.explain(p)
        return
    assert p.op == "fwd_gated" and (p.tile, p.cluster, p.schedule) == want, jc.explain(p)
    assert "128x192" in p.reason and "ping-pong" in p.reason
    off = plan_gated(tokens=t, d_in=d_in, d_out=2 * f, activation="silu", device=H200, epilogue=False)
    plain = jc.plan("fwd", tokens=t, d_in=d_in, d_out=2 * f, device=H200)
    assert off.op == "fwd" and (off.tile, off.schedule, off.cluster) == (plain.tile, plain.schedule, plain.cluster)
    gelu = plan_gated(tokens=t, d_in=d_in, d_out=2 * f, activation="gelu", device=H200)
    assert gelu.op == "fwd_gated" and (gelu.tile, gelu.cluster, gelu.schedule) == want, jc.explain(gelu)
    # a force() pin keeps its tile: the cooperative gated tile the benchmark compares with
    with jc.planner.force("det", tile=(128, 256, 64), schedule="tiles", cluster=(2, 1)):
        pinned = plan_gated(tokens=t, d_in=d_in, d_out=2 * f, activation="silu", device=H200)
    assert pinned.op == "fwd_gated" and (pinned.tile, pinned.schedule) == ((128, 256, 64), "tiles")


# --- the MLP's backward with the activation gradient in the down projection's dgrad ------------


@pytest.mark.parametrize(
    "t, f, d, want",
    [
        (8192, 14336, 4096, ((128, 192, 64), (2, 1), "pingpong")),  # Llama-3-8B down projection
        (16384, 28672, 8192, ((128, 192, 64), (2, 1), "pingpong")),  # Llama-3-70B
        (1000, 400, 512, None),  # small: the planner's narrower tile, then the pass
        (8192, 14328, 4096, None),  # d_ff not a multiple of 16
    ],
)
def test_plan_gate_grad_puts_the_epilogue_on_the_wide_pingpong_tile(t, f, d, want):
    from helpers import H200

    from jax_cake.planner.gated import plan_gate_grad

    held_back = plan_gate_grad(tokens=t, d_ff=f, d_out=d, activation="silu", device=H200)
    assert held_back.op == "dgrad" and "then an XLA pass (" in held_back.reason  # the default (planner docstring)
    p = plan_gate_grad(tokens=t, d_ff=f, d_out=d, activation="silu", device=H200, epilogue=True)
    if want is None:
        assert p.op == "dgrad" and "then an XLA pass (" in p.reason, jc.explain(p)
        return
    assert p.op == "dgrad_gated" and (p.tile, p.cluster, p.schedule) == want, jc.explain(p)
    assert (p.m, p.n, p.k) == (t, f, d) and p.program == "dgrad"
    assert p.unfused().op == "dgrad" and p.unfused().tile == p.tile
    off = plan_gate_grad(tokens=t, d_ff=f, d_out=d, activation="silu", device=H200, epilogue=False)
    plain = jc.plan("dgrad", tokens=t, d_in=f, d_out=d, device=H200)
    assert off.op == "dgrad" and (off.tile, off.schedule) == (plain.tile, plain.schedule)
    gelu = plan_gate_grad(tokens=t, d_ff=f, d_out=d, activation="gelu", device=H200, epilogue=True)
    assert gelu.op == "dgrad" and "no compiled gate_grad_gelu variant" in gelu.reason


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_cuda_lowering_of_the_mlp_runs_the_gradient_epilogue(with_residual, monkeypatch):
    """At the Llama MLP shape, with the gradient epilogue enabled, the backward's dg and du
    come from ONE jax_cake_dgrad_gated call (dy, w_down, the saved gu -> d_gu [2, 1, T,
    F], its two planes); dh never exists, so there is no plain dgrad, and dx reads the
    planes in place (jax_cake_dgrad_gate_up). Held back (the default): the composition, a
    dgrad for dh, and dx from dg, du and the interleaved weight read in place."""
    from jax_cake.planner import gated as gated_planner

    t, d, f = 8192, 4096, 14336
    args = (_s((t, d), BF), _s((f, d), F32), _s((f, d), F32), _s((d, f), F32), _s((t, d), BF))
    grads = lambda *a: _remat_grads("none", True, residual=with_residual)(*a)
    held_back = cuda_text(grads, *args)
    assert not custom_call_lines(held_back, "jax_cake_dgrad_gated")
    assert len(custom_call_lines(held_back, "jax_cake_dgrad")) == 1  # dh
    (dx,) = custom_call_lines(held_back, "jax_cake_dgrad_gate_up")  # dx from dg, du in place
    halves = f"tensor<1x{t}x{f}xbf16>, tensor<1x{t}x{f}xbf16>, tensor<1x{2 * f}x{d}xbf16>"
    assert f"({halves}) -> tensor<1x{t}x{d}xbf16>" in dx
    monkeypatch.setattr(gated_planner, "GATE_GRAD_EPILOGUE_ENABLED", True)
    text = cuda_text(lambda *a: _remat_grads("none", True, residual=with_residual)(*a), *args)
    (fused,) = custom_call_lines(text, "jax_cake_dgrad_gated")
    assert f"(tensor<1x{t}x{d}xbf16>, tensor<1x{d}x{f}xbf16>, tensor<1x{t}x{2 * f}xbf16>) -> tensor<2x1x{t}x{f}xbf16>" in fused
    assert "tile_n = 192 : i64" in fused and f"schedule = {contract.SCHEDULE_PINGPONG} : i64" in fused
    assert f"activation = {contract.ACTIVATION_SILU} : i64" in fused
    assert not custom_call_lines(text, "jax_cake_dgrad")  # no dh
    (dx,) = custom_call_lines(text, "jax_cake_dgrad_gate_up")
    assert f"({halves}) -> tensor<1x{t}x{d}xbf16>" in dx
    assert len(custom_call_lines(text, "jax_cake_fwd_gated")) == 1
    assert len(custom_call_lines(text, "jax_cake_fwd_residual" if with_residual else "jax_cake_fwd")) == 1


def _fused_mlp_on_this_host(monkeypatch):
    """Makes swiglu_mlp take its one-custom_vjp form on the CPU: the gradient epilogue's
    plan is made for an H200 at a pinned tile, so its primitive runs the reference of the
    fused call (jax_cake.primitives.gemm.dgrad_gated) where the kernel would run."""
    from helpers import H200

    from jax_cake.pipeline import gated as gated_pipeline

    planned = gated_pipeline.plan_gate_grad

    def plan_for_h200(**sizes):
        with jc.planner.force("det", tile=(128, 192, 64), schedule="pingpong", cluster=(1, 1)):
            return planned(**{**sizes, "device": H200, "epilogue": True})

    monkeypatch.setattr(gated_pipeline, "plan_gate_grad", plan_for_h200)


@pytest.mark.parametrize("w_dtype", [F32, BF])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_the_fused_mlp_backward_gives_the_composed_values(w_dtype, with_residual, monkeypatch):
    """The one-custom_vjp MLP (d_gu from the dgrad epilogue, dWg and dWu from one wgrad over
    2F) against the composed one (gated_projection's backward, then the projection
    pipeline's): bitwise the same on the XLA path, F below WIDE_D_OUT so that both take the
    stacked weight gradient."""
    lead, d_in, f, d_out = (3, 40), 64, 160, 48
    x, wg, wu, wd, dy = _inputs(21, lead, d_in, f, w_dtype, d_out)
    r = rand(22, (*lead, d_out), BF)
    from jax_cake.pipeline import gated as gated_pipeline

    x3, wd3 = x.reshape(1, -1, d_in), wd[None]
    with jax.set_mesh(jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])):  # nothing to partition
        composed = _mlp_vjp("silu", with_residual)(x, wg, wu, wd, dy, r)
        assert gated_pipeline.fused_mlp_plan(x3, wg, wu, wd3, activation="silu") is None
        _fused_mlp_on_this_host(monkeypatch)
        assert gated_pipeline.fused_mlp_plan(x3, wg, wu, wd3, activation="silu") is not None
        fused = _mlp_vjp("silu", with_residual)(x, wg, wu, wd, dy, r)
    for name, a, b in zip(("y", "dx", "dwg", "dwu", "dwd", "dr"), fused, composed):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)


def test_the_fused_mlp_form_needs_the_kernel_plan_and_the_interleave(monkeypatch):
    """fused_mlp_plan: off the GPU (an XLA plan) and where d_ff is no multiple of 16 the MLP is
    the composition; with the gradient kernel planned it is one custom_vjp."""
    from jax_cake.pipeline import gated as gated_pipeline

    x3, wg, wd3 = _s((1, 256, 64), BF), _s((160, 64), F32), _s((1, 48, 160), F32)
    odd, wd_odd = _s((152, 64), F32), _s((1, 48, 152), F32)
    with jax.set_mesh(jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])):
        assert gated_pipeline.fused_mlp_plan(x3, wg, wg, wd3, activation="silu") is None
        _fused_mlp_on_this_host(monkeypatch)
        assert gated_pipeline.fused_mlp_plan(x3, wg, wg, wd3, activation="silu") is not None
        assert gated_pipeline.fused_mlp_plan(x3, odd, odd, wd_odd, activation="silu") is None
    # with operands to partition (8 host devices, no mesh): the composition
    assert jax.device_count() > 1 and gated_pipeline.fused_mlp_plan(x3, wg, wg, wd3, activation="silu") is None


@pytest.mark.parametrize("axis,block", [(0, 16), (-1, 16), (-1, 1)])
def test_interleave_is_a_select_with_the_stacked_layout(axis, block):
    """reference.interleave puts the halves in the stacked layout (rows 2bj .. 2bj + b - 1
    from a, the next b from b) through one select, never a concatenation (which XLA runs
    as a fusion that cannot share work between the halves)."""
    a, b = rand(0, (64, 48), jnp.bfloat16), rand(1, (64, 48), jnp.bfloat16)
    ax = axis % 2
    f = a.shape[ax]
    blocks = (f // block, block, 48) if ax == 0 else (64, f // block, block)
    stacked = jnp.stack([a.reshape(blocks), b.reshape(blocks)], axis=ax + 1).reshape(
        (2 * f, 48) if ax == 0 else (64, 2 * f)
    )
    got = jc.reference.interleave(a, b, axis, block)
    assert bool(jnp.all(got == stacked))
    assert all(bool(jnp.all(h == w)) for h, w in zip(jc.reference.deinterleave(got, axis, block), (a, b)))
    text = jax.jit(lambda a, b: jc.reference.interleave(a, b, axis, block)).lower(a, b).as_text()
    assert "select" in text and "concatenate" not in text


# --- dx from the cotangent's halves (jax_cake_dgrad_gate_up) ----------------------------------


@pytest.mark.parametrize(
    "t,d_in,f",
    [
        (8192, 4096, 14336),  # Llama-3-8B gate/up: the planner's 128 x 256 c2x1 dgrad
        (8192, 8192, 28672),  # Llama-3-70B: the ping-pong 128 x 192 c2x1
        (2048, 1024, 1024),  # 128 x 128
    ],
)
def test_plan_gate_up_dgrad_keeps_the_dgrad_plan_and_reads_the_halves(t, d_in, f, monkeypatch):
    from helpers import H200

    from jax_cake.planner import gated

    base = jc.plan("dgrad", tokens=t, d_in=d_in, d_out=2 * f, device=H200)
    p = gated.plan_gate_up_dgrad(base, contract.GATE_BLOCK)
    assert p.op == "dgrad_gate_up" and p.program == "dgrad", jc.explain(p)
    kept = (p.tile, p.cluster, p.schedule, p.raster, p.k)
    assert kept == (base.tile, base.cluster, base.schedule, base.raster, 2 * f)
    assert p.unfused() == dataclasses.replace(base, reason=p.reason)
    monkeypatch.setattr(gated, "GATE_UP_DGRAD_ENABLED", False)
    assert gated.plan_gate_up_dgrad(base, contract.GATE_BLOCK) is base


def test_plan_gate_up_dgrad_falls_back_where_no_variant_or_no_kernel():
    from helpers import H200

    from jax_cake.planner import gated

    base = jc.plan("dgrad", tokens=4096, d_in=1024, d_out=2048, device=H200)
    p = gated.plan_gate_up_dgrad(dataclasses.replace(base, tile=(128, 64, 64)), contract.GATE_BLOCK)  # no variant
    assert p.op == "dgrad" and "no gate_up_halves variant" in p.reason
    row_by_row = gated.plan_gate_up_dgrad(base, 1)  # d_ff not a multiple of 16, or partitioned operands
    assert row_by_row.op == "dgrad" and "interleaved row by row" in row_by_row.reason
    on_cpu = jc.plan("dgrad", tokens=4096, d_in=1024, d_out=2048)
    assert gated.plan_gate_up_dgrad(on_cpu, contract.GATE_BLOCK) is on_cpu


def test_dgrad_gate_up_is_the_dgrad_over_the_interleaved_cotangent():
    """The primitive's wiring on the CPU, where every form runs the reference (the
    kernel's own sum order is tests/gpu/test_gated_gpu.py's): with a kernel plan, an XLA
    plan and under vmap (the custom_vmap rule), dg and du go to the gate and up rows in
    that order, bitwise the plain dgrad over them interleaved as W's rows."""
    from helpers import H200

    from jax_cake import primitives, reference
    from jax_cake.planner import gated

    t, d_in, f = 256, 128, 64
    dg, du = rand(1, (1, t, f), BF), rand(2, (1, t, f), BF)
    w = (0.1 * rand(3, (1, 2 * f, d_in), F32)).astype(BF)
    base = jc.plan("dgrad", tokens=t, d_in=d_in, d_out=2 * f, device=H200)
    kernel_plan = gated.plan_gate_up_dgrad(base, contract.GATE_BLOCK)
    assert kernel_plan.op == "dgrad_gate_up"
    want = primitives.dgrad(reference.interleave(dg, du, -1, contract.GATE_BLOCK), w, base)
    for plan in (kernel_plan, jc.plan("dgrad", tokens=t, d_in=d_in, d_out=2 * f)):
        got = jax.jit(lambda *a: primitives.dgrad_gate_up(*a, plan, contract.GATE_BLOCK))(dg, du, w)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    batched = jax.vmap(lambda a, b: primitives.dgrad_gate_up(a, b, w, kernel_plan, contract.GATE_BLOCK))(
        jnp.stack([dg, du]), jnp.stack([du, dg])
    )
    np.testing.assert_array_equal(np.asarray(batched[0]), np.asarray(want))
    swapped = primitives.dgrad(reference.interleave(du, dg, -1, contract.GATE_BLOCK), w, base)
    assert np.any(np.asarray(swapped) != np.asarray(want))  # entry 1 differs from entry 0
    np.testing.assert_array_equal(np.asarray(batched[1]), np.asarray(swapped))
