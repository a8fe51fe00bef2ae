"""Plans of the grouped (ragged) GEMMs: grouped_projection's and ragged_dot's MoE experts.

The three GEMMs of a grouped projection (x [M, d_in] with its rows sorted by group, w
[G, d_out, d_in], group_sizes [G] a run-time array), as Plan's op, m, n, k:

    grouped_fwd    y [M, d_out] = x . w[g]^T per group of rows      m = M,     n = d_out, k = d_in
    grouped_dgrad  dx [M, d_in] = dy . w[g] per group of rows        m = M,     n = d_in,  k = d_out
    grouped_wgrad  dw [G, d_out, d_in] = dy[g]^T . x[g], K ragged    m = d_out, n = d_in,  k = M

with Plan.groups = G. The group sizes are known only when the step runs, so a plan is
made for the static sizes alone: M / G rows per group is what the explanation can say
about the work of one group.

The grouped kernels (sm_90a: one pass over K on cooperative tiles, 128 x 256 for fwd and
dgrad, 128 x 128 for wgrad, walked in bands (choose.grouped_raster), the rows of each group
starting on a 128-row tile, jax_cake/primitives/grouped.py) run every grouped GEMM on an
sm_90a GPU that they can serve; JAX_CAKE_DISABLE, `force(program="xla")` (or "split": the
grouped kernels have no split-K), a symbolic size, d_in or d_out not a multiple of 8 and
other GPUs keep the XLA path (reference.grouped_*: lax.ragged_dot_general with an FP32
result rounded once), the same semantics, with the reason in the plan.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from jax_cake import contract, logs
from jax_cake.planner import device as device_lib
from jax_cake.planner import variants
from jax_cake.planner.plan_type import Plan
from jax_cake.planner.variants import ALIGN_ELEMENTS

_XLA_RAGGED = "XLA's ragged dot (lax.ragged_dot_general) with an FP32 result rounded once, the same semantics"
# The grouped kernels' default tile (planner/variants.py's grouped variants).
KERNEL_TILE = (contract.GROUP_ROW_ALIGN, 128, 64)
WIDE_TILE = (contract.GROUP_ROW_ALIGN, 256, 64)  # fwd and dgrad's
# grouped_gated_projection's forward with the gated epilogue (plan_grouped_gated).
GATED_OP = "grouped_fwd_gated"
# Whether plan_grouped_gated may plan the fused kernel by default (epilogue=None; the
# benchmark times both ways). Measured (H100, jax 0.11.2, 2026-12-07, --family=grouped_gated,
# (h, gu), balanced routing): the grouped GEMM then the XLA pass / the fused kernel = 1.085 at
# Qwen3-30B-A3B's experts (G 128, M 65536, 2048 -> 2 x 768), 1.005 at Mixtral-8x7B's (G 8,
# M 16384, 4096 -> 2 x 14336); again 2026-12-08: 1.068, 1.017, and 1.001 at a DeepSeek-V3
# shard's (G 32, M 16384, 7168 -> 2 x 2048). Never slower, so on.
GATED_EPILOGUE_ENABLED = True


def default_tile(op: str) -> tuple:
    """The grouped kernel's tile of op: 128 x 256 for fwd and dgrad (faster than 128 x 128 at
    every MoE shape measured, docs/planner.md), KERNEL_TILE for wgrad (its FP32 total in
    registers needs tile_n <= 160)."""
    return WIDE_TILE if op in ("grouped_fwd", "grouped_dgrad") else KERNEL_TILE


def kernel_tiles(op: str, out_dtype: str) -> tuple:
    """The tiles of the compiled grouped variants of op (a Plan.op of GROUPED_OPS)."""
    program = op.removeprefix("grouped_")
    return tuple(
        v.tile
        for v in variants.VARIANTS
        if v.grouping is not None and v.program == program and v.out_dtype == out_dtype and v.store == "plain"
    )


def gemm_dims(op: str, tokens, d_in, d_out) -> tuple:
    """(m, n, k) of grouped op `op` (the module docstring's table)."""
    if op == "grouped_fwd":
        return tokens, d_out, d_in
    if op == "grouped_dgrad":
        return tokens, d_in, d_out
    return d_out, d_in, tokens


def plan_grouped(
    op: str,
    *,
    tokens,
    groups,
    d_in,
    d_out,
    out_dtype: str,
    dev: device_lib.DeviceInfo,
    symbolic=(),
    raster: str,
    program_pin: str | None = None,
    tile_pin: tuple | None = None,
) -> Plan:
    """The Plan of grouped op `op` on validated sizes (jax_cake.planner.choose.plan checks
    them): the grouped kernel where it can run, else the XLA path, each with its reason.
    program_pin: a force block's program. raster: the kernel's tile walk (Plan.raster;
    choose.grouped_raster's rule or a force block's). tile_pin: a force block's tile, used
    where a grouped variant of op has it (else default_tile's)."""
    m, n, k = gemm_dims(op, tokens, d_in, d_out)
    gemm = dict(op=op, batch=1, m=m, n=n, k=k, out_dtype=out_dtype, device=dev.describe(), groups=groups)
    reason = _xla_reason(tokens, d_in, d_out, dev, symbolic, program_pin)
    if reason is None:
        forced = tile_pin is not None and tuple(tile_pin) in kernel_tiles(op, out_dtype)
        tile = tuple(tile_pin) if forced else default_tile(op)
        return Plan(
            **gemm,
            backend="sm90a",
            tile=tile,
            sm_count=dev.sm_count,
            raster=raster,
            reason=(
                f"the grouped kernel: each group's rows laid out from a multiple of "
                f"{contract.GROUP_ROW_ALIGN} rows, one pass over K on {tile[0]} x {tile[1]} tiles"
                f"{' (forced)' if forced else ''} ({contract.describe_raster(raster)}), bitwise reproducible"
            ),
        )
    if dev.platform == "cuda":  # a GPU user expects the kernels: say once why not
        logs.once(logging.WARNING, "jax_cake: on %s the grouped GEMMs run the XLA path: %s", dev.describe(), reason)
    return Plan(**gemm, backend="xla", reason=reason)


def plan_grouped_gated(base: Plan, activation: str, block: int, epilogue: bool | None = None) -> Plan:
    """The forward of grouped_gated_projection, gu = x W[g]^T over the stacked weight [G, 2F,
    d_in] and h = act(g) * u: base (the grouped fwd's Plan of that GEMM) as op GATED_OP, the
    same tile with the gated epilogue (jax_cake_grouped_fwd_gated: it writes gu, rounded once
    as the plain forward writes it, and h = bf16(act(g) * u) in FP32 from those bf16 values,
    so the values of the plain GEMM followed by reference.gate, up to the FP32 rounding of
    the activation's exp), or base itself where the activation runs as an XLA pass after it,
    with the reason (one log line): off the kernels, the epilogue switched off (epilogue, None:
    GATED_EPILOGUE_ENABLED), a weight interleaved by rows instead of blocks of
    contract.GATE_BLOCK (block: d_ff not a multiple of it, or operands that need partitioning)
    or a tile with no gated variant (a force() pin)."""
    if not base.uses_kernel or base.op != "grouped_fwd":
        return base
    store = f"gated_{activation}"
    reason = None
    if not (GATED_EPILOGUE_ENABLED if epilogue is None else epilogue):
        reason = "the gated kernel epilogue is switched off"
    elif block != contract.GATE_BLOCK:
        reason = f"the weight's gate and up rows are interleaved row by row, not in blocks of {contract.GATE_BLOCK}"
    elif variants.find_variant("fwd", base.tile, base.cluster, "bfloat16", store, base.schedule, "rows") is None:
        reason = f"no compiled {store} variant of the grouped {base.tile[0]}x{base.tile[1]} tile"
    if reason is None:
        return dataclasses.replace(
            base,
            op=GATED_OP,
            reason=f"{base.reason}; the {activation} epilogue in the kernel: h = bf16({activation}(g) * u)",
        )
    logs.once(
        logging.INFO,
        "jax_cake: the gated epilogue of the grouped GEMM %s on %s runs as an XLA pass after it: %s",
        f"{base.m}x{base.k}->{base.n}",
        base.device,
        reason,
    )
    return dataclasses.replace(base, reason=f"{base.reason}; then an XLA pass ({reason})")


def _xla_reason(tokens, d_in, d_out, dev, symbolic, program_pin) -> str | None:
    """Why a grouped GEMM runs the XLA path, or None where the grouped kernel runs it."""
    if program_pin == "xla":
        return "forced by jax_cake.planner.force"
    if os.environ.get("JAX_CAKE_DISABLE", "") not in ("", "0"):
        return f"JAX_CAKE_DISABLE is set: {_XLA_RAGGED}"
    if symbolic:
        return f"symbolic {', '.join(symbolic)} (a shape-polymorphic export): {_XLA_RAGGED}"
    if program_pin == "split":
        return f"forced program 'split': the grouped kernels have no split-K: {_XLA_RAGGED}"
    if dev.platform != "cuda" or dev.arch not in contract.KERNEL_ARCHS:
        return f"no grouped kernel for {dev.describe()} (kernels exist for {', '.join(contract.KERNEL_ARCHS)}): {_XLA_RAGGED}"
    if min(tokens, d_in, d_out) == 0:
        return f"an empty dimension: {_XLA_RAGGED}"
    if d_in % ALIGN_ELEMENTS or d_out % ALIGN_ELEMENTS:
        return (
            f"d_in={d_in} and d_out={d_out} must be multiples of {ALIGN_ELEMENTS} for the kernels' 16-byte TMA "
            f"strides: {_XLA_RAGGED}"
        )
    if dev.sm_count is None:
        return f"the SM count of {dev.kind} is unknown: {_XLA_RAGGED}"
    return None


def describe_gemm(p: Plan) -> str:
    """The first line of explain() for a grouped plan: the GEMM, its groups and the rows
    (for grouped_wgrad the tokens of K) a group holds on average, M / G."""
    wgrad = p.op == "grouped_wgrad"
    tokens, what = (p.k, "tokens") if wgrad else (p.m, "rows")
    if isinstance(tokens, int) and p.groups:
        per_group = f", M / G = {tokens / p.groups:.1f} {what} per group expected"
    else:
        per_group = ""
    on = f"{p.out_dtype} out, on {p.device}"
    if wgrad:
        gemm = f"{p.op}: C[{p.groups}x{p.m}x{p.n}] (one per group)"
        return f"{gemm} over the K={p.k} tokens in {p.groups} groups{per_group}, {on}"
    return f"{p.op}: C[{p.m}x{p.n}] over K={p.k}, its {p.m} rows in {p.groups} groups{per_group}, {on}"
