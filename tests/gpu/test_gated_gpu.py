"""gated_projection and swiglu_mlp on the GPU: their GEMMs lower to the jax_cake custom
calls, and their values match float64 references of the defined semantics (h and dx
within bf16 rounding, FP32 dW within 1e-5 of float64 wgrads of the op's dg, du)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gpu_helpers as h
import jax_cake
from jax_cake import reference
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
    assert h.custom_calls(text, "jax_cake_fwd") == 1 and h.custom_calls(text, "jax_cake_dgrad") == 1
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
    assert h.custom_calls(text, "jax_cake_fwd") == 1 and h.custom_calls(text, "jax_cake_fwd_residual") == 1
    y = jax.jit(mlp)(x, wg, wu, wd, r)
    hidden = jax.jit(jax_cake.gated_projection)(x, wg, wu)
    ref = _f64(r) + _f64(hidden) @ _f64(wd.astype(jnp.bfloat16)).T
    assert _within(y, ref, h.BF16_TOL)
