"""The list of AOT-compiled kernel variants: plain data, no cutlass import.

`jax_cake/build.py` compiles exactly these; the planner (`jax_cake/planner`) imports
this module at run time to know which (program, tile, cluster, out dtype) the native
library can run. A Plan naming anything else is rejected by the FFI handler with
INVALID_ARGUMENT, so the two sides can only disagree loudly.

GEMM convention (see docs/ffi_contract.md): C[M, N] = sum_k A[m, k] B[n, k], batch L.
  fwd:   A = x  [L, T, d_in]  K-major,  B = w [L, d_out, d_in] K-major,  C = y  bf16
  dgrad: A = dy [L, T, d_out] K-major,  B = w viewed [N=d_in, K=d_out]  N-major, C = dx bf16
  wgrad: A = dy viewed [M=d_out, K=T] M-major, B = x viewed [N=d_in, K=T] N-major,
         C = dw fp32 or bf16 (split-K partials are always fp32)

Grouped variants (`grouping`: the MoE experts' grouped GEMMs, on rows laid out so that each
group starts at a multiple of contract.GROUP_ROW_ALIGN rows, jax_cake/primitives/grouped.py):
  "rows" (fwd, dgrad): A and C are one batch of padded rows, B's batches are the G
         weights; M tile t multiplies by weight table[t], and table[max tiles] (after the
         tile entries) is the number of M tiles that hold rows, the only ones walked;
  "k" (wgrad): A and B are one batch of padded rows along K, C's batches are the G weight
         gradients; batch g sums the K tiles [table[g], table[g + 1]) in order (none: 0).
The table is the variant's table tensor (int32). The "rows" forward also comes with the
gated epilogue (store "gated_silu" / "gated_gelu", h as the second tensor).
"""

from __future__ import annotations

import dataclasses

from jax_cake.contract import (  # the `reduction` codes (docs/ffi_contract.md)
    REDUCTION_ARRIVAL,
    REDUCTION_NONE,
    REDUCTION_ORDERED,
    REDUCTION_SPLIT_TAIL,
)

# Operand majorness per program: (A major, B major). "k" = K contiguous.
PROGRAM_MAJORS = {
    "fwd": ("k", "k"),
    "dgrad": ("k", "n"),
    "wgrad": ("m", "n"),
}


# TMA needs 16-byte strides: a bf16 operand's rows (d_in, d_out) must hold a multiple of
# this many elements, for the dense and the grouped variants alike.
ALIGN_ELEMENTS = 8

# fp32 wgrad with its running total in C (`promote_in="output"`) adds a chain into C every
# this many K tiles. Each promotion is a whole fp32 tile epilogue (~4.5 us of CTA time at
# 128 x 256), so the chains are as long as the 1e-5 accuracy target allows: one wgmma chain
# gains ~7e-8 relative error per K tile (64 tiles measured 4.4e-6 at T = 16384, H200,
# 2026-11-30), so 96 tiles stay near 6.6e-6 at any T.
OUTPUT_PROMOTE_EVERY = 96


