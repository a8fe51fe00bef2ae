"""Grouped (ragged) projections for MoE experts: jc.grouped_projection and jc.ragged_dot.

Values and gradients against float64 of the same bf16 operands at ragged shapes (empty
groups, one group taking every row, rows past the sum, M not a multiple of 128, negative
sizes, a sum above M), the group-size rules, validation, the lax.ragged_dot drop-in and its
fallbacks, plans, jit / vmap / sharding / shard_map / Explicit axes, grad of grad, remat,
determinism and the CUDA lowering (on CPU)."""

import functools
import logging
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_cake as jc
from jax_cake import logs
from helpers import (
    REPO,
    assert_raises_naming,
    assert_same_values,
    child_env,
    cuda_text,
    custom_call_lines,
    effective_group_sizes,
    f64,
    grouped_gemms,
    grouped_reference64,
    rand,
    rel_err,
)
from second_order_cases import check, hvp

BF16, F32 = jnp.bfloat16, jnp.float32
M, K, N, G = 200, 48, 40, 6  # M not a multiple of 128; K, N, M multiples of the 8 fake devices

# Group sizes (G = 6, M = 200) and the sizes they mean after the rules.
SIZES = {
    "ragged": ([30, 0, 70, 1, 0, 60], [30, 0, 70, 1, 0, 60]),  # empty groups, 39 rows past the sum
    "one_group_takes_all": ([0, 0, 200, 0, 0, 0], [0, 0, 200, 0, 0, 0]),
    "exact": ([50, 30, 20, 40, 35, 25], [50, 30, 20, 40, 35, 25]),
    "negative": ([40, -5, 30, -100, 60, 10], [40, 0, 30, 0, 60, 10]),
    "sum_above_m": ([80, 90, 70, 50, 0, 3], [80, 90, 30, 0, 0, 0]),
    "int32_max": ([2**31 - 1, 5, 2**31 - 1, -(2**31), 7, 2**31 - 1], [200, 0, 0, 0, 0, 0]),
    "all_empty": ([0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]),
}


def _operands(w_dtype=F32, m=M, g=G):
    return rand(0, (m, K), BF16), rand(1, (g, N, K), w_dtype), rand(2, (m, N), BF16)


def _ragged_dots(text) -> list[str]:
    """The lines of a CUDA lowering that run XLA's ragged dot."""
    return [line for line in text.splitlines() if '"chlo.ragged_dot"(' in line]


def _vjp(fn, x, w, dy):
    y, pullback = jax.vjp(fn, x, w)
    return (y, *pullback(dy))


def _grouped_vjp(x, w, gs, dy):
    return _vjp(lambda x, w: jc.grouped_projection(x, w, gs), x, w, dy)


# --- the group-size rules ----------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(SIZES))
def test_group_sizes_rules(case):
    given, want = SIZES[case]
    assert effective_group_sizes(given, M) == want
    got = jc.reference.grouped_sizes(jnp.asarray(given, jnp.int32), M)
    assert got.dtype == jnp.int32 and list(np.asarray(got)) == want


