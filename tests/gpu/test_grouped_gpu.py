"""Grouped projections (MoE experts) on the GPU: grouped_projection and ragged_dot run XLA's
ragged dot there today (no grouped kernel is built; the plan says so). Values and gradients
against float64 of the same bf16 operands at ragged MoE-like shapes, bitwise repeat, rows
past the groups never reaching a result, ragged_dot against lax.ragged_dot, grad of grad.

No kernel runs, so these need no jax_cake library (no `gpu_library` fixture): only a GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cake as jc
from helpers import effective_group_sizes, grouped_reference64
from second_order_cases import check, hvp

import gpu_helpers as h

pytestmark = [pytest.mark.gpu]

BF16, F32 = jnp.bfloat16, jnp.float32
M, K, N = 4133, 1024, 768  # M not a multiple of 128
SIZES = {
    # 16 experts: empty groups, a group of one row, 230 rows past the sum
    "ragged": [300, 0, 517, 128, 1, 0, 900, 250, 333, 0, 411, 64, 200, 99, 0, 700],
    # negative sizes count as 0; the sum passes M: cut there
    "negative_and_above_m": [-5, 1000, 2000, -1, 1500, 700, 0, 3, 9, 9, 9, 9, 9, 9, 9, 9],
}


def _operands(w_dtype, groups=16):
    return h.rand(11, (M, K)), h.rand(12, (groups, N, K), w_dtype, scale=K**-0.5), h.rand(13, (M, N))


@functools.partial(jax.jit, static_argnums=0)
def _vjp(fn, x, w, gs, dy):
    y, pullback = jax.vjp(lambda x, w: fn(x, w, gs), x, w)
    return (y, *pullback(dy))


def _grouped(x, w, gs):
    return jc.grouped_projection(x, w, gs)


@pytest.mark.parametrize("case", sorted(SIZES))
@pytest.mark.parametrize("w_dtype", ["float32", "bfloat16"])
def test_values_and_gradients_against_float64(case, w_dtype):
    w_dtype = h.dtype_of(w_dtype)
    x, w, dy = _operands(w_dtype)
    gs = jnp.asarray(SIZES[case], jnp.int32)
    y, dx, dw = _vjp(_grouped, x, w, gs, dy)
    assert (y.dtype, dx.dtype, dw.dtype) == (BF16, BF16, w_dtype)
    ry, rdx, rdw = grouped_reference64(x, w, SIZES[case], dy)
    h.assert_close(y, ry, h.BF16_TOL, f"{case} y")
    h.assert_close(dx, rdx, h.BF16_TOL, f"{case} dx")
    h.assert_close(dw, rdw, h.F32_TOL if w_dtype == F32 else h.BF16_TOL, f"{case} dw")
    effective = effective_group_sizes(SIZES[case], M)
    past = sum(effective)
    assert not np.asarray(y[past:]).any() and not np.asarray(dx[past:]).any()
    for g, s in enumerate(effective):
        if s == 0:
            assert not np.asarray(dw[g]).any(), f"empty group {g}'s dw is not exactly 0"


def test_bitwise_repeatable():
    x, w, dy = _operands(F32)
    gs = jnp.asarray(SIZES["ragged"], jnp.int32)
    for i in range(3):
        h.assert_repeatable(lambda: _vjp(_grouped, x, w, gs, dy)[i], h.REPEATS, f"result {i}")


def test_rows_past_the_groups_never_reach_a_result():
    x, w, dy = _operands(F32)
    past = sum(SIZES["ragged"])
    x, dy = x.at[past:].set(jnp.nan), dy.at[past:].set(jnp.inf)
    for result in _vjp(_grouped, x, w, jnp.asarray(SIZES["ragged"], jnp.int32), dy):
        assert bool(jnp.all(jnp.isfinite(result.astype(F32))))


def test_ragged_dot_equals_lax_on_the_gpu():
    x, w, dy = _operands(BF16)
    rhs = jnp.swapaxes(w, 1, 2)
    gs = jnp.asarray(SIZES["ragged"], jnp.int32)
    ours = _vjp(jc.ragged_dot, x, rhs, gs, dy)
    theirs = _vjp(jax.lax.ragged_dot, x, rhs, gs, dy)
    ry, rdx, rdw = grouped_reference64(x, w, SIZES["ragged"], dy)
    for a, b, ref, what in zip(ours, theirs, (ry, rdx, np.swapaxes(rdw, 1, 2)), ("y", "dx", "drhs")):
        assert a.dtype == b.dtype == BF16
        h.assert_close(a, ref, h.BF16_TOL, f"jc.ragged_dot {what}")
        assert h.rel_err(a, h.f64(b)) < h.BF16_TOL, what


def test_plan_on_this_gpu_runs_xla_and_says_why():
    p = jc.plan("grouped_fwd", tokens=M, groups=16, d_in=K, d_out=N, device=jax.devices()[0])
    assert not p.uses_kernel and "no grouped (ragged) GEMM kernel is built" in jc.explain(p)


def test_grad_of_grad_on_the_gpu():
    sizes = [5, 0, 60, 3, 0, 30]
    gs = jnp.asarray(sizes, jnp.int32)
    m = 128
    onehot = np.zeros((m, len(sizes)), np.float32)
    start = 0
    for g, s in enumerate(effective_group_sizes(sizes, m)):
        onehot[start : start + s, g] = 1.0
        start += s

    def plain(x, w):
        every = jax.lax.dot_general(
            x, w.astype(BF16), (((1,), (2,)), ((), ())), preferred_element_type=F32, precision="highest"
        )
        return jnp.einsum("mgn,mg->mn", every, onehot, precision="highest").astype(BF16)

    operands = (h.rand(21, (m, 64)), h.rand(22, (len(sizes), 48, 64), F32))
    fn = lambda x, w: jc.grouped_projection(x, w, gs)
    check(fn, plain, operands, lambda f, ops, dirs: jax.jit(functools.partial(hvp, f))(ops, dirs))
