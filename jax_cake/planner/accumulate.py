"""Plans for gradient accumulation: dw = acc + dy^T x into an FP32 running sum, in place.

`plan_accumulate` returns a Plan with op "wgrad_accumulate" where the library can add
the micro-batch's weight gradient into the running sum inside the wgrad kernel
(jax_cake_wgrad_accumulate, docs/ffi_contract.md):
  - one pass over K on the fp32 reduce-add variant of the tile, with no memset: each
    element of the sum gets one fp32 add of its finished tile total;
  - or, where whole tiles leave SMs idle (skinny d_out), ordered K splits into the
    workspace and one pass that adds their split-order sum into the running sum.
Both are bitwise reproducible, whatever `deterministic` says.

The tile comes from the wgrad planner's ranking (jax_cake.planner.choose), restricted
to what `variants.supports(..., accumulate=True)` holds. Where no ranked tile has an
accumulating program the result is the ordinary FP32 wgrad plan (op "wgrad"): the
primitive then runs that wgrad and a separate XLA add (one log line says so). Off the
GPU, or where the kernels do not apply, it is the XLA plan (the reference
`acc + dot(dy^T, x)`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from jax_cake import contract, logs
from jax_cake.planner import choose, overrides, variants
from jax_cake.planner.plan_type import Plan

OP = "wgrad_accumulate"


def plan_accumulate(*, tokens: int, d_in: int, d_out: int, batch: int = 1, device: Any = None) -> Plan:
    """The Plan that adds one micro-batch's FP32 weight gradient into the running sum.

    tokens, d_in, d_out, batch: x [batch, tokens, d_in], w and the sum [batch, d_out,
    d_in]. device: as `jax_cake.plan`. Returns a Plan with op "wgrad_accumulate" (the
    fused kernel), op "wgrad" (a kernel wgrad plus a separate add) or an XLA plan.
    """
    block = overrides.active()
    # The block's pins where they name this GEMM (Plan.op "wgrad": m = d_out, n = d_in, k =
    # tokens); else the planner's own choice. A plan table's xla rows compare the plain
    # wgrad with XLA's dot; the add into the sum that the fused kernel saves is not in that
    # comparison, so the kernels' own ranking decides here (pinning "det" skips the table
    # rows, as the benchmark's arms do).
    pins = overrides.for_gemm(block, "wgrad", d_out, d_in, tokens)
    base = choose.plan_with(
        pins if pins is not None else overrides.Pins("det"),
        "wgrad",
        tokens=tokens,
        d_in=d_in,
        d_out=d_out,
        batch=batch,
        out_dtype="float32",
        deterministic=True,
        device=device,
    )
    if not base.uses_kernel:
        return base
    m, n, k, sm_count = base.m, base.n, base.k, base.sm_count
    # As the wgrad planner: 64-row tiles (one consumer warpgroup) only where reading the
    # operands bounds the GEMM; ordered K splits to fill the SMs there, or to fill the
    # last wave where the GEMM is compute bound.
    memory_bound = m * n / (m + n) < choose.RIDGE_FLOP_PER_BYTE
    for tile, tile_note in choose.ranked_tiles("wgrad", batch, m, n, sm_count, "float32"):
        if not memory_bound and tile[0] <= 64:
            continue
        tiles = batch * math.ceil(m / tile[0]) * math.ceil(n / tile[1])
        splits = choose.det_splits(tiles, k, tile[2], sm_count, fill_waves=not memory_bound)
        reduction = "ordered" if splits > 1 else "none"
        code = contract.REDUCTIONS[reduction]
        if not variants.supports("wgrad", tile, (1, 1), "float32", splits, code, accumulate=True):
            continue
        if splits > 1:
            how = f"{splits} K splits into the workspace, their split-order sum added into the running sum by one pass"
        else:
            how = "one pass over K, each finished FP32 tile reduce-added (TMA) into the running sum, no memset"
        return base.with_add_in_kernel(
            OP,
            tile,
            splits=splits,
            reduction=reduction,
            raster=choose.raster("wgrad", None if pins is None else pins.raster),
            workspace_bytes=variants.workspace_bytes(splits, code, batch, m, n, "float32"),
            reason=f"gradient accumulation in the wgrad kernel, bitwise reproducible: {how}; {tile_note}",
        )
    reason = "no compiled accumulating wgrad variant (fp32 reduce-add, or ordered partials) fits the ranked tiles"
    logs.once(
        logging.WARNING,
        "jax_cake: gradient accumulation of %s on %s runs the wgrad and then a separate add: %s",
        f"{batch}x{d_out}x{d_in}",
        base.device,
        reason,
    )
    # Without the fused add, the plain wgrad's best plan is the planner's own (table rows included).
    sizes = dict(tokens=tokens, d_in=d_in, d_out=d_out, batch=batch)
    plain = choose.plan_with(block, "wgrad", **sizes, out_dtype="float32", deterministic=True, device=device)
    return dataclasses.replace(plain, reason=f"{plain.reason}; then a separate add into the running sum ({reason})")