def test_group_sizes_rules_batched_and_at_int32_limits():
    big = 2**31 - 1
    sizes = jnp.asarray([[big, big, big], [1, -1, big]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(jc.reference.grouped_sizes(sizes, big)), [[big, 0, 0], [1, 0, big - 1]])


# --- values and gradients against float64 ------------------------------------------------


@pytest.mark.parametrize("case", sorted(SIZES))
@pytest.mark.parametrize("w_dtype", [F32, BF16])
def test_values_and_gradients_against_float64(case, w_dtype):
    x, w, dy = _operands(w_dtype)
    sizes = SIZES[case][0]
    y, dx, dw = jax.jit(_grouped_vjp)(x, w, jnp.asarray(sizes, jnp.int32), dy)
    assert (y.dtype, dx.dtype, dw.dtype) == (BF16, BF16, w_dtype)
    ry, rdx, rdw = grouped_reference64(x, w, sizes, dy)
    effective = effective_group_sizes(sizes, M)
    if sum(effective):
        assert rel_err(y, ry) < 4e-3 and rel_err(dx, rdx) < 4e-3
        # FP32 dw straight from the FP32 sum: float64's to FP32 precision; bf16 dw rounded once
        assert rel_err(dw, rdw) < (1e-5 if w_dtype == F32 else 4e-3)
    past = sum(effective)
    assert not np.asarray(y[past:]).any() and not np.asarray(dx[past:]).any()  # rows past the sum: 0
    for g, s in enumerate(effective):
        if s == 0:  # an empty group's dw is exactly 0
            assert not np.asarray(dw[g]).any(), g
    assert np.all(np.isfinite(f64(y))) and np.all(np.isfinite(f64(dw)))


def test_fp32_master_gradient_is_not_rounded_to_bf16():
    x, w, dy = _operands(F32)
    gs = jnp.asarray(SIZES["exact"][0], jnp.int32)
    dw = jax.jit(_grouped_vjp)(x, w, gs, dy)[2]
    assert dw.dtype == F32
    assert not np.array_equal(np.asarray(dw), np.asarray(dw.astype(BF16).astype(F32)))


def test_rows_past_the_sum_never_reach_a_result():
    """Whatever the rows past the groups hold (NaN, inf), y and dx are 0 there and dw
    finite; sizes past M read nothing out of bounds."""
    x, w, dy = _operands()
    x = x.at[150:].set(jnp.nan)
    dy = dy.at[150:].set(jnp.inf)
    for sizes in ([100, 0, 50, 0, 0, 0], [100, -7, 50, 0, 0, 0]):
        y, dx, dw = jax.jit(_grouped_vjp)(x, w, jnp.asarray(sizes, jnp.int32), dy)
        for a in (y, dx, dw):
            assert np.all(np.isfinite(f64(a)))
        assert not np.asarray(y[150:]).any() and not np.asarray(dx[150:]).any()


def test_group_sizes_change_without_recompiling():
    x, w, dy = _operands()
    traces = []
    step = jax.jit(lambda *a: (traces.append(1), _grouped_vjp(*a))[1])
    for case in ("ragged", "negative", "sum_above_m"):
        sizes = SIZES[case][0]
        y, _, dw = step(x, w, jnp.asarray(sizes, jnp.int32), dy)
        ry, _, rdw = grouped_reference64(x, w, sizes, dy)
        assert rel_err(y, ry) < 4e-3 and rel_err(dw, rdw) < 1e-5
    assert len(traces) == 1


def test_eager_equals_jit_and_repeats_bitwise():
    x, w, dy = _operands()
    gs = jnp.asarray(SIZES["ragged"][0], jnp.int32)
    first = jax.jit(_grouped_vjp)(x, w, gs, dy)
    for again in (jax.jit(_grouped_vjp)(x, w, gs, dy), _grouped_vjp(x, w, gs, dy)):
        for a, b in zip(first, again):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_output_is_the_fp32_product_rounded_once():
    x, w, _ = _operands(BF16)
    gs = jnp.asarray(SIZES["exact"][0], jnp.int32)
    y = jc.grouped_projection(x, w, gs)
    want = jnp.concatenate(
        [
            jnp.dot(x[a:b], w[g].T, preferred_element_type=F32)
            for g, (a, b) in enumerate(zip(np.cumsum([0] + SIZES["exact"][0][:-1]), np.cumsum(SIZES["exact"][0])))
        ]
    ).astype(BF16)
    # each element: the FP32 sum (in some order) rounded once: at most one bf16 step apart
    diff = np.abs(f64(y) - f64(want))
    assert np.all(diff <= np.abs(f64(want)) * 2.0**-7 + 1e-30)


# --- validation --------------------------------------------------------------------------

_GP = "grouped_projection: "


@pytest.mark.parametrize(
    "args,error,words",
    [
        (dict(x=np.ones((8, 16), np.float32)), TypeError, ["x must be bfloat16", "float32"]),
        (dict(x=jnp.ones((2, 8, 16), BF16)), ValueError, ["x must have rank 2", "[M, d_in]"]),
        (dict(x="x"), TypeError, ["x must be an array"]),
        (dict(w=jnp.ones((3, 4, 16), jnp.float16)), TypeError, ["w must be bfloat16 or float32", "float16"]),
        (dict(w=jnp.ones((4, 16), F32)), ValueError, ["w must have rank 3", "[G, d_out, d_in]"]),
        (dict(w=jnp.ones((3, 4, 24), F32)), ValueError, ["x.shape[1] (16)", "w.shape[2] (24)"]),
        (dict(w=jnp.ones((0, 4, 16), F32), gs=jnp.ones((0,), jnp.int32)), ValueError, ["at least one group"]),
        (dict(gs=jnp.ones((3,), jnp.float32)), TypeError, ["group_sizes must be int32", "float32"]),
        (dict(gs=jnp.ones((3,), jnp.int16)), TypeError, ["group_sizes must be int32", "int16"]),
        (dict(gs=jnp.ones((3, 1), jnp.int32)), ValueError, ["group_sizes must have rank 1", "[G]"]),
        (dict(gs=jnp.ones((4,), jnp.int32)), ValueError, ["one size per group", "G=3", "(4,)"]),
        (dict(gs=[1, 2, 3]), TypeError, ["group_sizes must be an array"]),
        (dict(deterministic=1), TypeError, ["deterministic must be a Python bool"]),
    ],
)
def test_validation_names_the_argument(args, error, words):
    kw = dict(x=jnp.ones((8, 16), BF16), w=jnp.ones((3, 4, 16), F32), gs=jnp.ones((3,), jnp.int32))
    kw.update(args)
    deterministic = kw.pop("deterministic", True)
    call = lambda: jc.grouped_projection(kw["x"], kw["w"], kw["gs"], deterministic=deterministic)
    assert_raises_naming(error, _GP, words, call)
    assert_raises_naming(error, _GP, words, lambda: jax.jit(lambda: call())())  # at trace time too


def test_ragged_dot_checks_deterministic_on_every_path():
    x, gs = jnp.ones((8, 16), BF16), jnp.ones((3,), jnp.int32)
    for rhs in (jnp.ones((3, 16, 4), BF16), jnp.ones((3, 16, 4), F32)):  # served, and lax's
        call = lambda: jc.ragged_dot(x, rhs, gs, deterministic="no")
        assert_raises_naming(TypeError, "ragged_dot: ", ["deterministic must be a Python bool"], call)


def test_ragged_dot_with_mismatched_shapes_raises_laxs_error():
    """A call jax_cake would serve but for its shapes goes to lax, which raises its own error."""
    with pytest.raises(Exception) as ours:
        jc.ragged_dot(jnp.ones((8, 16), BF16), jnp.ones((3, 24, 4), BF16), jnp.ones((3,), jnp.int32))
    with pytest.raises(Exception) as lax:
        jax.lax.ragged_dot(jnp.ones((8, 16), BF16), jnp.ones((3, 24, 4), BF16), jnp.ones((3,), jnp.int32))
    assert type(ours.value) is type(lax.value)


# --- the planner ---------------------------------------------------------------------------


@pytest.mark.parametrize("op,m,n,k", [("grouped_fwd", 4096, 1408, 2048), ("grouped_dgrad", 4096, 2048, 1408)])
def test_grouped_plans_say_the_gemm_and_why_xla(op, m, n, k):
    from helpers import H200

    with jc.planner.force("xla"):
        p = jc.plan(op, tokens=4096, groups=64, d_in=2048, d_out=1408, device=H200)
    assert not p.uses_kernel and p.program is None and (p.m, p.n, p.k, p.groups) == (m, n, k, 64)
    text = jc.explain(p)
    assert text.splitlines()[0] == (
        f"{op}: C[{m}x{n}] over K={k}, its {m} rows in 64 groups, M / G = 64.0 rows per group expected, "
        "bfloat16 out, on NVIDIA H200 (sm_90a, 132 SMs)"
    )
    assert "runs the XLA path: forced by jax_cake.planner.force" in text


def test_grouped_wgrad_plan_is_ragged_in_k():
    p = jc.plan("grouped_wgrad", tokens=1000, groups=8, d_in=64, d_out=32, out_dtype=F32, deterministic=False)
    assert (p.m, p.n, p.k, p.out_dtype, p.groups) == (32, 64, 1000, "float32", 8)
    first = jc.explain(p).splitlines()[0]
    assert first.startswith("grouped_wgrad: C[8x32x64] (one per group) over the K=1000 tokens in 8 groups")
    assert "M / G = 125.0 tokens per group expected, float32 out, on cpu (cpu)" in first


def test_grouped_plans_of_a_call(monkeypatch):
    x, w, _ = _operands()
    plans = jc.pipeline.grouped.plans(x, w, jc.pipeline.grouped.Options(deterministic=True))
    assert [p.op for p in plans] == ["grouped_fwd", "grouped_dgrad", "grouped_wgrad"]
    assert [(p.m, p.n, p.k) for p in plans] == [(M, N, K), (M, K, N), (N, K, M)]
    assert plans[2].out_dtype == "float32" and all(p.groups == G for p in plans)
    monkeypatch.setenv("JAX_CAKE_DISABLE", "1")
    p = jc.plan("grouped_fwd", tokens=M, groups=G, d_in=K, d_out=N)
    assert "JAX_CAKE_DISABLE is set" in p.reason


@pytest.mark.parametrize(
    "op,kwargs,error,match",
    [
        ("grouped_fwd", dict(), TypeError, "grouped_fwd needs groups="),
        ("grouped_fwd", dict(groups=-1), ValueError, "groups must be >= 0"),
        ("grouped_fwd", dict(groups=2.5), TypeError, "groups must be an int"),
        ("grouped_fwd", dict(groups=True), TypeError, "groups must be an int"),
        ("grouped_dgrad", dict(groups=4, batch=2), ValueError, "batch of grouped_dgrad must be 1"),
        ("grouped_fwd", dict(groups=4, out_dtype="float32"), ValueError, "out_dtype of grouped_fwd must be bfloat16"),
        ("grouped_wgrad", dict(groups=4, out_dtype="float16"), ValueError, "must be bfloat16 or float32"),
        ("grouped_wgrad", dict(groups=4, tokens=-3), ValueError, "tokens must be >= 0"),
        ("grouped_wgrad", dict(groups=4, deterministic="yes"), TypeError, "deterministic must be a bool"),
        ("grouped_fwd", dict(groups=4, device="h200"), TypeError, "device must be a jax Device"),
        ("fwd", dict(groups=4), ValueError, "groups applies to the grouped ops"),
        ("grouped_bwd", dict(groups=4), ValueError, "op must be one of"),
    ],
)
def test_plan_rejects_bad_grouped_arguments_by_name(op, kwargs, error, match):
    args = dict(tokens=8192, d_in=4096, d_out=1024) | kwargs
    with pytest.raises(error, match=match):
        jc.plan(op, **args)


def test_plan_takes_numpy_ints_for_groups():
    p = jc.plan("grouped_fwd", tokens=np.int64(512), groups=np.int32(8), d_in=64, d_out=32)
    assert p == jc.plan("grouped_fwd", tokens=512, groups=8, d_in=64, d_out=32) and type(p.groups) is int


def test_disable_env_gives_the_same_values(monkeypatch):
    x, w, dy = _operands()
    gs = jnp.asarray(SIZES["ragged"][0], jnp.int32)
    want = jax.jit(_grouped_vjp)(x, w, gs, dy)
    monkeypatch.setenv("JAX_CAKE_DISABLE", "1")
    got = jax.jit(lambda *a: _grouped_vjp(*a))(x, w, gs, dy)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --- ragged_dot: the lax drop-in -------------------------------------------------------------


def _kn(w):
    return jnp.swapaxes(w, 1, 2)  # [G, N, K] -> lax's rhs [G, K, N]


@pytest.mark.parametrize("case", ["ragged", "exact", "one_group_takes_all", "all_empty"])
def test_ragged_dot_equals_lax_where_jax_cake_serves(case):
    x, w, dy = _operands(BF16)
    rhs = _kn(w)
    gs = jnp.asarray(SIZES[case][0], jnp.int32)
    ours = jax.jit(lambda x, r: _vjp(lambda x, r: jc.ragged_dot(x, r, gs), x, r, dy))(x, rhs)
    theirs = jax.jit(lambda x, r: _vjp(lambda x, r: jax.lax.ragged_dot(x, r, gs), x, r, dy))(x, rhs)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype == BF16 and a.shape == b.shape
        np.testing.assert_allclose(f64(a), f64(b), rtol=2.0**-7, atol=1e-6)  # at most a bf16 step
    assert rel_err(ours[0], f64(theirs[0])) < 1e-3 if int(gs.sum()) else not np.asarray(ours[0]).any()
    jaxpr = str(jax.make_jaxpr(lambda x, r: jc.ragged_dot(x, r, gs))(x, rhs))
    assert "custom_vjp_call" in jaxpr


def test_ragged_dot_runs_the_grouped_pipeline_on_rhs_as_stored():
    """On the XLA path rhs [G, K, N] is read as stored: no transpose of the weights in the
    program."""
    x, w, _ = _operands(BF16)
    rhs = _kn(w)
    gs = jnp.asarray(SIZES["ragged"][0], jnp.int32)
    loss = lambda x, r: jnp.sum(jc.ragged_dot(x, r, gs).astype(F32) ** 2)
    with jc.planner.force("xla"):
        text = cuda_text(jax.grad(loss, argnums=(0, 1)), x, rhs)
    assert "stablehlo.transpose" not in text
    assert len(_ragged_dots(text)) == 3


def test_ragged_dot_float32_master_rhs_with_a_bf16_result():
    """A float32 rhs with preferred_element_type=bfloat16: rounded to bf16 for the products
    (lax's result with the bf16 rhs), its gradient FP32 from the FP32 sum."""
    x, w, dy = _operands(F32)
    rhs = _kn(w)
    gs = jnp.asarray(SIZES["ragged"][0], jnp.int32)
    y, dx, drhs = jax.jit(
        lambda x, r: _vjp(lambda x, r: jc.ragged_dot(x, r, gs, preferred_element_type=BF16), x, r, dy)
    )(x, rhs)
    lax_y = jax.lax.ragged_dot(x, rhs.astype(BF16), gs, preferred_element_type=BF16)
    np.testing.assert_allclose(f64(y), f64(lax_y), rtol=2.0**-7, atol=1e-6)
    assert drhs.dtype == F32
    _, rdx, rdw = grouped_reference64(x, w, SIZES["ragged"][0], dy)
    assert rel_err(drhs, np.swapaxes(rdw, 1, 2)) < 1e-5 and rel_err(dx, rdx) < 4e-3


@pytest.mark.parametrize(
    "kwargs,lhs_dtype,rhs_dtype,reason",
    [
        (dict(), F32, F32, "lhs is float32"),
        (dict(preferred_element_type=F32), BF16, BF16, "preferred_element_type float32"),
        (dict(), BF16, F32, "a float32 rhs with preferred_element_type=None"),
        (dict(precision=jax.lax.Precision.HIGHEST), BF16, BF16, "precision="),
        (dict(precision=(jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGH)), BF16, BF16, "precision="),
    ],
)
def test_ragged_dot_falls_back_to_lax_and_says_why(caplog, kwargs, lhs_dtype, rhs_dtype, reason):
    logs.forget()
    x, w, dy = _operands(F32)
    x, rhs = x.astype(lhs_dtype), _kn(w).astype(rhs_dtype)
    gs = jnp.asarray(SIZES["ragged"][0], jnp.int32)
    with caplog.at_level(logging.INFO, logger="jax_cake"):
        ours = jc.ragged_dot(x, rhs, gs, **kwargs)
        jc.ragged_dot(x, rhs, gs, **kwargs)
    theirs = jax.lax.ragged_dot(x, rhs, gs, **kwargs)
    assert ours.dtype == theirs.dtype
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    lines = [r.getMessage() for r in caplog.records if "ragged_dot runs jax.lax.ragged_dot" in r.getMessage()]
    assert len(lines) == 1 and reason in lines[0], lines  # once per reason
    assert "custom_vjp_call" not in str(jax.make_jaxpr(lambda x, r: jc.ragged_dot(x, r, gs, **kwargs))(x, rhs))


def test_ragged_dot_with_group_offset_or_out_sharding_is_lax():
    x, w, _ = _operands(BF16)
    rhs, gs = _kn(w), jnp.asarray(SIZES["ragged"][0], jnp.int32)
    for kwargs in (dict(group_offset=jnp.zeros((1,), jnp.int32)), dict(out_sharding=P())):
        try:
            want = jax.lax.ragged_dot(x, rhs, gs, **kwargs)
        except Exception as e:  # lax's own error where lax does not take it (here, on CPU)
            with pytest.raises(type(e)):
                jc.ragged_dot(x, rhs, gs, **kwargs)
        else:
            np.testing.assert_array_equal(np.asarray(jc.ragged_dot(x, rhs, gs, **kwargs)), np.asarray(want))


# --- jit, vmap, remat -------------------------------------------------------------------------


def test_vmap_gives_the_per_call_results():
    x, w, dy = _operands()
    sizes = jnp.asarray([SIZES["ragged"][0], SIZES["negative"][0], SIZES["sum_above_m"][0]], jnp.int32)
    xs, ws, dys = jnp.stack([x, x * 2, -x]), jnp.stack([w, w[::-1], w * 0.5]), jnp.stack([dy, dy, -dy])
    got = jax.jit(jax.vmap(_grouped_vjp))(xs, ws, sizes, dys)
    for i in range(3):
        want = jax.jit(_grouped_vjp)(xs[i], ws[i], sizes[i], dys[i])
        for a, b in zip(got, want):
            assert_same_values(a[i], b)
    # x alone mapped (a shared weight and sizes), and a nested vmap
    ys = jax.vmap(jc.grouped_projection, in_axes=(0, None, None))(xs, w, sizes[0])
    ys2 = jax.vmap(jax.vmap(jc.grouped_projection, in_axes=(0, None, None)), in_axes=(None, 0, 0))(xs, ws, sizes)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(ys[i]), np.asarray(jc.grouped_projection(xs[i], w, sizes[0])))
        for j in range(3):
            want = jc.grouped_projection(xs[j], ws[i], sizes[i])
            np.testing.assert_array_equal(np.asarray(ys2[i, j]), np.asarray(want))