@dataclasses.dataclass(frozen=True)
class GemmVariant:
    """One compiled GEMM kernel: program, CTA tile, cluster and output dtype.

    A variant serves every M/N/K/L (all dynamic). `out_dtype` is "bfloat16" or
    "float32". wgrad split-K (reduction=1) runs the float32 variant of the same tile
    into the workspace and then the ordered reduce pass into dw.
    """

    program: str
    tile_m: int
    tile_n: int
    tile_k: int = 64
    cluster_m: int = 1
    cluster_n: int = 1
    out_dtype: str = "bfloat16"
    # "plain": TMA store of the tile into batch (split * L + l) of C.
    # "add": TMA reduce-add of the tile into batch l of C. wgrad (fp32): every split adds
    # into the same tile in arrival order (reduction=2, not bitwise reproducible). fwd
    # (bf16): the residual add, C = bf16(r + bf16(acc)) with C holding r on entry
    # (jax_cake_fwd_residual; one pass over K, one add per element).
    # "gated_silu" / "gated_gelu" (fwd, bf16, tile_n a multiple of 64): the gated epilogue
    # of jax_cake_fwd_gated. B holds gate and up rows interleaved in blocks of contract.GATE_BLOCK,
    # so each 32-column sub-tile of C is 16 gate columns then their 16 up columns; C gets
    # the pre-activation (bf16 of the accumulator) and the second output H [M, N / 2]
    # gets h = bf16(act(g) * u) in FP32 from the bf16 g, u (gemm_sm90's docstring).
    # "gate_grad_silu" (dgrad, bf16): the activation's gradient in the epilogue of the down
    # projection's dgrad (jax_cake_dgrad_gated). The accumulator is dh [M, F]; the second
    # tensor is the saved pre-activation gu [M, 2F] (TMA-loaded into the epilogue buffers
    # ahead of the math), and C [2, M, F] gets dg = bf16(dh * u * act'(g)) in plane 0 and
    # du = bf16(dh * act(g)) in plane 1 (wide ping-pong tiles only).
    # "gate_up_halves" (dgrad, bf16): a plain store; K runs over two operand pairs, the
    # cotangent's gate half dg [M, F] (A) with the gate rows of the interleaved weight
    # [2F, N] (B), then the up half du (the second tensor) with its up rows
    # (jax_cake_dgrad_gate_up: dx of the gated projection with no interleaved copy of its
    # cotangent).
    store: str = "plain"
    # "tiles": each CTA walks whole tiles (or splits of them). "split_tail": whole waves of
    # tiles, then the last partial wave's tiles cut into `splits` K pieces that the kernel
    # sums in piece order (reduction=3, bitwise reproducible). "pingpong" (fwd/dgrad): the
    # two consumer warpgroups take whole tiles in turns. See gemm_sm90's docstring.
    schedule: str = "tiles"
    # Where fp32 wgrad keeps its two-level running total (`promote`): "registers" (a second
    # accumulator, so tile_n <= 160) or "output" (every OUTPUT_PROMOTE_EVERY K tiles the
    # chain goes into C itself, the first by TMA store, later ones by TMA reduce-add: frees
    # the registers for a 128 x 256 tile). See gemm_sm90's docstring.
    promote_in: str = "registers"
    # None (dense), "rows" or "k": a grouped variant (the module docstring).
    grouping: str | None = None

    @property
    def table_program(self) -> str:
        """The program's name in the generated variant table and the FFI's lookup:
        "grouped_<program>" for a grouped variant."""
        return f"grouped_{self.program}" if self.grouping else self.program

    @property
    def activation(self) -> str | None:
        """The gated epilogue's activation ("silu", "gelu"), None for the other stores."""
        return self.store.removeprefix("gated_") if self.store.startswith("gated_") else None

    @property
    def gate_grad(self) -> str | None:
        """The activation of the gradient epilogue ("silu"), None for the other stores."""
        return self.store.removeprefix("gate_grad_") if self.store.startswith("gate_grad_") else None

    @property
    def a_major(self) -> str:
        return PROGRAM_MAJORS[self.program][0]

    @property
    def b_major(self) -> str:
        return PROGRAM_MAJORS[self.program][1]

    @property
    def promote(self) -> bool:
        """Two-level fp32 accumulation (fp32 wgrad only): wgmma chains of 16 K tiles added to a
        register total (gemm_sm90._PROMOTE_EVERY), or with promote_in="output" chains of
        OUTPUT_PROMOTE_EVERY K tiles added into C."""
        return self.program == "wgrad" and self.out_dtype == "float32"

    @property
    def streams_x(self) -> bool:
        """The skinny variants (fwd 128 x 64, 64-row wgrad): when d_out fits one tile, x
        (fwd: A, wgrad: B) feeds one CTA tile per x tile and its TMA loads carry an L2
        evict-first hint (gemm_sm90's docstring). Elsewhere the hint measured slower."""
        return (self.program == "fwd" and self.tile_n == 64) or (self.program == "wgrad" and self.tile_m == 64)

    @property
    def tile(self) -> tuple[int, int, int]:
        return (self.tile_m, self.tile_n, self.tile_k)

    @property
    def cluster(self) -> tuple[int, int]:
        return (self.cluster_m, self.cluster_n)

    @property
    def name(self) -> str:
        """Unique C identifier, also the exported object's file name."""
        dt = {"bfloat16": "bf16", "float32": "f32"}[self.out_dtype]
        suffix = (
            ("" if self.store == "plain" else f"_{self.store}")
            + {
                "tiles": "",
                "split_tail": "_st",
                "pingpong": "_pp",
            }[self.schedule]
            + ("_po" if self.promote_in == "output" else "")
            + ("_grouped" if self.grouping else "")
        )
        return (
            f"jax_cake_{self.program}_{self.tile_m}x{self.tile_n}x{self.tile_k}"
            f"_c{self.cluster_m}x{self.cluster_n}_{dt}{suffix}"
        )


