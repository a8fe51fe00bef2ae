"""Choosing a plan: op + static shapes + dtypes + device -> a frozen Plan (plan_type.py).

`plan()` is the entry point. It rules out the kernels where they cannot run (no CUDA GPU,
another architecture, unaligned or empty shapes: the XLA path, with the reason), then
runs XLA's dot where the measured plan table (jax_cake.planner.tables) records it faster
(fwd, dgrad, wgrad), then picks the tile (utilization ranked by a per-tile prior), the
wgrad algorithm (the `deterministic` flag, else the plan table), K splits,
split tail, cluster pairing, raster and schedule by the rules below. Where the table holds
a tile row for a fwd/dgrad point, that point runs the row's tile, schedule and cluster
instead of the rule's. Pins set by `jax_cake.planner.force` (overrides.py) win over the
rules and the rows: `plan()` reads them once, narrows them to the GEMM it plans and passes
them to the rules they override. Why each threshold has its value, with the measurements
behind it: docs/planner.md.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, NamedTuple

from jax_cake import contract, logs
from jax_cake.planner import device as device_lib
from jax_cake.planner import grouped, overrides, router_variants, tables, variants
from jax_cake.planner.plan_type import GROUPED_OPS, OPS, Plan

# Per-tile efficiency prior: larger tiles reuse operands better when compute bound.
# 128 x 160 runs slower per SM than 128 x 256 (its N-major B tile gets a 64-byte swizzle),
# so it wins only where it fills a wave the others leave a third empty (5120 -> 512).
# Measured priors: docs/planner.md.
_TILE_PRIOR = {(128, 256): 1.00, (128, 128): 0.93, (64, 256): 0.90, (128, 64): 0.85, (128, 160): 0.80}


def compiled_tiles(program: str, out_dtype: str | None = None) -> tuple[tuple[int, int, int], ...]:
    """The CTA tiles (M, N, K) the native library holds for a program: "fwd", "dgrad",
    "wgrad", or the router's "router_fwd" / "router_dgrad" / "router_wgrad", optionally
    only those with an `out_dtype` output. Read from the build's variant lists (cluster
    1x1: every tile has one; `_pick_cluster` adds a (2, 1) pair where the library holds
    it), so a plan never names a missing kernel."""
    if program.startswith("router_"):
        family, program = router_variants.VARIANTS, program[len("router_") :]
    else:
        # Ping-pong-only tiles (128 x 192, 128 x 160) have no cooperative variant:
        # they are reached through the ping-pong rule or force(tile=, schedule="pingpong").
        family = [
            v
            for v in variants.VARIANTS
            if v.cluster == (1, 1) and v.store == "plain" and v.schedule != "pingpong" and v.grouping is None
        ]
    return tuple(
        sorted(
            {
                v.tile
                for v in family
                if v.program == program and out_dtype in (None, getattr(v, "out_dtype", "float32"))
            },
            reverse=True,
        )
    )


def _wgrad_supported(tile, out_dtype: str, splits: int, reduction: str) -> bool:
    """Whether the library can run this wgrad program (ordered split-K runs the fp32
    variant of the tile into the workspace, arrival order its fp32 "add" variant)."""
    return variants.supports("wgrad", tile, (1, 1), out_dtype, splits, contract.REDUCTIONS[reduction])


# A split gets at least this many K tiles, so the partial-sum traffic stays small
# against the operand reads.
_MIN_K_TILES_PER_SPLIT = 8
# A wgrad whose FLOPs per operand byte (about m n / (m + n) for K >> m, n) stay under
# this is bound by reading x and dy: the H200's peak BF16 FLOP/s over its memory
# bandwidth (docs/planner.md).
RIDGE_FLOP_PER_BYTE = 184
# A compute-bound deterministic wgrad adds ordered K splits until its CTAs fill this much
# of their last wave (`det_splits`).
_WAVE_FILL = 0.9
# The router kernels run only once their accuracy is shown on a GPU (the GPU tests'
# router checks exercise them directly either way); they meet the 5e-6 target on the
# H200 (docs/planner.md).
ROUTER_KERNELS_ENABLED = True
# Up to this many experts the router runs XLA's own BF16x3 dot (BF16_BF16_F32_X3, the same
# products): at E = 8 and 16 (d 4096 and 7168, T 16384) the fused kernels ran 0.82-0.89x
# of it, from E = 64 up 1.2-2.3x (wall-time probes on the H200, jax 0.11.2, 2026-12-02).
ROUTER_XLA_MAX_EXPERTS = 16
# The tile walk (contract's raster codes). A wave of 132 CTAs walking N first reads the
# whole weight once the weight's rows exceed a wave (B operand 4096 x 14336 bf16: 117 MB
# against the H200's 60 MB L2), so fwd and dgrad walk in bands of _RASTER_BAND_FWD
# cluster rows: a wave then covers about as many A rows as B rows. Measured on the H200
# (jax 0.11.2, 2026-12-04, a GEMM back to back, T 8192): bands of 8 beat the N-first walk by 1-10 %
# at eight Llama shapes and tie at 4096 -> 4096, whose weight fits in L2; where all N tiles
# fit in a band the walk is the N-first one's. Walking M first instead re-reads A (x, 134 MB
# at T 16384, d_in 4096) once per N tile: the fwd at d_out 192 / 384 (3 N tiles) took 104 /
# 109 us M first against XLA's 45 / 74 (2026-12-05); with one N tile a band is the M-first
# walk. wgrad walks in bands of _RASTER_BAND_WGRAD (6-7 % faster than M first where d_out
# >= 8192, the same walk where d_out <= 4096). docs/planner.md.
_RASTER_BAND_FWD = 8
# The grouped fwd / dgrad kernels (128 x 256 tiles) walk in bands of 4 rows. The kernels
# alone at the Mixtral, DeepSeek-V3 and Qwen3 expert shapes (H100, jax 0.11.2, 2026-12-07,
# medians of interleaved rounds): bands of 4 within 6 % of the best walk at every shape and
# role, bands of 8 up to 22 % behind (Mixtral 14336 -> 4096 fwd), M first 1.05-1.6x slower;
# the 128 x 128 tile walking M first 2.0-2.4x slower. The grouped wgrad's walk (M first,
# bands of 8 or 16) made no difference (within 2 %): the dense wgrad's. docs/planner.md.
_RASTER_BAND_GROUPED = 4
_RASTER_BAND_WGRAD = 16
# A split tail cuts each tail tile into at most this many K pieces (each piece but the
# last costs a partial-tile store and load).
_MAX_TAIL_SPLITS = 4
# Cluster pairs (2, 1): the CTAs of two adjacent M tiles share their B tile (TMA multicast),
# halving its L2 -> SM traffic. That pays only where the GEMM is compute bound (N >= 1024,
# K >= 512); elsewhere it gains nothing or loses a little. The ping-pong dgrad pairs by
# the same rule (docs/planner.md).
_CLUSTER_MIN_N = 1024
_CLUSTER_MIN_K = 512
# dgrad with a short K loop runs the ping-pong 128 x 128 variant (one warpgroup stores a
# tile while the other multiplies the next), so the epilogue hides behind the MMAs. With a
# long K loop (4096) the epilogue matters little and the cooperative tiles win; under one
# K tile (K < 64) there is nothing to overlap. Batched dgrad (N = 128 or 512) gains
# nothing clear: it keeps the cooperative tiles (docs/planner.md).
_PINGPONG_DGRAD_MIN_K = 64
_PINGPONG_DGRAD_MAX_K = 1024
_PINGPONG_DGRAD_MIN_N = 4096
_PINGPONG_TILE = (128, 128, 64)
# Compute-bound fwd/dgrad (K >= _PINGPONG_WIDE_MIN_K, N >= _CLUSTER_MIN_N) run a wide
# ping-pong tile where its utilization times its prior (_PINGPONG_WIDE_PRIORS, per op)
# beats the cooperative pick's: each tile's epilogue runs under the other warpgroup's K
# loop. The priors are fitted to the H200's measurements (jax 0.11.2, T 8192, bands of 8;
# docs/planner.md): 128 x 192 ran 0.7-2 % faster than the cooperative 128 x 256 at N = 6144,
# 8192 and 14336, a tie at 28672, and 2-4 % slower at N = 4096, whose last 192-wide tile is
# a third full (2026-12-04, a GEMM back to back). The fwd 128 x 160 ran 3 % faster than 128 x 192 at
# N = 14336 (median of 4 paired groups; 192 led two by under 0.3 %), 4.5 % slower at
# N = 8192, 0.9 % slower at 4096 -> 28672 and within 0.1 % at 4096 -> 6144 and
# 8192 -> 28672 (2026-12-04, the benchmark's core family), about as its score predicts. The dgrad
# 128 x 160 (a 64-byte swizzle of its N-major B tile) ran 3-4 % slower than its score
# predicts at N = 8192 and 28672, and 0.6 % faster than 128 x 192 at N = 14336 with 192
# winning two of the four groups: the rule leaves it to force().
_PINGPONG_WIDE_PRIORS = {
    "fwd": {(128, 192, 64): 1.015, (128, 160, 64): 1.01},
    "dgrad": {(128, 192, 64): 1.015},
}
_PINGPONG_WIDE_MIN_K = 4096


# --- the planner ------------------------------------------------------------------------


def _pick_cluster(
    program: str, tile, m: int, n: int, k: int, out_dtype: str, splits: int, reduction: str, schedule: str = "tiles"
):
    """(cluster, note): a (2, 1) pair where it measured faster and the library holds it."""
    if n < _CLUSTER_MIN_N or k < _CLUSTER_MIN_K or math.ceil(m / tile[0]) < 2:
        return (1, 1), ""
    code = contract.REDUCTIONS[reduction]
    if not variants.supports(program, tile, (2, 1), out_dtype, splits, code, schedule=schedule):
        return (1, 1), ""
    return (2, 1), "; CTA pairs (cluster 2x1) share the B tile by TMA multicast"


def _plan_fields(op, batch, m, n, k, out_dtype, dev, backend: str = "sm90a") -> dict:
    """The Plan fields every plan of this GEMM shares (kernel plans carry the SM count)."""
    fields = dict(op=op, backend=backend, batch=batch, m=m, n=n, k=k, out_dtype=out_dtype, device=dev.describe())
    if backend != "xla":
        fields["sm_count"] = dev.sm_count
    return fields


def _xla_plan(op, batch, m, n, k, out_dtype, dev, reason) -> Plan:
    if dev.platform == "cuda":  # a GPU user expects the kernels: say once why not
        logs.once(logging.WARNING, "jax_cake: on %s the XLA path runs instead of the kernels: %s", dev.describe(), reason)
    return Plan(**_plan_fields(op, batch, m, n, k, out_dtype, dev, backend="xla"), reason=reason)


def _wave_fill(ctas: int, sm_count: int) -> float:
    """How full the CTAs keep the SMs over their waves (1.0: every wave full)."""
    return ctas / (math.ceil(ctas / sm_count) * sm_count)


def _tile_score(tile, batch: int, m: int, n: int, sm_count: int, prior: float) -> tuple[float, str]:
    """(score, note) of a tile: edge-and-wave utilization times the tile's prior."""
    tm, tn = tile[0], tile[1]
    count = batch * math.ceil(m / tm) * math.ceil(n / tn)
    edge = (m * n * batch) / (count * tm * tn)
    score = edge * _wave_fill(count, sm_count) * prior
    return score, f"{tm}x{tn} tiles: {count} tiles over {sm_count} SMs, {edge:.0%} of the tile area used"


