"""Every compiled router program (BF16x3, fp32 in and out; router_variants.VARIANTS),
called directly on NaN-poisoned output memory, against float64: relative error under
the 5e-6 accuracy target, including ragged T, E and d tails."""

import jax
import jax.numpy as jnp
import pytest

from jax_cake import contract

import gpu_helpers as h
from kernel_cases import ROUTER_CASES, params

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_library")]


@pytest.mark.parametrize("case", params(ROUTER_CASES))
def test_router_matches_float64(case):
    out, ref = case.run_and_ref()
    err, bad = h.rel_err_nonfinite(out, ref)
    detail = ""
    if case.program == "fwd" and not (err < h.ROUTER_TOL and bad == 0):
        x, w, _ = h.router_inputs(case.T, case.d, case.E)
        x3 = jnp.dot(x, w.T, precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3)
        detail = f" (XLA BF16_BF16_F32_X3: {h.rel_err_nonfinite(x3, ref)[0]:.2e})"
    assert err < h.ROUTER_TOL and bad == 0, f"{case.id} rel_err={err:.2e} nonfinite={bad}{detail}"


def test_router_bad_plan_is_an_error():
    """A tile with no compiled router variant is an error, not a silent no-op."""
    x, w, _ = h.router_inputs(1000, 1024, 128)
    with pytest.raises(Exception, match="INVALID_ARGUMENT"):
        jax.block_until_ready(h.router_call(contract.ROUTER_FWD_TARGET, x, w, tile=(64, 64, 32)))
