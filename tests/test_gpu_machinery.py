"""CPU checks of the GPU tests' own machinery (no `gpu` marker: these run everywhere), so
the GPU tests cannot pass for the wrong reason: the float64 references are float64 and
right, a NaN (an unwritten poisoned element) or a lost donation fails, bitwise
comparison sees one bit, seeds are fixed, the cases cover every compiled program, and
the HLO analysis of tests/gpu/test_fused_gpu.py sees a restacked output.

The modules of tests/gpu (gpu_helpers, kernel_cases, the GPU test files) are importable
here because tests/conftest.py puts that folder on sys.path."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cake import contract
from jax_cake.planner import router_variants, variants

import gpu_helpers as h
import helpers
import kernel_cases as cases
import test_fused_gpu
import test_gated_gpu
import test_grouped_gpu
import test_moe_gpu

CPU = jax.devices("cpu")[0]


@pytest.mark.parametrize(
    "spec,a_shape,b_shape",
    [
        (h.FWD, (2, 37, 24), (2, 16, 24)),
        (h.DGRAD, (2, 37, 16), (2, 16, 24)),
        (h.WGRAD, (2, 37, 16), (2, 37, 24)),
        (h.FWD2, (37, 24), (16, 24)),
        (h.DGRAD2, (37, 16), (16, 24)),
        (h.WGRAD2, (37, 16), (37, 24)),
    ],
)
def test_ref64_is_a_float64_matmul(spec, a_shape, b_shape):
    with jax.default_device(CPU):
        a, b = h.rand(1, a_shape), h.rand(2, b_shape, h.F32)
        ref = h.ref64(spec, a, b)
    assert ref.dtype == np.float64
    np.testing.assert_allclose(np.asarray(ref), np.einsum(spec, h.f64(a), h.f64(b)), rtol=1e-13, atol=1e-12)


def test_gpu_helpers_are_the_shared_helpers():
    """gpu_helpers defines no input, conversion or error of its own: tests/helpers.py's."""
    for name in ("rand", "f64", "rel_err", "rel_err_nonfinite"):
        assert getattr(h, name) is getattr(helpers, name), name


def test_rand_is_seeded_scaled_then_rounded():
    with jax.default_device(CPU):
        v = jax.random.normal(jax.random.key(11), (5, 7), jnp.float32)
        assert h.rand(11, (5, 7)).dtype == h.BF16
        assert h.same_bits(h.rand(11, (5, 7)), v.astype(h.BF16))
        assert h.same_bits(h.rand(11, (5, 7), h.F32), v)
        assert h.same_bits(h.rand(11, (5, 7), h.BF16, scale=0.02), (v * 0.02).astype(h.BF16))
        assert not h.same_bits(h.rand(11, (5, 7)), h.rand(12, (5, 7)))


def test_f64_is_exact():
    with jax.default_device(CPU):
        for dtype in (h.BF16, h.F32):
            a = h.rand(13, (6, 9), dtype, scale=1e3)
            got = h.f64(a)
            assert isinstance(got, np.ndarray) and got.dtype == np.float64 and got.shape == a.shape
            assert h.same_bits(jnp.asarray(got.astype(np.float32)).astype(dtype), a)
        assert h.f64(np.float64(1) + 2.0**-40) == 1 + 2.0**-40  # float64 in, nothing rounded


def test_rel_err_and_nonfinite_count():
    with jax.default_device(CPU):
        ref = h.ref64(h.FWD2, h.rand(3, (8, 16)), h.rand(4, (8, 16)))
        out = ref.astype(jnp.float32)
        ref_np = np.asarray(ref)
        scaled = jnp.asarray((ref_np * 1.01).astype(np.float32))
        poisoned = out.at[3, 5].set(jnp.nan).at[0, 0].set(jnp.inf)
        # the host (numpy) path and the device (jit) path a GPU array takes agree
        for rel_err_nonfinite in (h.rel_err_nonfinite, helpers._rel_err_on_device):
            err, bad = rel_err_nonfinite(out, ref)
            assert bad == 0 and err < 1e-7
            err, bad = rel_err_nonfinite(scaled, ref)
            assert bad == 0 and abs(err - 0.01) < 1e-6
            err, bad = rel_err_nonfinite(poisoned, ref)
            assert bad == 2 and np.isfinite(err)
            assert abs(err - rel_err_nonfinite(out.at[3, 5].set(0).at[0, 0].set(0), ref)[0]) < 1e-15
        assert h.rel_err_nonfinite(scaled, ref_np)[0] == pytest.approx(helpers._rel_err_on_device(scaled, ref)[0])
        with pytest.raises(AssertionError, match="shape"):
            h.rel_err_nonfinite(out[:4], ref)


