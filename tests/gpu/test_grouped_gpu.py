"""Grouped projections (MoE experts) on the GPU, on both paths (`path`): the grouped kernels
(the default plan; these cases need the jax_cake library) and XLA's ragged dot (with
JAX_CAKE_DISABLE=1). Values and gradients against float64 of the same bf16
operands at ragged MoE-like shapes, bitwise repeat, rows past the groups never reaching a
result, ragged_dot against lax.ragged_dot, grad of grad, and that the kernel path runs the
three grouped kernels and no XLA ragged dot."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cake as jc
from jax_cake import contract
from jax_cake.planner import variants
from helpers import custom_call_lines, effective_group_sizes, grouped_reference64
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


# The compiled grouped variants: the kernel path's cases run the default tile's (fwd,
# dgrad, and the wgrad of an FP32 master and of a bf16 weight), test_every_grouped_variant
# each one forced.
# The plain ones (the gated grouped variants: test_moe_gpu's gated epilogue test).
GROUPED_VARIANTS = [v for v in variants.VARIANTS if v.grouping is not None and v.store == "plain"]
GROUPED_TARGETS = (contract.GROUPED_FWD_TARGET, contract.GROUPED_DGRAD_TARGET, contract.GROUPED_WGRAD_TARGET)


@pytest.fixture(params=["xla", "kernel"])
def path(request, monkeypatch):
    """The grouped GEMMs' path for the test: "kernel" the default (it needs the library),
    "xla" with JAX_CAKE_DISABLE=1. jit's caches are cleared around it: a plan is made at
    trace time."""
    if request.param == "kernel":
        request.getfixturevalue("gpu_library")
        monkeypatch.delenv("JAX_CAKE_DISABLE", raising=False)
    else:
        monkeypatch.setenv("JAX_CAKE_DISABLE", "1")
    jax.clear_caches()
    yield request.param
    jax.clear_caches()


def _operands(w_dtype, groups=16):
    return h.rand(11, (M, K)), h.rand(12, (groups, N, K), w_dtype, scale=K**-0.5), h.rand(13, (M, N))


@functools.partial(jax.jit, static_argnums=0)
def _vjp(fn, x, w, gs, dy):
    y, pullback = jax.vjp(lambda x, w: fn(x, w, gs), x, w)
    return (y, *pullback(dy))


def _grouped(x, w, gs):
    return jc.grouped_projection(x, w, gs)


def test_kernel_path_runs_the_grouped_kernels(path):
    x, w, dy = _operands(F32)
    gs = jnp.asarray(SIZES["ragged"], jnp.int32)
    text = _vjp.lower(_grouped, x, w, gs, dy).as_text()
    calls = [len(custom_call_lines(text, t)) for t in GROUPED_TARGETS]
    assert calls == ([1, 1, 1] if path == "kernel" else [0, 0, 0]), calls


@pytest.mark.parametrize("case", sorted(SIZES))
@pytest.mark.parametrize("w_dtype", ["float32", "bfloat16"])
def test_values_and_gradients_against_float64(path, case, w_dtype):
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


@pytest.mark.parametrize("variant", GROUPED_VARIANTS, ids=lambda v: v.name)
def test_every_grouped_variant_against_float64(gpu_library, variant):
    """Each compiled grouped variant forced on its role (its tile pinned, the other roles
    the planner's) at the ragged sizes, against float64, the rows past the groups exactly 0."""
    w_dtype = F32 if variant.program != "wgrad" or variant.out_dtype == "float32" else BF16
    x, w, dy = _operands(w_dtype)
    gs = jnp.asarray(SIZES["ragged"], jnp.int32)
    op = f"grouped_{variant.program}"
    (m, n, k) = {"fwd": (M, N, K), "dgrad": (M, K, N), "wgrad": (N, K, M)}[variant.program]
    jax.clear_caches()
    with jc.planner.force("det", tile=variant.tile, gemm=(op, m, n, k)):
        fn = jax.jit(functools.partial(_vjp, _grouped))
        text = fn.lower(x, w, gs, dy).as_text()
        y, dx, dw = fn(x, w, gs, dy)
    jax.clear_caches()
    target = {"fwd": contract.GROUPED_FWD_TARGET, "dgrad": contract.GROUPED_DGRAD_TARGET}.get(
        variant.program, contract.GROUPED_WGRAD_TARGET
    )
    (call,) = custom_call_lines(text, target)
    assert f"tile_n = {variant.tile[1]} : i64" in call, call
    assert f"schedule = {contract.SCHEDULES[variant.schedule]} : i64" in call, call
    ry, rdx, rdw = grouped_reference64(x, w, SIZES["ragged"], dy)
    h.assert_close(y, ry, h.BF16_TOL, "y")
    h.assert_close(dx, rdx, h.BF16_TOL, "dx")
    h.assert_close(dw, rdw, h.F32_TOL if w_dtype == F32 else h.BF16_TOL, "dw")
    past = sum(effective_group_sizes(SIZES["ragged"], M))
    assert not np.asarray(y[past:]).any() and not np.asarray(dx[past:]).any()


@pytest.mark.parametrize("groups", [8, 128])
def test_many_small_groups_against_float64(path, groups):
    """Qwen3-like routing: many experts, a few rows each (most groups under one tile, some
    empty), and a wgrad whose groups' K ranges are short."""
    x, w, dy = _operands(F32, groups)
    sizes = np.random.default_rng(groups).multinomial(M - 300, np.ones(groups) / groups)
    sizes[::7] = 0
    gs = jnp.asarray(sizes, jnp.int32)
    y, dx, dw = _vjp(_grouped, x, w, gs, dy)
    ry, rdx, rdw = grouped_reference64(x, w, sizes.tolist(), dy)
    h.assert_close(y, ry, h.BF16_TOL, "y")
    h.assert_close(dx, rdx, h.BF16_TOL, "dx")
    h.assert_close(dw, rdw, h.F32_TOL, "dw")
    assert not np.asarray(dw[::7]).any()


def test_bitwise_repeatable(path):
    x, w, dy = _operands(F32)
    gs = jnp.asarray(SIZES["ragged"], jnp.int32)
    for i in range(3):
        h.assert_repeatable(lambda: _vjp(_grouped, x, w, gs, dy)[i], h.REPEATS, f"result {i}")


def test_rows_past_the_groups_never_reach_a_result(path):
    x, w, dy = _operands(F32)
    past = sum(SIZES["ragged"])
    x, dy = x.at[past:].set(jnp.nan), dy.at[past:].set(jnp.inf)
    for result in _vjp(_grouped, x, w, jnp.asarray(SIZES["ragged"], jnp.int32), dy):
        assert bool(jnp.all(jnp.isfinite(result.astype(F32))))


def test_ragged_dot_equals_lax_on_the_gpu(path):
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


def test_plan_on_this_gpu(path):
    p = jc.plan("grouped_fwd", tokens=M, groups=16, d_in=K, d_out=N, device=jax.devices()[0])
    if path == "kernel":
        assert p.uses_kernel and p.tile == (128, 256, 64) and p.raster == "m4"
    else:
        assert not p.uses_kernel and "JAX_CAKE_DISABLE is set" in jc.explain(p)


def test_grad_of_grad_on_the_gpu(path):
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
