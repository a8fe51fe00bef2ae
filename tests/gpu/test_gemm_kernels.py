"""Every compiled GEMM program (fwd, dgrad, wgrad of jax_cake.planner.variants.VARIANTS),
called directly through its FFI target on NaN-poisoned output memory, against a float64
reference: ||out - ref|| / ||ref|| under 1e-2 for bf16 outputs and 1e-5 for fp32 dw,
and no NaN/Inf (an element the kernel did not write stays NaN)."""

import jax
import pytest

from jax_cake import contract, native
from jax_cake.planner import router_variants, variants

import kernel_cases as cases
import gpu_helpers as h

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_library")]


def test_environment(gpu_library):
    """A GPU, the library, and every variant of the variant lists compiled into it, in order."""
    names = native.compiled_variants()
    expected = [v.name for v in variants.VARIANTS]
    assert [n for n in names if not n.startswith("jax_cake_router_")] == expected
    assert [n for n in names if n.startswith("jax_cake_router_")] in ([], [v.name for v in router_variants.VARIANTS])


@pytest.mark.parametrize("case", cases.params(cases.ALL_VALUE_CASES))
def test_program_matches_float64(case):
    a, b, spec = case.operands()
    out = case.run()
    assert out.dtype == h.dtype_of(case.out_dtype)
    h.assert_close(out, h.ref64(spec, a, b), case.tol, f"{case.id} ({case.variant().name})")


def _bad_calls():
    x, w = h.rand(1, (1, 64, 128)), h.rand(2, (1, 64, 128))
    dy, x264 = h.rand(3, (2, 100, 130)), h.rand(4, (2, 100, 264))
    long_t = 64 * (2 * variants.OUTPUT_PROMOTE_EVERY + 2)  # 2 pieces of P + 1 K tiles
    x_long, dy_long = h.rand(5, (1, long_t, 4096)), h.rand(6, (1, long_t, 1024))
    return {
        "no_compiled_tile": (lambda: h.call(contract.FWD_TARGET, x, w, tile=(64, 64, 64)), "no compiled"),
        "misaligned_width": (
            lambda: h.call(contract.WGRAD_TARGET, dy, x264, tile=(128, 128, 64), out_dtype=h.F32),
            "multiples of 8",
        ),
        "split_tail_128x256_f32_long_pieces": (
            lambda: h.call(
                contract.WGRAD_TARGET, dy_long, x_long, tile=(128, 256, 64), out_dtype=h.F32, splits=2, reduction=3
            ),
            "exceed",
        ),
    }


@pytest.mark.parametrize("name", ["no_compiled_tile", "misaligned_width", "split_tail_128x256_f32_long_pieces"])
def test_bad_plan_is_an_error(name):
    """A tile naming no compiled variant, a row width the TMA cannot stride (d_out = 130,
    not a multiple of 8), or fp32 total-in-dw split-tail pieces longer than its promotion
    interval fail loudly (INVALID_ARGUMENT), not silently."""
    run, expect = _bad_calls()[name]
    with pytest.raises(Exception, match=expect):
        jax.block_until_ready(run())