def test_rel_err_asserts_finite_output():
    with jax.default_device(CPU):
        ref = h.ref64(h.FWD2, h.rand(3, (8, 16)), h.rand(4, (8, 16)))
        out = ref.astype(jnp.float32)
        assert h.rel_err(out, ref) == h.rel_err_nonfinite(out, ref)[0] < 1e-7
        assert h.rel_err(out, np.asarray(ref)) < 1e-7  # a numpy reference, as most CPU tests pass
        with pytest.raises(AssertionError, match="1 non-finite"):
            h.rel_err(out.at[2, 2].set(jnp.nan), ref)
        with pytest.raises(AssertionError, match="shape"):
            h.rel_err(out[:4], ref)


def test_assert_close_fails_on_one_nan():
    """One unwritten element (NaN) fails the check even though the error norm ignores it."""
    with jax.default_device(CPU):
        a, b = h.rand(5, (64, 32)), h.rand(6, (48, 32))
        ref = h.ref64(h.FWD2, a, b)
        out = ref.astype(h.BF16)
        h.assert_close(out, ref, h.BF16_TOL)
        with pytest.raises(AssertionError, match="nonfinite=1"):
            h.assert_close(out.at[63, 47].set(jnp.nan), ref, h.BF16_TOL)
        with pytest.raises(AssertionError, match="rel_err"):
            h.assert_close(out, ref, h.F32_TOL)  # bf16 rounding is far above the fp32 bound


def _mm(result, a, b):
    return jnp.dot(a, b.T, preferred_element_type=jnp.float32).astype(result.dtype)


def _mm_f32_into_bf16(result, a, b):
    return jnp.dot(a, b.T, preferred_element_type=jnp.float32)  # not the donated buffer's dtype


def test_run_poisoned_aliases_the_donated_buffer():
    with jax.default_device(CPU):
        a, b = h.rand(7, (16, 8)), h.rand(8, (12, 8))
        out = h.run_poisoned(_mm, (16, 12), h.BF16, a, b)
        assert out.dtype == h.BF16 and out.shape == (16, 12)
        assert not np.isnan(np.asarray(out, np.float32)).any()
        h.assert_close(out, h.ref64(h.FWD2, a, b), h.BF16_TOL)


def test_run_poisoned_fails_when_the_donation_is_unused():
    """A result XLA cannot place in the NaN buffer would come from fresh memory: an error."""
    with jax.default_device(CPU):
        a, b = h.rand(7, (16, 8)), h.rand(8, (12, 8))
        with pytest.raises(AssertionError, match="not aliased"):
            h.run_poisoned(_mm_f32_into_bf16, (16, 12), h.BF16, a, b)


def test_same_bits_sees_one_bit():
    with jax.default_device(CPU):
        for dtype in (h.BF16, h.F32):
            a = h.rand(9, (33, 17), dtype)
            assert h.same_bits(a, a + 0)
            assert not h.same_bits(a, a.at[5, 3].set(-a[5, 3]))
            z = jnp.zeros((4,), dtype)
            assert not h.same_bits(z, -z)  # +0 and -0 compare equal as values, not as bits
            assert not h.same_bits(a, a.astype(jnp.float32 if dtype == h.BF16 else h.BF16))


def test_assert_repeatable_fails_on_one_differing_run():
    with jax.default_device(CPU):
        a = h.rand(10, (8, 8), h.F32)
        h.assert_repeatable(lambda: a * 2, 5)
        runs = iter([a, a, a.at[0, 0].add(1e-6), a])
        with pytest.raises(AssertionError, match="3/4"):
            h.assert_repeatable(lambda: next(runs), 4)