def ranked_tiles(
    program: str, batch: int, m: int, n: int, sm_count: int, out_dtype: str | None = None
) -> list[tuple[tuple[int, int, int], str]]:
    """Compiled tiles, best first: edge-and-wave utilization weighted by the tile prior.
    A fwd tile that streams x (its loads marked L2 evict-first, variants.streams_x) is
    left out where N needs more than one of it: each N tile would read x again, past the
    hint (14 % slower where forced on 2026-11-30; 104 us against XLA's 45 at T 16384,
    4096 -> 192 on 2026-12-05, with the M-first walk)."""
    ranked = []
    for tile in compiled_tiles(program, out_dtype):
        if program == "fwd" and n > tile[1] and variants.find_variant("fwd", tile, (1, 1), "bfloat16").streams_x:
            continue
        score, note = _tile_score(tile, batch, m, n, sm_count, _TILE_PRIOR.get(tile[:2], 0.8))
        ranked.append((score, tile, note))
    ranked.sort(key=lambda r: r[0], reverse=True)
    return [(tile, note) for _, tile, note in ranked]


def _pick_tile(
    program: str, batch: int, m: int, n: int, sm_count: int, out_dtype: str | None = None
) -> tuple[tuple[int, int, int], str]:
    return ranked_tiles(program, batch, m, n, sm_count, out_dtype)[0]