# Keep this list short: each entry costs a few seconds of AOT compile in CI.
VARIANTS: tuple[GemmVariant, ...] = (
    # forward: big d_out (>= 512) and skinny d_out (<= 256)
    GemmVariant("fwd", 128, 256),
    GemmVariant("fwd", 128, 128),
    GemmVariant("fwd", 128, 64),
    # dgrad: N = d_in is large; K = d_out may be as small as 32 (TMA zero-fills)
    GemmVariant("dgrad", 128, 256),
    GemmVariant("dgrad", 128, 128),
    # Ping-pong: the two consumer warpgroups alternate whole 128 x 128 tiles, so a short
    # K loop's epilogue hides behind the other tile's MMAs (dgrad at d_out = 512).
    GemmVariant("fwd", 128, 128, schedule="pingpong"),
    GemmVariant("dgrad", 128, 128, schedule="pingpong"),
    GemmVariant("dgrad", 128, 128, cluster_m=2, schedule="pingpong"),
    # Wider ping-pong tiles for the compute-bound Llama shapes (T = 8192, 4096 <-> 14336),
    # where cuBLAS's best are ping-pong 176 x 128 / 128 x 160 tiles: one warpgroup holds a
    # whole 128 x 192 (or 160) fp32 tile, 192 registers per thread of the 232 a consumer
    # gets, and the two warpgroups share one ring of epilogue buffers (gemm_sm90's
    # docstring). The planner's wide ping-pong rule (planner/choose.py) picks the c2x1 ones
    # for compute-bound shapes; force(..., tile=(128, 192, 64), schedule="pingpong",
    # cluster=...) or bench's det/t128x192x64/pp/c2 arm pins one.
    # Compiled for sm_90a here (2026-12-02, nvidia-cutlass-dsl 4.8.1; PTX kept with
    # CUTE_DSL_KEEP=ptx, then `ptxas -v -arch=sm_90a -O3` of CUDA 13.0 with the PTX
    # .version lowered to 9.0): 0 bytes stack frame, 0 spill stores / loads each,
    # setmaxnreg 40 / 232 (the 168-register launch limit of 384 threads before it). Headroom,
    # same method with the consumers' setmaxnreg lowered: fwd and dgrad 128 x 192 c2x1 still
    # compile without spills at 224, and spill ~2 KB at 216. Shared memory: 128 x 192 has 5 A/B stages (40 KiB each) and 3
    # epilogue buffers (8 KiB), 224 KiB + barriers; 128 x 160 has 5 stages (36 KiB) and 5
    # buffers, 220 KiB + barriers. The dgrad 128 x 160 c2x1 (the tile of cuBLAS's kernel for
    # the Llama-3-8B down projection's dgrad; its N-major B tile gets a 64-byte swizzle, 160
    # not being a multiple of 64 columns) compiles the same way with no spills; it is for
    # force() and the benchmarks: on the H200 it ran 3-4 % slower than its tile score
    # predicts at N = 8192 and 28672, so the planner does not pick it (planner/choose.py).
    GemmVariant("fwd", 128, 192, schedule="pingpong"),
    GemmVariant("fwd", 128, 192, cluster_m=2, schedule="pingpong"),
    GemmVariant("fwd", 128, 160, cluster_m=2, schedule="pingpong"),
    # 128 x 176 (epilogue sub-tiles of 16 columns, 176 being no multiple of 32) fills the
    # last wave at the fused QKV 4096 -> 6144 (T 8192: 2240 tiles, 16.97 waves of 132,
    # against 15.5 for 128 x 192). Exported SASS: 168 registers at launch, no stack or
    # local memory. 128 x 208: the widest ping-pong tile that fits in registers (208
    # accumulator registers per thread under the wide 24 / 240 split; no stack; 5 A/B
    # stages, 3 epilogue buffers of 16 columns), the fewest operand bytes per FLOP of the
    # ping-pong tiles. On the H200 (the benchmark's core family, 2026-12-05; docs/benchmarks.md) 176 was the
    # best forward at 4096 -> 6144 (1.5 %) and 8192 -> 28672, 208 at 4096 -> 28672 (1.3 %
    # past the planner's 128 x 192), each slower elsewhere; the wide rule's tile score
    # cannot tell these apart, so the planner runs them only where a plan-table tile row
    # names them (planner/tables.py), and force() and bench pin them.
    GemmVariant("fwd", 128, 176, cluster_m=2, schedule="pingpong"),
    GemmVariant("fwd", 128, 208, cluster_m=2, schedule="pingpong"),
    GemmVariant("dgrad", 128, 192, schedule="pingpong"),
    GemmVariant("dgrad", 128, 192, cluster_m=2, schedule="pingpong"),
    GemmVariant("dgrad", 128, 160, cluster_m=2, schedule="pingpong"),
    # Cluster (2, 1) with B multicast: halves the L2 -> SM traffic of the B tile for
    # compute-bound shapes (T ~ 16k with d_out or d_in >= 512).
    GemmVariant("fwd", 128, 256, cluster_m=2),
    GemmVariant("dgrad", 128, 256, cluster_m=2),
    # wgrad: M = d_out. 64-row tile for skinny d_out, 128-row for the rest. The fp32
    # variants (also the split-K partials of bf16 dw) keep a second accumulator for
    # two-level accumulation up to 160 columns; the 256-column fp32 tile keeps its total
    # in dw instead (promote_in="output"). 128 x 256 runs at splits = 1 only (ordered
    # split-K needs a register-total fp32 variant of the same tile, atomic split-K its
    # fp32 "add" variant): planners must check `supports(...)`, not just the tile list.
    GemmVariant("wgrad", 64, 128, out_dtype="float32"),
    GemmVariant("wgrad", 64, 128, out_dtype="bfloat16"),
    GemmVariant("wgrad", 128, 128, out_dtype="float32"),
    GemmVariant("wgrad", 128, 128, out_dtype="bfloat16"),
    GemmVariant("wgrad", 128, 256, out_dtype="bfloat16"),
    # fp32 dw on 128 x 256 tiles: the running total lives in dw itself (chains of
    # OUTPUT_PROMOTE_EVERY K tiles reduce-added by TMA), not in a second accumulator.
    GemmVariant("wgrad", 128, 256, out_dtype="float32", promote_in="output"),
    # 128 x 160: d_in = 5120 is 32 such N tiles, so 5120 -> 512 / 1024 make 128 / 256
    # CTAs (one / two full waves on 132 SMs) where 128 x 128 (160 / 320) and 128 x 256
    # (80 / 160) leave a wave a third or half empty. The promotion total fits (160
    # registers per consumer thread).
    GemmVariant("wgrad", 128, 160, out_dtype="float32"),
    GemmVariant("wgrad", 128, 160, out_dtype="bfloat16"),
    GemmVariant("wgrad", 128, 128, cluster_m=2, out_dtype="float32"),
    GemmVariant("wgrad", 128, 128, cluster_m=2, out_dtype="bfloat16"),
    # Split-tail wgrad: where the tiles leave the last wave short (5120 -> 1024 is 160 tiles
    # of 128 x 256 on 132 SMs: one full wave and 28 tiles), the tail's tiles are cut along K.
    # (An fp32 128 x 128 register-total one measured no gain: H200, 2026-11-30.)
    GemmVariant("wgrad", 128, 256, out_dtype="bfloat16", schedule="split_tail"),
    # fp32 dw: the total-in-dw 128 x 256 tile; whole-wave tiles promote into dw as usual,
    # the tail's pieces (at most OUTPUT_PROMOTE_EVERY K tiles each) hand their partials
    # to the tile's last piece, which stores the sum.
    GemmVariant("wgrad", 128, 256, out_dtype="float32", promote_in="output", schedule="split_tail"),
    # wgrad arrival-order split-K (reduction=2): fp32 reduce-add into dw or workspace
    GemmVariant("wgrad", 64, 128, out_dtype="float32", store="add"),
    GemmVariant("wgrad", 128, 128, out_dtype="float32", store="add"),
    # fwd residual add (jax_cake_fwd_residual): y = r + x w^T, each bf16 tile reduce-added
    # (TMA) into r's buffer, aliased to y. The fwd tiles of the plain list, cluster 1x1.
    GemmVariant("fwd", 128, 256, store="add"),
    GemmVariant("fwd", 128, 128, store="add"),
    GemmVariant("fwd", 128, 64, store="add"),
    # fwd with the gated epilogue (jax_cake_fwd_gated), silu and gelu. The ping-pong
    # 128 x 192 tiles, where each tile's gu and h stores run under the other warpgroup's K
    # loop, are what planner/gated.py plans; the cooperative 128 x 256 c2x1 one (silu) is
    # the benchmark's comparison (slower than the pass it replaces: docs/benchmarks.md).
    GemmVariant("fwd", 128, 192, cluster_m=2, store="gated_silu", schedule="pingpong"),
    GemmVariant("fwd", 128, 192, store="gated_silu", schedule="pingpong"),
    GemmVariant("fwd", 128, 256, cluster_m=2, store="gated_silu"),
    GemmVariant("fwd", 128, 192, cluster_m=2, store="gated_gelu", schedule="pingpong"),
    GemmVariant("fwd", 128, 192, store="gated_gelu", schedule="pingpong"),
    # The down projection's dgrad with the activation gradient in its epilogue
    # (jax_cake_dgrad_gated), on the gated forward's ping-pong 128 x 192 tiles, with the
    # wide setmaxnreg split (24 / 240: the epilogue's gu registers beside the accumulator).
    # No local memory (cuobjdump -res-usage of the compiled cubins, CuTe DSL 4.8.1,
    # 2026-12-04). Held back from the planner (planner/gated.py
    # GATE_GRAD_EPILOGUE_ENABLED).
    GemmVariant("dgrad", 128, 192, cluster_m=2, store="gate_grad_silu", schedule="pingpong"),
    GemmVariant("dgrad", 128, 192, store="gate_grad_silu", schedule="pingpong"),
    # The gated projection's dx over K = 2F from the cotangent's halves dg, du and the
    # interleaved weight's gate and up rows (jax_cake_dgrad_gate_up): the tiles the dgrad
    # planner picks for that GEMM (T 8192-16384, d_in 4096-8192, 2F 28672-57344: 128 x 256
    # c2x1 or the ping-pong 128 x 192 c2x1; smaller shapes 128 x 128).
    GemmVariant("dgrad", 128, 256, cluster_m=2, store="gate_up_halves"),
    GemmVariant("dgrad", 128, 256, store="gate_up_halves"),
    GemmVariant("dgrad", 128, 192, cluster_m=2, store="gate_up_halves", schedule="pingpong"),
    GemmVariant("dgrad", 128, 128, store="gate_up_halves"),
    # The grouped GEMMs of the MoE experts (grouped_projection): cooperative tiles, one
    # pass over K, cluster 1x1 (a CTA pair's two M tiles may belong to two groups). fwd and
    # dgrad on 128 x 256 (planned) and 128 x 128 (its comparison, benchmarks/grouped_walks);
    # the weight gradient on 128 x 128 in FP32 (two-level, in registers) or bf16. The
    # ping-pong 128 x 192 c1x1 tile, plain and gated, measured slower (docs/planner.md).
    GemmVariant("fwd", 128, 128, grouping="rows"),
    GemmVariant("dgrad", 128, 128, grouping="rows"),
    GemmVariant("fwd", 128, 256, grouping="rows"),
    GemmVariant("dgrad", 128, 256, grouping="rows"),
    GemmVariant("wgrad", 128, 128, out_dtype="float32", grouping="k"),
    GemmVariant("wgrad", 128, 128, out_dtype="bfloat16", grouping="k"),
    # The experts' gate/up projection with the gated epilogue (grouped_gated_projection):
    # the grouped forward's 128 x 256 tile writing gu and h.
    GemmVariant("fwd", 128, 256, store="gated_silu", grouping="rows"),
    GemmVariant("fwd", 128, 256, store="gated_gelu", grouping="rows"),
)