def test_seeds_are_fixed_and_distinct():
    assert h.seed_of("x", 1, 37, 136, 64) == h.seed_of("x", 1, 37, 136, 64)
    assert h.seed_of("x", 1, 37, 136, 64) != h.seed_of("w", 1, 37, 136, 64)
    assert h.seed_of("x", 1, 37, 136, 64) != h.seed_of("x", 1, 37, 136, 72)
    with jax.default_device(CPU):
        x1, w1, dy1 = h.gemm_inputs(1, 5, 16, 8)
        h.gemm_inputs.cache_clear()
        x2, w2, dy2 = h.gemm_inputs(1, 5, 16, 8)
        assert h.same_bits(x1, x2) and h.same_bits(w1, w2) and h.same_bits(dy1, dy2)
        assert not h.same_bits(x1[:, :, :8], w1[:, :5, :])  # independent draws


def test_ffi_attrs_codes():
    a = h.ffi_attrs((128, 256, 64), splits=3, reduction=contract.REDUCTION_SPLIT_TAIL)
    assert int(a["schedule"]) == contract.SCHEDULE_SPLIT_TAIL and int(a["reduction"]) == contract.REDUCTION_SPLIT_TAIL
    a = h.ffi_attrs((128, 128, 64), raster=1, cluster=(2, 1), schedule="pingpong")
    assert int(a["schedule"]) == contract.SCHEDULE_PINGPONG and int(a["cluster_m"]) == 2 and int(a["raster"]) == 1
    assert {k: int(v) for k, v in h.ffi_attrs((64, 128, 64)).items()} == dict(
        schedule=0, tile_m=64, tile_n=128, tile_k=64, cluster_m=1, cluster_n=1, splits=1, reduction=0, raster=0
    )


def test_command_buffer_detection():
    inside = "kCommandBuffer\n  kCustomCall jax_cake_fwd\n  kCustomCall jax_cake_dgrad\n"
    beside = "kCustomCall jax_cake_fwd\nkCommandBuffer\n  kMemset\n"
    assert h.command_buffer_holds_custom_calls(inside)
    assert not h.command_buffer_holds_custom_calls(beside)
    assert not h.command_buffer_holds_custom_calls("kCustomCall jax_cake_fwd\n")


def test_the_restack_check_sees_concatenates_of_the_outputs():
    """test_fused_gpu's HLO analysis itself, at a tiny size on any backend (on CPU the
    forward is the reference's FP32 dot of [37, 48], rounded to bf16 after it): silent on
    the fused step, finds the control's."""
    f = test_fused_gpu
    x, ws, cs = f._inputs(37, 64, (8, 16, 8, 16))
    on_gpu = jax.devices()[0].platform == "gpu"
    source = f.fed_by_custom_call("jax_cake_fwd") if on_gpu else (lambda op, line: op == "dot" and "= f32[37,48]" in line)
    assert f.concatenates_fed_by(f._hlo(f._fused_step, x, ws, cs), source) == []
    assert f.concatenates_fed_by(f._hlo(f._stacking_step, x, ws, cs), source)


def _all_gemm_cases():
    return cases.ALL_VALUE_CASES + cases.REPEAT_CASES + cases.ATOMIC_CASES


def test_every_case_names_a_compiled_program():
    for c in _all_gemm_cases():
        assert c.variant() is not None, c.id
        assert variants.supports(
            c.program, c.tile, c.cluster, c.out_dtype, c.splits, c.reduction, c.schedule
        ), c.id
    for c in cases.ROUTER_CASES:
        red = contract.REDUCTION_ORDERED if c.splits > 1 else contract.REDUCTION_NONE
        assert router_variants.supports(c.program, h.ROUTER_TILE, c.splits, red), c.id


def test_residual_cases_name_compiled_reduce_add_programs():
    assert cases.RESIDUAL_CASES
    for c in cases.RESIDUAL_CASES:
        assert c.residual and c.program == "fwd" and c.target == contract.FWD_RESIDUAL_TARGET, c.id
        assert c.variant() is not None and c.variant().store == "add", c.id
        assert variants.supports("fwd", c.tile, c.cluster, "bfloat16", 1, 0, accumulate=True), c.id
    assert all(not c.residual for c in _all_gemm_cases())