@pytest.mark.parametrize("policy,gemms", [(None, 4), (jc.remat.save_projections, 3)])
def test_remat_policy_saves_the_output_by_name(policy, gemms):
    x, w, _ = _operands()
    gs = jnp.asarray(SIZES["ragged"][0], jnp.int32)
    block = jax.checkpoint(lambda x, w: jax.nn.gelu(jc.grouped_projection(x, w, gs)), policy=policy)
    grad = jax.grad(lambda x, w: jnp.sum(block(x, w).astype(F32) ** 2), argnums=(0, 1))
    text = cuda_text(grad, x, w)
    assert grouped_gemms(text) == gemms, text
    want = jax.jit(
        jax.grad(lambda x, w: jnp.sum(jax.nn.gelu(jc.grouped_projection(x, w, gs)).astype(F32) ** 2), (0, 1))
    )
    for a, b in zip(jax.jit(grad)(x, w), want(x, w)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cuda_lowering_of_a_training_step_on_the_xla_path():
    """jit(grad) lowers for CUDA on a CPU machine: on the XLA path the three grouped GEMMs
    are XLA's ragged dots with FP32 results, no jax_cake custom call (the kernel path's
    lowering: test_grouped_kernel_path.py)."""
    x, w, _ = _operands()
    gs = jnp.asarray(SIZES["ragged"][0], jnp.int32)
    loss = lambda x, w: jnp.sum(jc.grouped_projection(x, w, gs).astype(F32) ** 2)
    with jc.planner.force("xla"):
        text = cuda_text(jax.value_and_grad(loss, argnums=(0, 1)), x, w)
    dots = _ragged_dots(text)
    assert len(dots) == 3 and all("xf32>" in line.rsplit("->", 1)[1] for line in dots), dots
    assert not custom_call_lines(text, "jax_cake_fwd") and "custom_call @jax_cake" not in text


# --- grad of grad ----------------------------------------------------------------------------


def _plain_grouped(sizes):
    """The same computation in plain JAX: every group's product, the row's own kept."""
    onehot = np.zeros((M, G), np.float32)
    start = 0
    for g, s in enumerate(effective_group_sizes(sizes, M)):
        onehot[start : start + s, g] = 1.0
        start += s

    def plain(x, w):
        every = jax.lax.dot_general(x, w.astype(BF16), (((1,), (2,)), ((), ())), preferred_element_type=F32)
        return jnp.einsum("mgn,mg->mn", every, onehot).astype(BF16)

    return plain


@pytest.mark.parametrize("w_dtype", [F32, BF16])
@pytest.mark.parametrize("case", ["ragged", "negative"])
def test_grad_of_grad_jit(case, w_dtype):
    sizes = SIZES[case][0]
    gs = jnp.asarray(sizes, jnp.int32)
    x, w, _ = _operands(w_dtype)
    fn = lambda x, w: jc.grouped_projection(x, w, gs)
    check(fn, _plain_grouped(sizes), (x, w), lambda f, ops, dirs: jax.jit(functools.partial(hvp, f))(ops, dirs))


def test_grad_of_grad_eager_and_through_ragged_dot():
    sizes = SIZES["ragged"][0]
    gs = jnp.asarray(sizes, jnp.int32)
    x, w, _ = _operands()
    check(lambda x, w: jc.grouped_projection(x, w, gs), _plain_grouped(sizes), (x, w), hvp)
    served = lambda x, w: jc.ragged_dot(x, _kn(w), gs, preferred_element_type=BF16)
    check(served, _plain_grouped(sizes), (x, w), lambda f, ops, dirs: jax.jit(functools.partial(hvp, f))(ops, dirs))


def test_third_order_runs_and_grad_of_grad_lowers_for_cuda():
    gs = jnp.asarray(SIZES["ragged"][0], jnp.int32)
    x, w, _ = _operands()
    loss = lambda x, w: jnp.sum(jc.grouped_projection(x, w, gs).astype(F32) ** 2)
    inner = lambda x, w: sum(jnp.sum(g.astype(F32) ** 2) for g in jax.grad(loss, argnums=(0, 1))(x, w))
    text = cuda_text(jax.grad(inner, argnums=(0, 1)), x, w)
    # the second-order GEMMs are the grouped kernels' roles, not XLA's ragged dot
    assert grouped_gemms(text) > 3 and not _ragged_dots(text)
    third = jax.jit(jax.grad(lambda x, w: jnp.sum(jax.grad(inner, argnums=1)(x, w)), argnums=1))(x, w)
    assert third.dtype == F32 and np.all(np.isfinite(np.asarray(third)))


def test_forward_mode_is_custom_vjps_error():
    x, w, _ = _operands()
    gs = jnp.asarray(SIZES["ragged"][0], jnp.int32)
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        jax.jvp(lambda x: jc.grouped_projection(x, w, gs), (x,), (x,))


# --- sharding ---------------------------------------------------------------------------------


def _mesh(kind=AxisType.Auto):
    return jax.make_mesh((8,), ("data",), axis_types=(kind,))


def _assert_close(got, want):
    """y, dx equal up to a bf16 step where the sharded program sums in another order; dw
    (FP32) to FP32 reassociation."""
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        tol = 1e-6 if a.dtype == F32 else 2.0**-7
        np.testing.assert_allclose(f64(a), f64(b), rtol=tol, atol=tol * float(np.max(np.abs(f64(b)))))


@pytest.mark.parametrize(
    "x_spec,w_spec",
    [
        (P("data"), P()),  # tokens data-parallel, weights replicated
        (P(), P(None, "data")),  # weights sharded on d_out
        (P(None, "data"), P(None, None, "data")),  # x and w sharded on d_in (row-parallel)
        (P("data"), P(None, "data")),  # both
        (P(), P("data")),  # w sharded on its expert axis: gathered by XLA
    ],
)
def test_jit_with_sharded_inputs_equals_the_unsharded_call(x_spec, w_spec):
    g = 8 if w_spec[:1] == ("data",) else G
    x, w, dy = _operands(g=g)
    gs = jnp.asarray(SIZES["ragged"][0] + [10, 5][: g - G], jnp.int32)
    want = jax.jit(_grouped_vjp)(x, w, gs, dy)
    mesh = _mesh()
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    got = jax.jit(_grouped_vjp)(put(x, x_spec), put(w, w_spec), gs, put(dy, x_spec if x_spec[:1] else P()))
    _assert_close(got, want)
    if x_spec == P("data"):  # every row computed whole on its shard: bitwise
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


@pytest.mark.parametrize(
    "x_spec,w_spec",
    [(P("data"), P()), (P(), P(None, "data")), (P(None, "data"), P(None, None, "data")), (P(), P("data"))],
)
def test_explicit_axes_give_each_gradient_its_primals_sharding(x_spec, w_spec):
    g = 8 if w_spec[:1] == ("data",) else G
    x, w, _ = _operands(g=g)
    gs = jnp.asarray(SIZES["ragged"][0] + [10, 5][: g - G], jnp.int32)

    def step(x, w):
        loss = lambda x, w: jnp.sum(jnp.sin(jc.grouped_projection(x, w, gs).astype(F32)))
        return jax.value_and_grad(loss, argnums=(0, 1))(x, w)

    loss, grads = jax.jit(step)(x, w)
    with jax.set_mesh(_mesh(AxisType.Explicit)):
        xs, ws = jax.device_put(x, x_spec), jax.device_put(w, w_spec)
        got_loss, got = jax.jit(step)(xs, ws)
        assert jax.typeof(got[0]).sharding.spec == jax.typeof(xs).sharding.spec
        assert jax.typeof(got[1]).sharding.spec == jax.typeof(ws).sharding.spec
    assert abs(float(got_loss) - float(loss)) <= 1e-5 * abs(float(loss))
    _assert_close(got, grads)


def test_shard_map_runs_each_shard_with_its_local_group_sizes():
    """Tokens sharded, w replicated, each device its own group sizes: y and dx are the
    per-shard calls', dw their sum (the data-parallel gradient)."""
    x, w, dy = _operands(m=256)
    sizes = jnp.asarray([[5, 0, 20, 3, 0, 4], [32, 0, 0, 0, 0, 0], [-1, 40, 0, 0, 0, 9]] + [[4] * 6] * 5, jnp.int32)
    mesh = _mesh()
    step = jax.jit(
        jax.shard_map(
            lambda x, w, gs, dy: _grouped_vjp(x, w, gs[0], dy),
            mesh=mesh,
            in_specs=(P("data"), P(), P("data"), P("data")),
            out_specs=(P("data"), P("data"), P()),
        )
    )
    y, dx, dw = step(x, w, sizes, dy)
    parts = [jax.jit(_grouped_vjp)(x[32 * i : 32 * (i + 1)], w, sizes[i], dy[32 * i : 32 * (i + 1)]) for i in range(8)]
    np.testing.assert_array_equal(np.asarray(y), np.concatenate([np.asarray(p[0]) for p in parts]))
    np.testing.assert_array_equal(np.asarray(dx), np.concatenate([np.asarray(p[1]) for p in parts]))
    np.testing.assert_allclose(np.asarray(dw), sum(f64(p[2]) for p in parts), rtol=1e-5, atol=1e-5)


def test_expert_parallel_example():
    env = child_env(drop=("XLA_FLAGS",), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "expert_parallel.py"), "--tokens=32", "--d_model=32", "--d_ff=64"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert "mesh: 8 cpu device(s) on axis 'expert'; 16 experts" in proc.stdout
    assert proc.stdout.count(" ok\n") == 3 and "match the unsharded layer" in proc.stdout


def test_exported_from_the_package():
    assert jc.grouped_projection is jc.api.grouped_projection and jc.ragged_dot is jc.api.ragged_dot
    assert {"grouped_projection", "ragged_dot"} <= set(jc.__all__)
