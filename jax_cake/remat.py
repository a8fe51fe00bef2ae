"""Checkpoint (remat) policies that know jax_cake's outputs.

`jax.checkpoint_policies.dots_saveable` matches `dot_general` only; jax_cake's GEMMs
are custom calls, so it would recompute every projection. Each jax_cake op names its
output with `jax.ad_checkpoint.checkpoint_name`; these policies save by that name.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

OUTPUT_NAME = "jax_cake.output"


def name_output(y):
    """Tags a jax_cake op's output so a policy can save it."""
    return checkpoint_name(y, OUTPUT_NAME)


# Save jax_cake outputs, recompute everything else (elementwise work is cheap).
save_projections = jax.checkpoint_policies.save_only_these_names(OUTPUT_NAME)

# Save jax_cake outputs and XLA dots: a drop-in for dots_saveable in mixed models.
save_projections_and_dots = jax.checkpoint_policies.save_from_both_policies(
    save_projections, jax.checkpoint_policies.dots_saveable
)