def test_cases_cover_every_compiled_program():
    """Every entry of VARIANTS and router_variants.VARIANTS is checked against float64
    (so a newly compiled variant without a GPU test fails here, on CPU)."""
    covered = {c.variant().name for c in cases.ALL_VALUE_CASES + cases.RESIDUAL_CASES}
    # The gated epilogue's variants: test_gated_gpu.test_gated_kernel_epilogue, each forced;
    # the gradient epilogue's: test_gated_gpu.test_gate_grad_kernel_epilogue; the dx from
    # the cotangent's halves: test_gated_gpu.test_gate_up_dgrad_kernel; the grouped
    # variants: test_grouped_gpu's kernel path, the grouped gated ones test_moe_gpu's.
    gated = test_gated_gpu.GATED_VARIANTS + test_gated_gpu.GATE_GRAD_VARIANTS + test_gated_gpu.GATE_UP_VARIANTS
    covered |= {v.name for v in gated + test_grouped_gpu.GROUPED_VARIANTS + test_moe_gpu.GROUPED_GATED_VARIANTS}
    assert covered == {v.name for v in variants.VARIANTS}, sorted({v.name for v in variants.VARIANTS} - covered)
    covered = {c.variant().name for c in cases.ROUTER_CASES}
    assert covered == {v.name for v in router_variants.VARIANTS}


def test_deterministic_programs_are_repeated():
    """Every deterministic reduction kind and schedule has a bitwise-repeat case, and no
    arrival-order (atomic) program is expected to be bitwise."""
    kinds = {(c.program, c.reduction, c.schedule, c.cluster, c.out_dtype) for c in cases.REPEAT_CASES}
    assert not any(r == contract.REDUCTION_ARRIVAL for _, r, _, _, _ in kinds)
    for want in (
        ("wgrad", contract.REDUCTION_ORDERED, "tiles", (1, 1), "float32"),
        ("wgrad", contract.REDUCTION_ORDERED, "tiles", (1, 1), "bfloat16"),
        ("wgrad", contract.REDUCTION_NONE, "tiles", (1, 1), "float32"),
        ("wgrad", contract.REDUCTION_SPLIT_TAIL, "tiles", (1, 1), "float32"),
        ("wgrad", contract.REDUCTION_SPLIT_TAIL, "tiles", (1, 1), "bfloat16"),
        ("wgrad", contract.REDUCTION_ORDERED, "tiles", (2, 1), "float32"),
        ("fwd", contract.REDUCTION_NONE, "pingpong", (1, 1), "bfloat16"),
        ("dgrad", contract.REDUCTION_NONE, "pingpong", (2, 1), "bfloat16"),
    ):
        assert want in kinds, want
    assert all(c.reduction == contract.REDUCTION_ARRIVAL for c in cases.ATOMIC_CASES) and cases.ATOMIC_CASES


@pytest.mark.parametrize(
    "name", ["ALL_VALUE_CASES", "REPEAT_CASES", "ATOMIC_CASES", "ROUTER_CASES"]
)
def test_case_ids_are_unique(name):
    ids = [c.id for c in getattr(cases, name)]
    assert not [i for i, n in collections.Counter(ids).items() if n > 1]


def test_seed_grid_split():
    """The default run holds the whole grid at T = 16172; `slow` holds the other two T."""
    grid = cases.SEED_GRID
    assert {c.shape[1] for c in grid if not c.slow} == {16172}
    assert {c.shape[1] for c in grid if c.slow} == {16231, 16384}
    assert len({c.shape for c in grid}) == 3 * 2 * 6


def _reference_body(program: str, out_dtype: str):
    from jax_cake import reference

    def body(result, a, b):
        if program == "fwd":
            return reference.fwd(a, b)
        if program == "dgrad":
            return reference.dgrad(a, b)
        return reference.wgrad(a, b, result.dtype)

    return body


_REF_BODIES = {}


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in cases.TINY + cases.SANITY[:8]])
def test_checks_pass_for_the_xla_reference(case):
    """The GEMM checks, run with jax_cake's XLA reference (the kernels' semantics) in the
    kernel's place on CPU: operands, float64 spec, output shape and tolerance agree."""
    with jax.default_device(CPU):
        a, b, spec = case.operands()
        body = _REF_BODIES.setdefault((case.program, case.out_dtype), _reference_body(case.program, case.out_dtype))
        out = h.run_poisoned(body, h.gemm_out_shape(case.target, a, b), h.dtype_of(case.out_dtype), a, b)
        h.assert_close(out, h.ref64(spec, a, b), case.tol, case.id)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in cases.ROUTER_CASES if c.T < 1000])
