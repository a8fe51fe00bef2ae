"""gated_projection and swiglu_mlp on the GPU: their GEMMs lower to the jax_cake custom
calls (the gated kernel where d_ff is a multiple of 16), and their values match float64
references of the defined semantics (h and dx within bf16 rounding, FP32 dW within 1e-5 of
float64 wgrads of the op's dg, du); and each compiled gated kernel, forced."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gpu_helpers as h
import jax_cake
import jax_cake.planner.variants
from jax_cake import contract, reference
from jax_cake.planner import force
from jax_cake.planner import gated as gated_planner
from jax_cake.planner.gated import plan_gated
from jax_cake.primitives import gemm
from test_gated import _reference64

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_library")]

# (T, d_in, F): one wgrad per weight (F >= 512) and one over the interleaved 2F (ragged).
CASES = [(2048, 1024, 1024), (1000, 512, 264)]


def _inputs(t, d_in, f):
    key = ("gated", t, d_in, f)
    x = h.rand(h.seed_of("x", *key), (t, d_in))
    wg = h.rand(h.seed_of("wg", *key), (f, d_in), h.F32, scale=0.05)
    wu = h.rand(h.seed_of("wu", *key), (f, d_in), h.F32, scale=0.05)
    dh = h.rand(h.seed_of("dh", *key), (t, f))
    return x, wg, wu, dh


def _f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def _within(out, ref, tol):
    err, nonfinite = h.rel_err(out, ref)
    return nonfinite == 0 and err < tol


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}_{}x{}".format(*c))
def test_gated_projection_on_the_kernels(case, activation):
    x, wg, wu, dh = _inputs(*case)

    def step(x, wg, wu, dh):
        out, vjp = jax.vjp(lambda *a: jax_cake.gated_projection(*a, activation=activation), x, wg, wu)
        return (out, *vjp(dh))

    step = jax.jit(step)
    text = step.lower(x, wg, wu, dh).as_text()
    t, d_in, f = case
    fused = plan_gated(tokens=t, d_in=d_in, d_out=2 * f, activation=activation).op == "fwd_gated"
    assert h.custom_calls(text, "jax_cake_fwd_gated" if fused else "jax_cake_fwd") == 1
    assert h.custom_calls(text, "jax_cake_dgrad") == 1
    assert h.custom_calls(text, "jax_cake_wgrad") >= 1 and "dot_general" not in text
    out, dx, dwg, dwu = step(x, wg, wu, dh)
    assert (dwg.dtype, dwu.dtype) == (jnp.float32, jnp.float32)
    ref_h, ref_dx, _, _ = _reference64(x, wg, wu, dh, activation)
    assert _within(out, ref_h, h.BF16_TOL)
    assert _within(dx, ref_dx, h.BF16_TOL)
    # dW against float64 wgrads of the op's own dg, du: the pre-activation from the same
    # forward kernel (fused_projections: the same K loop, so the same bits) and the
    # defined activation gradient, so only the wgrad's FP32 sum is left.
    g, u = jax.jit(lambda x, wg, wu: jax_cake.fused_projections(x, (wg, wu)))(x, wg, wu)
    dg, du = jax.jit(lambda dh, g, u: reference.gate_grad(dh, g, u, activation))(dh, g, u)
    x64 = _f64(x)
    assert _within(dwg, _f64(dg).T @ x64, h.F32_TOL)
    assert _within(dwu, _f64(du).T @ x64, h.F32_TOL)


def test_swiglu_mlp_on_the_kernels_with_the_fused_residual():
    t, d, f = 2048, 1024, 1024
    x, wg, wu, _ = _inputs(t, d, f)
    wd = h.rand(h.seed_of("wd", t, d, f), (d, f), h.F32, scale=0.03)
    r = h.rand(h.seed_of("r", t, d, f), (t, d))

    def mlp(x, wg, wu, wd, r):
        return jax_cake.swiglu_mlp(x, wg, wu, wd, residual=r)

    text = jax.jit(mlp).lower(x, wg, wu, wd, r).as_text()
    fused = plan_gated(tokens=t, d_in=d, d_out=2 * f, activation="silu").op == "fwd_gated"
    gate_up = "jax_cake_fwd_gated" if fused else "jax_cake_fwd"
    assert h.custom_calls(text, gate_up) == 1 and h.custom_calls(text, "jax_cake_fwd_residual") == 1
    y = jax.jit(mlp)(x, wg, wu, wd, r)
    hidden = jax.jit(jax_cake.gated_projection)(x, wg, wu)
    ref = _f64(r) + _f64(hidden) @ _f64(wd.astype(jnp.bfloat16)).T
    assert _within(y, ref, h.BF16_TOL)


# --- the gated kernel epilogue, each compiled variant forced -------------------------------------

GATED_VARIANTS = [v for v in jax_cake.planner.variants.VARIANTS if v.activation is not None]
# (T, d_in, F): whole tiles; ragged T, d_in and 2F (2F = 2080 is not a multiple of any tile_n).
KERNEL_SHAPES = [(2048, 1024, 2048), (1000, 520, 1040)]


def _act64(g, activation):
    if activation == "silu":
        return g / (1.0 + np.exp(-g))
    return 0.5 * g * (1.0 + np.tanh(0.7978845608028654 * (g + 0.044715 * g**3)))


def _gated_call(variant, x, w):
    """(h, gu) of the gated kernel `variant` on x [T, d_in], w [2F, d_in] (interleaved in
    blocks of contract.GATE_BLOCK), and gu of the plain forward of the same tile."""
    t, d_in = x.shape
    with force("det", tile=variant.tile, cluster=variant.cluster, schedule=variant.schedule):
        plan = plan_gated(tokens=t, d_in=d_in, d_out=w.shape[0], activation=variant.activation)
    assert plan.op == "fwd_gated", plan
    assert (plan.tile, plan.cluster, plan.schedule) == (variant.tile, variant.cluster, variant.schedule), plan
    gated = jax.jit(lambda x, w: gemm.fwd_gated(x[None], w[None], plan, variant.activation))
    plain = jax.jit(lambda x, w: gemm.fwd(x[None], w[None], plan.unfused()))
    text = gated.lower(x, w).as_text()
    assert h.custom_calls(text, "jax_cake_fwd_gated") == 1 and "dot_general" not in text
    return gated, plain


@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=lambda s: "T{}_{}x{}".format(*s))
@pytest.mark.parametrize("variant", GATED_VARIANTS, ids=lambda v: v.name)
def test_gated_kernel_epilogue(variant, shape, monkeypatch):
    """gu is bit for bit the plain forward of the same tile; h is bf16(act(g) * u) of that
    gu within half a bf16 step (plus FP32 rounding of the activation) of float64; every
    element written; bitwise repeatable."""
    monkeypatch.setattr(gated_planner, "GATED_EPILOGUE_ENABLED", True)
    t, d_in, f = shape
    key = ("gated_kernel", variant.name, *shape)
    x = h.rand(h.seed_of("x", *key), (t, d_in))
    w = h.rand(h.seed_of("w", *key), (2 * f, d_in), scale=0.05)
    gated, plain = _gated_call(variant, x, w)
    out, gu = gated(x, w)
    assert out.shape == (1, t, f) and gu.shape == (1, t, 2 * f)
    np.testing.assert_array_equal(np.asarray(gu), np.asarray(plain(x, w)))
    ref_gu = _f64(x) @ _f64(w).T
    assert _within(gu[0], ref_gu, h.BF16_TOL)
    g, u = (_f64(v[0]) for v in reference.deinterleave(gu, -1, contract.GATE_BLOCK))
    ref = _act64(g, variant.activation) * u
    got = _f64(out[0])
    assert np.all(np.isfinite(got))
    bound = (2.0**-8 + 2.0**-20) * np.abs(ref) + 1e-30
    worst = np.max(np.abs(got - ref) / bound)
    assert worst <= 1.0, f"|h - act(g) u| reaches {worst:.2f} of half a bf16 step"
    for _ in range(3):
        again, gu_again = gated(x, w)
        np.testing.assert_array_equal(np.asarray(again), np.asarray(out))
        np.testing.assert_array_equal(np.asarray(gu_again), np.asarray(gu))
