"""Plans for the residual add in the forward GEMM: y = r + x w^T into r's buffer.

`plan_residual` returns a Plan with op "fwd_residual" where the library can add the
forward's bf16 tiles into the residual inside the kernel (jax_cake_fwd_residual,
docs/ffi_contract.md): one pass over K on the bf16 reduce-add ("add" store) fwd variant
of the tile, each finished tile rounded to bf16 and TMA reduce-added into r, so
y = bf16(r + bf16(x w^T)), one add per element (bitwise reproducible): bit for bit the
plain forward of the same tile followed by a bf16 add. With RESIDUAL_KERNELS_ENABLED
(below) set to False it returns the ordinary forward plan (op "fwd"): the forward and a
separate add, with the same values.

The tile comes from the forward planner's ranking (jax_cake.planner.choose, the same
rules as a plain forward, without the plan table's tile rows: they timed the plain
forward's kernels), restricted to what `variants.supports(..., accumulate=True)`
holds for fwd: the reduce-add variants, cluster 1x1, cooperative tiles. A tile pinned by
`jax_cake.planner.force` comes first. Where no ranked tile has a reduce-add variant the
result is the ordinary forward plan (op "fwd"): the primitive then runs that forward and
a separate XLA add (one log line says so). Off the GPU, or where the kernels do not apply
(including the plan table's XLA rows), it is the XLA plan: the primitive's reference.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from jax_cake import contract, logs
from jax_cake.planner import choose, overrides, variants
from jax_cake.planner.plan_type import Plan

OP = "fwd_residual"
# A switch to hold the fused residual kernels back (the op then runs the forward and a
# separate add, with the same values). On: tests/gpu/test_residual_gpu.py passes at every
# shape on the H200, the down projection 8192 x 14336 -> 4096 included (docs/benchmarks.md,
# "Residual add in the forward").
RESIDUAL_KERNELS_ENABLED = True


def plan_residual(*, tokens: int, d_in: int, d_out: int, batch: int = 1, device: Any = None) -> Plan:
    """The Plan that computes y = r + x w^T with the add in the forward kernel.

    tokens, d_in, d_out, batch: x [batch, tokens, d_in], w [batch, d_out, d_in], r and y
    [batch, tokens, d_out]. device: as `jax_cake.plan`. Returns a Plan with op
    "fwd_residual" (the fused kernel), op "fwd" (a kernel forward plus a separate add) or
    an XLA plan.
    """
    block = overrides.active()
    base = choose.plan_with(
        block, "fwd", tokens=tokens, d_in=d_in, d_out=d_out, batch=batch, device=device, tile_rows=False
    )
    if not base.uses_kernel:
        return base
    if not RESIDUAL_KERNELS_ENABLED:
        held = "the fused residual kernels are held back (RESIDUAL_KERNELS_ENABLED)"
        return dataclasses.replace(base, reason=f"{base.reason}; then a separate add of the residual ({held})")
    ranked = choose.ranked_tiles("fwd", batch, base.m, base.n, base.sm_count, "bfloat16")
    pins = overrides.for_gemm(block, "fwd", base.m, base.n, base.k)
    pinned = None if pins is None else pins.tile
    if pinned is not None:
        ranked.insert(0, (tuple(pinned), f"{pinned[0]}x{pinned[1]} tiles (forced)"))
    for tile, tile_note in ranked:
        if not variants.supports("fwd", tile, (1, 1), "bfloat16", 1, contract.REDUCTION_NONE, accumulate=True):
            continue
        return base.with_add_in_kernel(
            OP,
            tile,
            reason=(
                f"residual add in the forward kernel: one pass over K={base.k}, each finished tile rounded to bf16 "
                f"and reduce-added (TMA) into the residual's buffer, {contract.describe_raster(base.raster)}: {tile_note}"
            ),
        )
    reason = "no compiled residual-add (bf16 reduce-add) fwd variant fits the ranked tiles"
    logs.once(
        logging.WARNING,
        "jax_cake: the residual add of %s on %s runs the forward and then a separate add: %s",
        f"{batch}x{tokens}x{d_in}->{d_out}",
        base.device,
        reason,
    )
    return dataclasses.replace(base, reason=f"{base.reason}; then a separate add of the residual ({reason})")