def test_router_checks_pass_for_the_xla_reference(case):
    """The router checks with the XLA BF16x3 reference in the kernels' place, on CPU."""
    from jax_cake import reference

    with jax.default_device(CPU):
        x, w, g = h.router_inputs(case.T, case.d, case.E)
        a, b, spec, fn = {
            "fwd": (x, w, h.FWD2, reference.router_fwd),
            "dgrad": (g, w, h.DGRAD2, reference.router_dgrad),
            "wgrad": (g, x, h.WGRAD2, reference.router_wgrad),
        }[case.program]
        h.assert_close(fn(a, b), h.ref64(spec, a, b), h.ROUTER_TOL, case.id)


def test_tolerances_are_the_accuracy_contract():
    """The GPU checks and the tuner's condition (d) hold one contract (benchmarks/plan_rule.py)."""
    from benchmarks import plan_rule

    assert h.F32_TOL == plan_rule.rel_err_max("wgrad", "float32") == 1e-5
    assert h.BF16_TOL == plan_rule.rel_err_max("fwd", "bfloat16") == plan_rule.rel_err_max("wgrad", "bfloat16")


# --- the quick tier (pytest -m "gpu and not full") -----------------------------------------


def _quick(case_list, xfail=()):
    return [case_list[i] for i in cases.quick_tier(case_list, xfail)]


def test_quick_tier_calls_every_compiled_program():
    """The quick tier of each parametrized case list still calls every compiled program the
    list calls (so every entry of VARIANTS and router_variants.VARIANTS), once per tier key,
    on a case that is not slow and, where the list has one, fills a tile."""
    for case_list in (cases.ALL_VALUE_CASES, cases.RESIDUAL_CASES, cases.REPEAT_CASES, cases.ROUTER_CASES):
        quick = _quick(case_list)
        assert [c.tier_key for c in quick] == list(dict.fromkeys(c.tier_key for c in quick))  # each key once
        assert {c.tier_key for c in quick} == {c.tier_key for c in case_list}
        assert not any(getattr(c, "slow", False) for c in quick)
        for c in quick:
            if any(o.fills_a_tile for o in case_list if o.tier_key == c.tier_key):
                assert c.fills_a_tile, c.id
        assert len(quick) < len(case_list)
    covered = {c.variant().name for c in _quick(cases.ALL_VALUE_CASES) + _quick(cases.RESIDUAL_CASES)}
    # the gated and gradient epilogues and the dx from the halves: their own file, not full-only
    gated = test_gated_gpu.GATED_VARIANTS + test_gated_gpu.GATE_GRAD_VARIANTS + test_gated_gpu.GATE_UP_VARIANTS
    covered |= {v.name for v in gated + test_grouped_gpu.GROUPED_VARIANTS + test_moe_gpu.GROUPED_GATED_VARIANTS}
    assert covered == {v.name for v in variants.VARIANTS}
    assert {c.variant().name for c in _quick(cases.ROUTER_CASES)} == {v.name for v in router_variants.VARIANTS}
    reductions = {(c.variant().name, c.reduction) for c in _quick(cases.ALL_VALUE_CASES)}
    assert reductions == {(c.variant().name, c.reduction) for c in cases.ALL_VALUE_CASES}


def test_params_mark_full_slow_and_expected_failures():
    big = (1, 8192, 14336, 4096)
    mark = pytest.mark.xfail(strict=True, reason="test")
    got = cases.params(cases.RESIDUAL_CASES, xfail={big: mark})
    names = [[m.name for m in p.marks] for p in got]
    quick = [c for p, n in zip(got, names) if "full" not in n for c in p.values]
    assert quick == _quick(cases.RESIDUAL_CASES, {big: mark})
    assert all(c.shape != big for c in quick)  # an expected failure is never the quick case of its program
    assert [p.values[0].shape == big for p in got] == ["xfail" in n for n in names]
    grid = cases.params(cases.SEED_GRID)
    assert all("full" in [m.name for m in p.marks] for p in grid if p.values[0].slow)
