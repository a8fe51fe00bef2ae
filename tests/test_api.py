"""The public ops on the XLA path against float64 references: values, gradients, dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cake as jc
from helpers import f64, rand, rel_err

BF16_TOL = 1e-2
FP32_WGRAD_TOL = 1e-5
ROUTER_TOL = 5e-6  # the router's accuracy target (BF16x3 measures ~4.5e-6 here)

# (T, d_in, d_out): aligned, ragged token counts (37, and 16172-like odd counts scaled
# down), skinny outputs, and a d_in not a multiple of 8 (XLA fallback shape).
SHAPES = [(64, 128, 32), (37, 64, 48), (1011, 256, 64), (1017, 160, 96), (5, 20, 12)]


def _loss_and_grads(fn, x, w, dy):
    """Value and VJP of fn at (x, w) with cotangent dy."""
    y, vjp = jax.vjp(fn, x, w)
    return (y,) + vjp(dy)


@pytest.mark.parametrize("t,d_in,d_out", SHAPES)
@pytest.mark.parametrize("w_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("deterministic", [True, False])
def test_dense_projection_matches_float64(t, d_in, d_out, w_dtype, deterministic):
    x = rand(1, (t, d_in), jnp.bfloat16)
    w = rand(2, (d_out, d_in), w_dtype)
    dy = rand(3, (t, d_out), jnp.bfloat16)
    fn = jax.jit(lambda x, w: jc.dense_projection(x, w, deterministic=deterministic))
    y, dx, dw = _loss_and_grads(fn, x, w, dy)

    xr, wr, dyr = f64(x), f64(w.astype(jnp.bfloat16)), f64(dy)
    assert y.dtype == jnp.bfloat16 and y.shape == (t, d_out)
    assert dx.dtype == jnp.bfloat16 and dx.shape == (t, d_in)
    assert dw.dtype == w_dtype and dw.shape == (d_out, d_in)
    assert rel_err(y, xr @ wr.T) < BF16_TOL
    assert rel_err(dx, dyr @ wr) < BF16_TOL
    tol = FP32_WGRAD_TOL if w_dtype == jnp.float32 else BF16_TOL
    assert rel_err(dw, dyr.T @ xr) < tol


def test_fp32_master_weight_gradient_is_not_rounded_to_bf16():
    """dw in FP32 comes from the FP32 accumulator: it differs from its own bf16 rounding."""
    x = rand(4, (333, 128), jnp.bfloat16)
    w = rand(5, (64, 128), jnp.float32)
    dy = rand(6, (333, 64), jnp.bfloat16)
    _, _, dw = _loss_and_grads(jc.dense_projection, x, w, dy)
    assert dw.dtype == jnp.float32
    assert not np.array_equal(np.asarray(dw), np.asarray(dw.astype(jnp.bfloat16).astype(jnp.float32)))
    assert rel_err(dw, f64(dy).T @ f64(x)) < FP32_WGRAD_TOL


def test_forward_rounds_fp32_weight_to_bf16_for_the_product():
    x = rand(7, (16, 32), jnp.bfloat16)
    w = rand(8, (8, 32), jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(jc.dense_projection(x, w)), np.asarray(jc.dense_projection(x, w.astype(jnp.bfloat16)))
    )


def test_dense_projection_takes_any_leading_dims():
    x = rand(9, (2, 3, 5, 64), jnp.bfloat16)
    w = rand(10, (24, 64), jnp.bfloat16)
    y = jc.dense_projection(x, w)
    assert y.shape == (2, 3, 5, 24)
    assert rel_err(y, f64(x) @ f64(w).T) < BF16_TOL


@pytest.mark.parametrize("b,t,d_in,d_out", [(4, 37, 64, 32), (3, 128, 128, 512), (2, 16, 512, 128)])
@pytest.mark.parametrize("w_dtype", [jnp.bfloat16, jnp.float32])
def test_batched_projection_matches_float64(b, t, d_in, d_out, w_dtype):
    x = rand(11, (b, t, d_in), jnp.bfloat16)
    w = rand(12, (b, d_out, d_in), w_dtype)
    dy = rand(13, (b, t, d_out), jnp.bfloat16)
    y, dx, dw = _loss_and_grads(jax.jit(jc.batched_projection), x, w, dy)
    xr, wr, dyr = f64(x), f64(w.astype(jnp.bfloat16)), f64(dy)
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, w_dtype)
    assert rel_err(y, np.einsum("btk,bnk->btn", xr, wr)) < BF16_TOL
    assert rel_err(dx, np.einsum("btn,bnk->btk", dyr, wr)) < BF16_TOL
    tol = FP32_WGRAD_TOL if w_dtype == jnp.float32 else BF16_TOL
    assert rel_err(dw, np.einsum("btn,btk->bnk", dyr, xr)) < tol


@pytest.mark.parametrize("t,d,e", [(64, 256, 256), (37, 128, 256), (300, 448, 64)])
def test_router_logits_bf16x3_accuracy(t, d, e):
    x = rand(14, (t, d), jnp.float32)
    w = rand(15, (e, d), jnp.float32) * 0.05
    g = rand(16, (t, e), jnp.float32)
    logits, dx, dw = _loss_and_grads(jax.jit(jc.router_logits), x, w, g)
    xr, wr, gr = f64(x), f64(w), f64(g)
    assert (logits.dtype, dx.dtype, dw.dtype) == (jnp.float32,) * 3
    assert rel_err(logits, xr @ wr.T) < ROUTER_TOL
    assert rel_err(dx, gr @ wr) < ROUTER_TOL
    assert rel_err(dw, gr.T @ xr) < ROUTER_TOL


def test_router_is_more_accurate_than_one_bf16_pass():
    """BF16x3 must beat a single BF16 product by a wide margin, else the split is broken."""
    x = rand(17, (128, 512), jnp.float32)
    w = rand(18, (256, 512), jnp.float32)
    ref = f64(x) @ f64(w).T
    one_pass = jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16).T, preferred_element_type=jnp.float32)
    assert rel_err(jc.router_logits(x, w), ref) < rel_err(one_pass, ref) / 50


@pytest.mark.parametrize("shape_x,shape_w", [((0, 64), (32, 64)), ((16, 64), (0, 64)), ((16, 0), (32, 0))])
def test_empty_dimensions_give_empty_or_zero_results(shape_x, shape_w):
    """Documented: an empty token or output dimension gives an empty result; an empty
    d_in gives zeros (the empty sum), with gradients of matching shapes."""
    x = jnp.ones(shape_x, jnp.bfloat16)
    w = jnp.ones(shape_w, jnp.float32)
    y, dx, dw = _loss_and_grads(jc.dense_projection, x, w, jnp.ones((shape_x[0], shape_w[0]), jnp.bfloat16))
    assert y.shape == (shape_x[0], shape_w[0]) and dx.shape == shape_x and dw.shape == shape_w
    assert not np.any(np.asarray(y, np.float32))


def test_bf16x3_split_survives_xla_simplification():
    """lo must not collapse to zero under jit (XLA may drop a bf16 round trip)."""
    from jax_cake.reference import split_bf16x3

    a = rand(22, (64, 64), jnp.float32)
    hi, lo = jax.jit(split_bf16x3)(a)
    assert np.any(np.asarray(lo, np.float32) != 0)
    np.testing.assert_allclose(f64(hi) + f64(lo), f64(a), rtol=2e-5, atol=0)
