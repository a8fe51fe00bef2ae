"""Checkpoint (remat) policies that know jax_cake's outputs.

`jax.checkpoint_policies.dots_saveable` matches `dot_general` only; jax_cake's GEMMs
are custom calls, so it would recompute every projection. Each jax_cake op names its
output with `jax.ad_checkpoint.checkpoint_name`; these policies save by that name.

The gated ops (gated_projection, swiglu_mlp) also name the bf16 pre-activation of their
gate/up GEMM, [gate | up] for every token, PREACTIVATION_NAME: it is what their backward
needs. Saving it keeps the gate/up GEMM from running again in the backward; h = act(g) *
u is then recomputed from it elementwise. Where the gated kernel wrote h in the GEMM's
epilogue (jax_cake.planner.gated, and planner.grouped's plan_grouped_gated for the MoE
experts), h is named ACTIVATION_NAME as well: it can only be
recomputed by that GEMM, so the policies that save the pre-activation save it too.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

OUTPUT_NAME = "jax_cake.output"
PREACTIVATION_NAME = "jax_cake.gated_preactivation"
ACTIVATION_NAME = "jax_cake.gated_activation"


def name_output(y):
    """Tags a jax_cake op's output so a policy can save it."""
    return checkpoint_name(y, OUTPUT_NAME)


def name_activation(h):
    """Tags h = act(g) * u where the gated kernel wrote it beside the pre-activation (it
    cannot be recomputed from gu without running that GEMM again)."""
    return checkpoint_name(h, ACTIVATION_NAME)


def name_preactivation(gu):
    """Tags the gated ops' bf16 pre-activation (the gate/up GEMM's output)."""
    return checkpoint_name(gu, PREACTIVATION_NAME)


# Save jax_cake's GEMM outputs (the ops' outputs and the gated pre-activation), recompute
# everything else (elementwise work is cheap).
save_projections = jax.checkpoint_policies.save_only_these_names(OUTPUT_NAME, PREACTIVATION_NAME, ACTIVATION_NAME)

# Save jax_cake outputs and XLA dots: a drop-in for dots_saveable in mixed models.
save_projections_and_dots = jax.checkpoint_policies.save_from_both_policies(
    save_projections, jax.checkpoint_policies.dots_saveable
)

# Save only the gated pre-activation: a SwiGLU MLP under this policy keeps [gate | up]
# (2 F bf16 values per token) and recomputes h elementwise; x is the checkpoint's input.
# Where the gated kernel wrote h (ACTIVATION_NAME) it keeps h too (3 F values per token),
# since recomputing it would run the gate/up GEMM again.
save_gated_preactivation = jax.checkpoint_policies.save_only_these_names(PREACTIVATION_NAME, ACTIVATION_NAME)