def find_variant(
    program: str,
    tile: tuple[int, int, int],
    cluster: tuple[int, int],
    out_dtype: str,
    store: str = "plain",
    schedule: str = "tiles",
    grouping: str | None = None,
) -> GemmVariant | None:
    """The compiled variant matching these attributes, or None."""
    key = (program, tuple(tile), tuple(cluster), out_dtype, store, schedule, grouping)
    for v in VARIANTS:
        if (v.program, v.tile, v.cluster, v.out_dtype, v.store, v.schedule, v.grouping) == key:
            return v
    return None


def supports(
    program: str,
    tile,
    cluster,
    out_dtype: str,
    splits: int,
    reduction: int,
    schedule: str = "tiles",
    accumulate: bool = False,
) -> bool:
    """Whether the native library can run this (program, tile, cluster, dtype, split-K,
    schedule; a split tail's schedule follows from reduction 3). accumulate: as
    jax_cake_wgrad_accumulate (fp32 dw += the gradient in place): one pass on the fp32
    reduce-add variant, or ordered split-K partials summed into dw; for fwd, as
    jax_cake_fwd_residual (y = r + x w^T in r's buffer): one pass on the bf16 reduce-add
    variant."""
    if accumulate and program == "fwd":
        return (
            out_dtype == "bfloat16"
            and schedule == "tiles"
            and splits == 1
            and reduction == REDUCTION_NONE
            and find_variant(program, tile, cluster, "bfloat16", "add") is not None
        )
    if accumulate:
        if program != "wgrad" or out_dtype != "float32" or schedule != "tiles":
            return False
        if splits == 1 and reduction == REDUCTION_NONE:
            return find_variant(program, tile, cluster, "float32", "add") is not None
        return (
            splits > 1
            and reduction == REDUCTION_ORDERED
            and supports(program, tile, cluster, out_dtype, splits, reduction)
        )
    if program != "wgrad":
        return (
            splits == 1
            and reduction == REDUCTION_NONE
            and find_variant(program, tile, cluster, out_dtype, schedule=schedule) is not None
        )
    if splits == 1 and reduction == REDUCTION_NONE:
        return find_variant(program, tile, cluster, out_dtype) is not None
    if splits > 1 and reduction == REDUCTION_ORDERED:
        # Ordered partials: the fp32 variant of the tile that keeps its total in registers.
        v = find_variant(program, tile, cluster, "float32")
        return v is not None and v.promote_in == "registers"
    if splits > 1 and reduction == REDUCTION_ARRIVAL:
        return find_variant(program, tile, cluster, "float32", "add") is not None
    if reduction == REDUCTION_SPLIT_TAIL:
        return find_variant(program, tile, cluster, out_dtype, schedule="split_tail") is not None
    return False