def det_splits(tiles: int, k: int, tile_k: int, sm_count: int, fill_waves: bool = False) -> int:
    """Ordered K splits, none shorter than _MIN_K_TILES_PER_SPLIT K tiles.

    Default (memory-bound GEMMs): enough splits for one CTA per SM when the tiles alone
    fill less than half the SMs, else none (extra partial sums gain nothing there,
    docs/planner.md). `fill_waves`
    (compute bound): the fewest splits whose CTAs fill their last wave to at least
    _WAVE_FILL, else the best filling count (160 tiles on 132 SMs run 2 waves at 61 %;
    3 splits make 480 CTAs in 4 waves at 91 %).
    """
    k_tiles = math.ceil(k / tile_k)
    most = max(1, min(sm_count, k_tiles // _MIN_K_TILES_PER_SPLIT))
    if not fill_waves:
        return 1 if tiles >= sm_count // 2 else min(max(1, sm_count // tiles), most)
    best, best_fill = 1, 0.0
    for splits in range(1, most + 1):
        fill = _wave_fill(tiles * splits, sm_count)
        if fill >= _WAVE_FILL:
            return splits
        if fill > best_fill + 1e-9:
            best, best_fill = splits, fill
    return best


def raster(op: str, pinned: str | None = None) -> str:
    """The tile walk (Plan.raster) of a kernel plan of op ("fwd", "dgrad", "wgrad"): the
    `pinned` one (a force block's), else bands of _RASTER_BAND_WGRAD cluster rows for
    wgrad, of _RASTER_BAND_FWD for fwd and dgrad."""
    if pinned is not None:
        return pinned
    if op == "wgrad":
        return f"m{_RASTER_BAND_WGRAD}"
    return f"m{_RASTER_BAND_FWD}"


def grouped_raster(op: str, pinned: str | None = None) -> str:
    """The grouped kernels' tile walk: the pinned one, else bands of _RASTER_BAND_GROUPED
    rows for grouped fwd / dgrad, the dense wgrad's walk for grouped wgrad."""
    if pinned is None and op in ("grouped_fwd", "grouped_dgrad"):
        return f"m{_RASTER_BAND_GROUPED}"
    return raster(op.removeprefix("grouped_"), pinned)


def _wgrad_plan(
    base: dict,
    dev: device_lib.DeviceInfo,
    deterministic: bool,
    out_dtype: str,
    tokens: int,
    d_in: int,
    d_out: int,
    pins: overrides.Pins | None,
) -> Plan:
    """The wgrad plan; `pins`: the force block's pins for this GEMM (None: the rules')."""
    batch, m, n, k = base["batch"], base["m"], base["n"], base["k"]
    forced_algorithm, forced_tile, forced_splits, forced_raster = (
        (pins.program, pins.tile, pins.splits, pins.raster) if pins is not None else (None, None, None, None)
    )

    algorithm, row = "det", None  # "det" or "split" (Plan.algorithm)
    if forced_algorithm is not None:
        why = "forced by jax_cake.planner.force"
        algorithm = forced_algorithm
    elif deterministic:
        why = "deterministic=True"
    else:
        v = tables.verdict(dev.arch, dev.sm_count, d_in, d_out, out_dtype, tokens, batch=batch)
        algorithm, row = v.program, v.row
        why = (
            v.why
            if algorithm == "split"
            else f"deterministic=False, but the plan table chose the deterministic program: {v.why}"
        )

    # A forced or table tile first, then the heuristic's ranking; the first tile whose
    # program (split count, reduction) the library holds wins.
    wanted = forced_tile or (row.tile if row is not None and row.tile is not None and None not in row.tile else None)
    # 64-row tiles have one consumer warpgroup (half the MMA issue rate of 128 rows): only
    # where the GEMM is bound by reading its operands; compute-bound they lose to 128-row
    # tiles with splits (docs/planner.md).
    memory_bound = m * n / (m + n) < RIDGE_FLOP_PER_BYTE
    candidates = [
        c for c in ranked_tiles("wgrad", batch, m, n, dev.sm_count, out_dtype) if memory_bound or c[0][0] > 64
    ]
    if wanted is not None and tuple(wanted) in compiled_tiles("wgrad"):
        candidates.insert(0, (tuple(wanted), f"{wanted[0]}x{wanted[1]} tiles as requested"))
    if algorithm == "det" and forced_tile is None and forced_splits is None and not memory_bound:
        tail = _split_tail_plan(base, dev, out_dtype, why, forced_raster)
        if tail is not None:
            return tail
    for tile, tile_note in candidates:
        tiles = batch * math.ceil(m / tile[0]) * math.ceil(n / tile[1])
        k_tiles = math.ceil(k / tile[2])
        if algorithm == "split":
            splits = forced_splits or (row.splits if row is not None and row.splits else None)
            if splits is None:
                splits = max(1, min(math.ceil(dev.sm_count / tiles), k_tiles))
            splits = min(splits, k_tiles)
            reduction = "arrival" if splits > 1 else "none"
            reason = f"split-K program (arrival-order reduction, not bitwise reproducible): {why}; {tile_note}"
        else:
            if forced_algorithm == "det" and forced_splits:
                splits = min(forced_splits, k_tiles)
            else:
                splits = det_splits(tiles, k, tile[2], dev.sm_count, fill_waves=not memory_bound)
            reduction = "ordered" if splits > 1 else "none"
            how = f"{splits} K splits summed in fixed split order by a second pass" if splits > 1 else "one pass over K"
            reason = f"deterministic program ({why}): {how}; {tile_note}"
        if not _wgrad_supported(tile, out_dtype, splits, reduction):
            continue
        cluster, cluster_note = _pick_cluster("wgrad", tile, m, n, k, out_dtype, splits, reduction)
        return Plan(
            **base,
            algorithm="split" if algorithm == "split" else "det",
            tile=tile,
            cluster=cluster,
            splits=splits,
            reduction=reduction,
            raster=raster("wgrad", forced_raster),
            workspace_bytes=variants.workspace_bytes(splits, contract.REDUCTIONS[reduction], batch, m, n, out_dtype),
            reason=reason + cluster_note,
        )
    return _xla_plan(
        "wgrad", batch, m, n, k, out_dtype, dev, f"no compiled wgrad variant runs the {algorithm} program here"
    )


def tail_splits(tiles: int, sm_count: int, k_tiles: int) -> tuple[int, float]:
    """(splits, tail cost in tile times) for the split tail: the tiles of the last partial
    wave cut into the splits (2.._MAX_TAIL_SPLITS, pieces of >= _MIN_K_TILES_PER_SPLIT K
    tiles) that finish the tail soonest; (1, 1.0) where no cut beats the whole tiles, (1,
    0.0) where there is no tail."""
    rem = tiles % sm_count
    if rem == 0:
        return 1, 0.0
    best, best_cost = 1, 1.0
    for splits in range(2, min(_MAX_TAIL_SPLITS, k_tiles // _MIN_K_TILES_PER_SPLIT) + 1):
        cost = math.ceil(rem * splits / sm_count) / splits
        if cost < best_cost - 1e-9:
            best, best_cost = splits, cost
    return best, best_cost


def _split_tail_plan(
    base: dict, dev: device_lib.DeviceInfo, out_dtype: str, why: str, forced_raster: str | None
) -> Plan | None:
    """A compute-bound wgrad on the largest split-tail tile, where that tile makes at
    least one whole wave and its last wave is under _WAVE_FILL full: whole waves as
    usual, the tail's tiles cut into K pieces. None where a plain pass fills its waves,
    no cut helps, there is no whole wave, the library holds no split-tail variant, or
    (fp32 dw, whose pieces each keep one wgmma chain) a piece would be longer than
    variants.OUTPUT_PROMOTE_EVERY K tiles.

    The cut costs more than its share of the K loop predicts, so it wins only against a
    whole extra wave; with no whole wave, smaller tiles do better (docs/planner.md)."""
    batch, m, n, k = base["batch"], base["m"], base["n"], base["k"]
    variant = max(
        (
            v
            for v in variants.VARIANTS
            if v.program == "wgrad" and v.schedule == "split_tail" and v.out_dtype == out_dtype
        ),
        key=lambda v: v.tile_m * v.tile_n,
        default=None,
    )
    if variant is None:
        return None
    tile = variant.tile
    tiles = batch * math.ceil(m / tile[0]) * math.ceil(n / tile[1])
    fill = _wave_fill(tiles, dev.sm_count)
    k_tiles = math.ceil(k / tile[2])
    splits, cost = tail_splits(tiles, dev.sm_count, k_tiles)
    if tiles < dev.sm_count or fill >= _WAVE_FILL or splits == 1:
        return None
    if variant.promote_in == "output" and math.ceil(k_tiles / splits) > variants.OUTPUT_PROMOTE_EVERY:
        # Its pieces accumulate in one wgmma chain each: no longer than the fp32 accuracy allows.
        return None
    code = contract.REDUCTIONS["split_tail"]
    rem = tiles % dev.sm_count
    return Plan(
        **base,
        algorithm="det",
        tile=tile,
        splits=splits,
        reduction="split_tail",
        raster=raster("wgrad", forced_raster),
        schedule="split_tail",
        workspace_bytes=variants.workspace_bytes(
            splits, code, batch, m, n, out_dtype, tile=tile, sm_count=dev.sm_count
        ),
        reason=f"deterministic program ({why}): {tile[0]}x{tile[1]} tiles, {tiles // dev.sm_count} whole waves, then "
        f"the last {rem} tiles (a wave {fill:.0%} full) cut into {splits} K pieces each, summed in piece order in "
        f"the kernel (the tail takes {cost:.2f} of a tile's time)",
    )


def _router_plan(op, batch, m, n, k, dev, d_in, d_out) -> Plan:
    """The fused BF16x3 router kernels: one program each, always reproducible."""
    args = (op, batch, m, n, k, "float32", dev)
    if batch != 1:
        return _xla_plan(*args, "the router takes one [T, d] block")
    align = router_variants.ALIGN_ELEMENTS
    if d_in % align or d_out % align:
        return _xla_plan(
            *args,
            f"d={d_in} and E={d_out} must be multiples of {align} for the router kernels' "
            "16-byte TMA strides: XLA runs the BF16x3 split with FP32 accumulation",
        )
    if d_out <= ROUTER_XLA_MAX_EXPERTS:
        return _xla_plan(
            *args,
            f"E={d_out} experts (at most {ROUTER_XLA_MAX_EXPERTS}): XLA's BF16x3 dot (BF16_BF16_F32_X3) is "
            "faster than the fused kernels on so few columns",
        )
    if not ROUTER_KERNELS_ENABLED:
        return _xla_plan(
            *args,
            "the fused BF16x3 router kernels are held back (ROUTER_KERNELS_ENABLED): "
            "XLA runs the BF16x3 split with FP32 accumulation",
        )
    if not compiled_tiles(op):
        return _xla_plan(
            *args, "no fused BF16x3 router kernel in this build: XLA runs the BF16x3 split with FP32 accumulation"
        )
    tile, tile_note = _pick_tile(op, 1, m, n, dev.sm_count)
    base = dict(**_plan_fields(op, 1, m, n, k, "float32", dev), tile=tile)
    how = "fused BF16x3 (hi*hi + hi*lo + lo*hi, FP32 accumulation)"
    if op != "router_wgrad":
        return Plan(**base, reason=f"{how}, one pass over K={k}: {tile_note}")
    tiles = math.ceil(m / tile[0]) * math.ceil(n / tile[1])
    splits = det_splits(tiles, k, tile[2], dev.sm_count)
    reduction = "ordered" if splits > 1 else "none"
    workspace = router_variants.workspace_bytes(splits, contract.REDUCTIONS[reduction], m, n)
    split_note = f"{splits} K splits summed in fixed split order" if splits > 1 else "one pass over K"
    return Plan(
        **base,
        algorithm="det",
        splits=splits,
        reduction=reduction,
        workspace_bytes=workspace,
        reason=f"{how}, deterministic program (the router has no split-K program): {split_note}; {tile_note}",
    )


def plan(
    op: str,
    *,
    tokens: int,
    d_in: int,
    d_out: int,
    batch: int = 1,
    out_dtype: Any = "bfloat16",
    deterministic: bool = True,
    device: Any = None,
    tile_rows: bool = True,
    groups: Any = None,
) -> Plan:
    """The Plan a jax_cake GEMM would run for these static sizes on `device`.

    op: "fwd" (y = x w^T), "dgrad" (dx = dy w), "wgrad" (dw = dy^T x), or the router's
    "router_fwd" / "router_dgrad" / "router_wgrad", or the grouped (ragged, MoE) GEMMs
    "grouped_fwd" / "grouped_dgrad" / "grouped_wgrad" (jax_cake.planner.grouped). tokens,
    d_in, d_out, batch: the projection's sizes (x [batch, tokens, d_in], w [batch, d_out,
    d_in]). groups: the grouped ops' G (w [G, d_out, d_in], x [tokens, d_in] in G groups
    of rows; batch stays 1), and only theirs. out_dtype: the result dtype (wgrad and
    grouped_wgrad: w's dtype). device: a jax Device, AbstractDevice or
    DeviceInfo; None looks it up as a trace would (abstract mesh, else jax.devices()[0]).
    tile_rows: whether the plan table's fwd/dgrad tile rows apply; the fused planners
    (jax_cake.planner.gated, .residual) pass False: those rows timed the plain GEMM's
    kernels, not the fused ones. Inside a `jax_cake.planner.force` block its pins apply.
    """
    return plan_with(
        overrides.active(),
        op,
        tokens=tokens,
        d_in=d_in,
        d_out=d_out,
        batch=batch,
        out_dtype=out_dtype,
        deterministic=deterministic,
        device=device,
        tile_rows=tile_rows,
        groups=groups,
    )


def plan_with(
    block: overrides.Pins | None,
    op: str,
    *,
    tokens: int,
    d_in: int,
    d_out: int,
    batch: int = 1,
    out_dtype: Any = "bfloat16",
    deterministic: bool = True,
    device: Any = None,
    tile_rows: bool = True,
    groups: Any = None,
) -> Plan:
    """plan() under `block`, the pins of a force block as read once where planning starts
    (overrides.active(); None: no block). The fused planners (accumulate.py, gated.py,
    residual.py) read the block once and plan their base GEMM under it."""
    import numpy as np
    from jax import export

    if op not in OPS + GROUPED_OPS:
        raise ValueError(f"plan: op must be one of {OPS + GROUPED_OPS}, got {op!r}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"plan: deterministic must be a bool, got {type(deterministic).__name__}")
    sizes = {"tokens": tokens, "d_in": d_in, "d_out": d_out, "batch": batch}
    if op in GROUPED_OPS:
        if groups is None:
            raise TypeError(f"plan: {op} needs groups= (G, the number of groups), got None")
        sizes["groups"] = groups
    elif groups is not None:
        raise ValueError(f"plan: groups applies to the grouped ops {GROUPED_OPS} only, got groups={groups!r} for {op}")
    symbolic = [name for name, size in sizes.items() if export.is_symbolic_dim(size)]
    for name, size in sizes.items():
        if name in symbolic:  # a shape-polymorphic export's dimension: planned below
            continue
        if not overrides.is_int(size):
            raise TypeError(f"plan: {name} must be an int, got {type(size).__name__}")
        if size < 0:
            raise ValueError(f"plan: {name} must be >= 0, got {size}")
        sizes[name] = int(size)
    tokens, d_in, d_out, batch = sizes["tokens"], sizes["d_in"], sizes["d_out"], sizes["batch"]
    if op in GROUPED_OPS and batch != 1:
        raise ValueError(f"plan: batch of {op} must be 1 (its groups are groups=), got {batch}")
    try:
        if out_dtype is None:  # np.dtype(None) is float64
            raise TypeError
        out_dtype = np.dtype(out_dtype).name
    except TypeError:
        raise TypeError(f"plan: out_dtype must be a dtype, got {out_dtype!r}") from None
    # fwd and dgrad write x's dtype; wgrad w's (a bf16 weight or an FP32 master); the
    # router computes in FP32 whatever out_dtype says.
    allowed = ("bfloat16",) if op in ("fwd", "dgrad", "grouped_fwd", "grouped_dgrad") else ("bfloat16", "float32")
    if out_dtype not in allowed:
        raise ValueError(f"plan: out_dtype of {op} must be {' or '.join(allowed)}, got {out_dtype}")
    dev = device_lib.current() if device is None else device_lib.from_jax_device(device)
    if op in GROUPED_OPS:
        pins = overrides.for_gemm(block, op, *grouped.gemm_dims(op, tokens, d_in, d_out))
        return grouped.plan_grouped(
            op,
            tokens=tokens,
            groups=sizes["groups"],
            d_in=d_in,
            d_out=d_out,
            out_dtype=out_dtype,
            dev=dev,
            symbolic=tuple(symbolic),
            program_pin=None if pins is None else pins.program,
            raster=grouped_raster(op, None if pins is None else pins.raster),
            tile_pin=None if pins is None else pins.tile,
        )

    if op in ("fwd", "router_fwd"):
        m, n, k = tokens, d_out, d_in
    elif op in ("dgrad", "router_dgrad"):
        m, n, k = tokens, d_in, d_out
    else:
        m, n, k = d_out, d_in, tokens
    args = (op, batch, m, n, k, out_dtype, dev)

    pins = overrides.for_gemm(block, op, m, n, k)  # None: the planner's own plan
    if pins is not None and pins.program == "xla":
        return _xla_plan(*args, "forced by jax_cake.planner.force")
    if os.environ.get("JAX_CAKE_DISABLE", "") not in ("", "0"):  # read at trace time: debugging, bisecting
        return _xla_plan(*args, "JAX_CAKE_DISABLE is set: XLA dot_general with the same semantics")
    if symbolic:
        return _xla_plan(
            *args,
            f"symbolic {', '.join(symbolic)} (a shape-polymorphic export): the kernels are planned for static sizes",
        )
    if dev.platform != "cuda":
        return _xla_plan(*args, f"no CUDA GPU ({dev.describe()}): XLA dot_general with the same semantics")
    if dev.arch not in contract.KERNEL_ARCHS:  # no kernels compiled for it: the XLA path
        reason = (
            f"no jax_cake kernels are built for {dev.arch} ({dev.kind}); kernels exist for "
            f"{', '.join(contract.KERNEL_ARCHS)}: "
            "XLA dot_general with the same semantics"
        )
        if op == "wgrad" and not deterministic and dev.sm_count is not None and tables.load(dev.arch) is not None:
            v = tables.verdict(dev.arch, dev.sm_count, d_in, d_out, out_dtype, tokens, batch=batch)
            reason += f". The {dev.arch} plan table's verdict for deterministic=False here: {v.program} ({v.why})"
        return _xla_plan(*args, reason)
    if min(batch, tokens, d_in, d_out) == 0:
        return _xla_plan(*args, "an empty dimension: nothing to compute on the GPU")
    unknown_sms = f"the SM count of {dev.kind} is unknown"
    if op.startswith("router_"):
        if dev.sm_count is None:
            return _xla_plan(*args, unknown_sms)
        return _router_plan(op, batch, m, n, k, dev, d_in, d_out)
    if d_in % variants.ALIGN_ELEMENTS or d_out % variants.ALIGN_ELEMENTS:
        return _xla_plan(
            *args,
            f"d_in={d_in} and d_out={d_out} must be multiples of {variants.ALIGN_ELEMENTS} for the kernels' 16-byte TMA strides: XLA dot_general with the same semantics",
        )
    if dev.sm_count is None:
        return _xla_plan(*args, unknown_sms)

    verdict = tables.verdict(
        dev.arch, dev.sm_count, d_in, d_out, out_dtype, tokens, op=op, batch=batch, deterministic=deterministic
    )
    # A forced program (the benchmark's arms) times the kernels: no xla row replaces them.
    if verdict.program == "xla" and pins is None:  # measured, not a fallback: no warning
        reason = f"{verdict.why}: XLA dot_general with the same semantics"
        return Plan(**_plan_fields(*args, backend="xla"), reason=reason)

    base = _plan_fields(*args)
    if op == "wgrad":
        return _wgrad_plan(base, dev, bool(deterministic), out_dtype, tokens, d_in, d_out, pins)
    return _fwd_dgrad_plan(base, dev, verdict if tile_rows else None, pins)


def _fwd_dgrad_plan(
    base: dict, dev: device_lib.DeviceInfo, verdict: tables.Verdict | None, pins: overrides.Pins | None
) -> Plan:
    """The fwd/dgrad plan: one pass over K. verdict: the plan table's at this point, whose
    tile row (if any) wins over the rules (None: tile rows do not apply); `pins`: the force
    block's pins for this GEMM (None: the rules'), which win over both."""
    op, batch, m, n, k = base["op"], base["batch"], base["m"], base["n"], base["k"]
    forced_tile, forced_schedule, forced_cluster, forced_raster = (
        (pins.tile, pins.schedule, pins.cluster, pins.raster) if pins is not None else (None, None, None, None)
    )
    tile, tile_note = _pick_tile(op, batch, m, n, dev.sm_count, "bfloat16")
    if forced_schedule == "tiles" and forced_tile is not None and tuple(forced_tile) in compiled_tiles(op):
        # A forced tile pins fwd/dgrad only together with a forced schedule (alone it is
        # the wgrad tile); the ping-pong tile follows in _pingpong_tile.
        tile, tile_note = tuple(forced_tile), f"{forced_tile[0]}x{forced_tile[1]} tiles (forced)"
    walk = raster(op, forced_raster)
    schedule = "tiles"
    pingpong = pingpong_rule(op, n, k, _pingpong_tile(op, forced_tile, forced_schedule), forced_schedule)
    if not pingpong.chosen and forced_schedule is None:
        pingpong = _wide_pingpong_rule(op, batch, m, n, k, dev.sm_count, tile, forced_cluster)
    one_pass = contract.REDUCTION_NONE
    if pingpong.chosen and pingpong_clusters(op, pingpong.tile):
        tile, schedule, tile_note = pingpong.tile, "pingpong", pingpong.why
    cluster, cluster_note = _pick_cluster(op, tile, m, n, k, "bfloat16", 1, "none", schedule)
    if forced_cluster and variants.supports(op, tile, forced_cluster, "bfloat16", 1, one_pass, schedule=schedule):
        cluster, cluster_note = forced_cluster, f"; cluster {forced_cluster[0]}x{forced_cluster[1]} (forced)"
    if not variants.supports(op, tile, cluster, "bfloat16", 1, one_pass, schedule=schedule):
        # A forced ping-pong tile compiled only in CTA pairs (fwd 128 x 160, 176 and 208).
        cluster = pingpong_clusters(op, tile)[0]
        cluster_note = f"; cluster {cluster[0]}x{cluster[1]} (the only one compiled for this tile)"
    note = tile_note + cluster_note
    pinned = any(pin is not None for pin in (forced_tile, forced_schedule, forced_cluster))
    if verdict is not None and verdict.variant is not None and not pinned:
        tile, schedule, cluster, note = _table_variant(op, verdict, (tile, schedule, cluster), note)
    return Plan(
        **base,
        tile=tile,
        cluster=cluster,
        raster=walk,
        schedule=schedule,
        reason=f"one pass over K={k} (no reduction across CTAs, reproducible), {contract.describe_raster(walk)}: {note}",
    )


def _describe_variant(tile, schedule: str, cluster) -> str:
    kind = "ping-pong" if schedule == "pingpong" else "cooperative"
    return f"{tile[0]}x{tile[1]} {kind} tiles, cluster {cluster[0]}x{cluster[1]}"


def _table_variant(op: str, verdict: tables.Verdict, rule: tuple, rule_note: str) -> tuple:
    """(tile, schedule, cluster, note) of a fwd/dgrad plan where a tile row speaks: the
    row's variant, measured fastest at this point (the rule's tile score cannot tell the
    wide ping-pong tiles apart), or the rule's pick `rule` where this build lacks it."""
    row, where = verdict.variant, verdict.where
    tile, schedule, cluster = tuple(row.tile), row.schedule, tuple(row.cluster)
    named = _describe_variant(tile, schedule, cluster)
    if not variants.supports(op, tile, cluster, "bfloat16", 1, contract.REDUCTION_NONE, schedule=schedule):
        return (*rule, f"{rule_note}; {where} names the {named}, which this build does not hold: the rule's pick runs")
    measured = f"{row.ratio:.3f}x the rule's {_describe_variant(*rule)}; " if row.ratio is not None else ""
    return tile, schedule, cluster, f"{named}: {where} measured this variant fastest here ({measured}{row.source})"


class PingPong(NamedTuple):
    """A ping-pong rule's verdict for a fwd/dgrad GEMM: whether it runs the ping-pong
    schedule (else the cooperative tiles), on which tile, and why (for Plan.reason)."""

    chosen: bool
    tile: tuple = ()
    why: str = ""


_COOPERATIVE = PingPong(False)


def _wide_pingpong_rule(op: str, batch: int, m: int, n: int, k: int, sm_count: int, tile, forced_cluster) -> PingPong:
    """The wide ping-pong tile a compute-bound fwd/dgrad runs instead of the cooperative
    `tile`: the best of op's _PINGPONG_WIDE_PRIORS compiled for op (in `forced_cluster`, a
    force block's, if one is), by utilization times prior, where it beats the cooperative
    pick's; not chosen where none does."""
    if k < _PINGPONG_WIDE_MIN_K or n < _CLUSTER_MIN_N:
        return _COOPERATIVE
    best, best_score, best_note = (), _tile_score(tile, batch, m, n, sm_count, _TILE_PRIOR.get(tile[:2], 0.8))[0], ""
    for wide, prior in _PINGPONG_WIDE_PRIORS.get(op, {}).items():
        clusters = pingpong_clusters(op, wide)
        if not clusters or (forced_cluster is not None and tuple(forced_cluster) not in clusters):
            continue
        score, note = _tile_score(wide, batch, m, n, sm_count, prior)
        if score > best_score:
            best, best_score, best_note = wide, score, note
    if not best:
        return _COOPERATIVE
    return PingPong(
        True, best, f"{best_note}, ping-pong (K={k}: each tile's epilogue runs under the other warpgroup's MMAs)"
    )


def is_wide_tile(tile) -> bool:
    """Whether tile is one the planner gives compute-bound fwd/dgrad shapes: a wide
    ping-pong tile (_PINGPONG_WIDE_PRIORS) or the cooperative 128 x 256."""
    return any(tuple(tile) in priors for priors in _PINGPONG_WIDE_PRIORS.values()) or tuple(tile[:2]) == (128, 256)


def pingpong_clusters(op: str, tile) -> list[tuple[int, int]]:
    """The CTA clusters the library holds a ping-pong variant of this fwd/dgrad tile in."""
    return [
        c
        for c in ((1, 1), (2, 1))
        if variants.supports(op, tuple(tile), c, "bfloat16", 1, contract.REDUCTION_NONE, schedule="pingpong")
    ]


def _pingpong_tile(op: str, forced_tile, forced_schedule: str | None) -> tuple[int, int, int]:
    """The ping-pong tile: _PINGPONG_TILE, or under force(tile=..., schedule="pingpong") the
    forced tile where the library holds a ping-pong variant of it for this op (the wide
    tiles' own rule is _wide_pingpong_rule)."""
    pinned = forced_schedule == "pingpong" and forced_tile is not None and op in ("fwd", "dgrad")
    if pinned and pingpong_clusters(op, forced_tile):
        return tuple(forced_tile)
    return _PINGPONG_TILE


def pingpong_rule(op: str, n: int, k: int, tile=_PINGPONG_TILE, forced_schedule: str | None = None) -> PingPong:
    """Whether fwd/dgrad run the ping-pong `tile` here, and why: forced_schedule (a force
    block's schedule pin) where one is, else the short-K dgrad rule (the wide tiles' own
    rule is _wide_pingpong_rule)."""
    if forced_schedule:
        if forced_schedule != "pingpong":
            return _COOPERATIVE
        return PingPong(True, tuple(tile), f"{tile[0]}x{tile[1]} ping-pong tiles (forced)")
    if op == "dgrad" and _PINGPONG_DGRAD_MIN_K <= k <= _PINGPONG_DGRAD_MAX_K and n >= _PINGPONG_DGRAD_MIN_N:
        return PingPong(
            True,
            tuple(tile),
            f"128x128 ping-pong tiles ({_PINGPONG_DGRAD_MIN_K} <= K={k} <= {_PINGPONG_DGRAD_MAX_K}: one warpgroup's "
            "epilogue runs under the other's MMAs)",
        )
    return _COOPERATIVE