def split_tail_slots(tiles: int, splits: int, sm_count: int) -> int:
    """Partial tiles a split tail hands over: (splits - 1) per tail tile. The grid is
    min(SMs, tiles * splits) and the tail rem = tiles % grid (the kernel and the FFI
    handler compute the same)."""
    grid = min(sm_count, tiles * splits)
    return (tiles % grid) * (splits - 1)


def split_tail_workspace_bytes(tiles: int, splits: int, tile, sm_count: int) -> int:
    """int32 flags, one per slot (padded to 32), then one fp32 partial tile per slot."""
    slots = split_tail_slots(tiles, splits, sm_count)
    return ((slots + 31) // 32 * 32 + slots * tile[0] * tile[1]) * 4


def workspace_bytes(
    splits: int, reduction: int, batch: int, m: int, n: int, out_dtype: str, tile=None, sm_count: int = 0
) -> int:
    """Workspace size of the FFI contract (at least 16 bytes so arity stays fixed).
    A split tail (reduction 3) needs the tile and the SM count."""
    if reduction == REDUCTION_SPLIT_TAIL:
        tiles = batch * -(-m // tile[0]) * -(-n // tile[1])
        return max(split_tail_workspace_bytes(tiles, splits, tile, sm_count), 16)
    if reduction == REDUCTION_ORDERED and splits > 1:
        need = splits * batch * m * n * 4
    elif reduction == REDUCTION_ARRIVAL and out_dtype == "bfloat16":
        need = batch * m * n * 4
    else:
        need = 0
    return max(need, 16)
