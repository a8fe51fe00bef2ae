"""Warp-specialized TMA + wgmma GEMM for sm_90a (Hopper), written in CuTe DSL.

C[M, N, Lc] = sum_k A[M, K, L] * B[N, K, L] for bf16 A/B, fp32 accumulation, bf16 or
fp32 C. M, N, K, L are dynamic: one compiled variant serves every shape.

Layout of the CTA (the frame of gemm_base_sm90.GemmSm90Base): warpgroup 0 is the
producer (one warp issues the TMA loads of A and B into a ring of shared-memory stages
guarded by an mbarrier pipeline); warpgroups 1..tile_m/64 are consumers (each owns 64
rows of the tile, issues wgmma on the stage, releases it, and finally writes its rows
through shared memory with TMA stores). This module holds what is the dense family's
own: the bf16 operands and cluster multicast, the (m, n, batch, split) tile walk, split-K,
the split tail, ping-pong and the two-level accumulation of fp32 wgrad.

Persistent: the grid holds at most one CTA per SM; CTA i handles tiles i, i + grid,
... of the (m, n, batch l, split) tile space, so the producer already loads the next
tile while the consumers run the epilogue of the current one.

Split-K: split s reduces its own contiguous range of K tiles and stores into batch
z = s * L + l of C, so with splits > 1 C is the fp32 workspace [splits, L, M, N] and a
separate pass sums it in split order (bitwise reproducible). With splits == 1, C is the
output itself. Reduce-add variants instead TMA-add every split into batch l of C
(arrival order).

Residual add (fwd, `store="add"`, bf16 C): C holds the residual r on entry and each
finished tile is TMA reduce-added into it (cp.reduce.async.bulk.tensor .add on a bf16
tensor map), so C = bf16(r + bf16(acc)): the tile is rounded to bf16 in shared memory
(as for a plain store), then the TMA unit adds it to r with one more round to nearest.
One pass over K, so every element gets exactly one add: bitwise reproducible.

FP32 wgrad (long K = T) uses two-level accumulation (`promote`): wgmma accumulates
_PROMOTE_EVERY K tiles from zero, then that partial is added to the running fp32
accumulator. The error of one wgmma chain grows about linearly with its length (about
7e-8 relative per K tile on the H200), so one chain over a long K misses the fp32
target. bf16 output (target 1e-2) does not promote.

The running total needs a second accumulator (tile_n / 2 more registers per thread), so a
128 x 256 fp32 tile cannot keep it in registers. Those variants (`promote_in="output"`)
keep it in C itself: every OUTPUT_PROMOTE_EVERY (variants.py) K tiles both consumer
warpgroups run the epilogue on their chain, the first chain as a plain TMA store of the
tile, every later one (the last included) as a TMA reduce-add into it, and restart the
chain from zero. The store warp waits for the previous chain's bulk stores to complete
before the next chain's first store, so each element's adds arrive in chain order: bitwise
reproducible. A promotion costs microseconds of CTA time (the TMA store round trips
through two buffers, the reduce-add, the drain and the bank-conflicted fp32 shared-memory
stores), hence the long chains.

Split tail (`schedule="split_tail"`, cluster (1, 1)): whole waves of tiles run as
above; the `rem = tiles % grid` tiles of the last, partial wave are each cut into
`splits` K pieces, so the tail runs on up to `rem * splits` CTAs instead of `rem`. The
pieces are ordered piece-major (concurrent CTAs read the same K range, as in a wave of
whole tiles). Each piece but the last stores its fp32 partial tile into the workspace and
raises a flag; the last piece (the highest item id of its tile, so it never waits for
work scheduled after it) waits for the flags and adds the partials in piece order, then
stores C. The cut depends only on the shape, the grid and `splits`: bitwise reproducible.
Workspace: int32 flags [round_up(rem * (splits - 1), 32)], then one partial tile per
flag. (Cutting K evenly over all CTAs, stream-K proper, was much slower for wgrad: CTAs
at different K offsets lose the L2 reuse of the shared x and dy rows.) With
`promote_in="output"` the whole-wave tiles promote into C as above, while the pieces of a
cut tile never write C before their sum, so each keeps its share of K in one wgmma chain:
pieces are at most OUTPUT_PROMOTE_EVERY K tiles (the planner plans no more, the FFI
refuses more).

Ping-pong (`schedule="pingpong"`, fwd/dgrad, 128 x PINGPONG_TILE_N tiles): each consumer
warpgroup owns a whole tile, and the two take the CTA's tiles in turns: warpgroup 0 runs
the K loop of tile 0 while warpgroup 1 waits, then warpgroup 1 runs tile 1's K loop while
warpgroup 0 stores tile 0, and so on (two named barriers pass the turn as soon as a
warpgroup has issued its tile's last wgmma). With a short K loop (dgrad at d_out = 512 is
8 K tiles per tile) the epilogue of one tile then hides behind the MMAs of the next
instead of stalling the tensor cores; with a long one the wider tiles reuse operands
better and still hide the epilogue. In a (2, 1) cluster both CTAs walk the same items, so
their warpgroups consume the multicast B stages in step. A warpgroup holds the whole
128 x tile_n fp32 accumulator (tile_n registers per thread; the setmaxnreg split follows
it, gemm_base_sm90.ACC_REGS_WIDE). At 128 x 128 each warpgroup has its own epilogue
buffers. The wider tiles share one ring of buffers (what the A/B stages leave, e.g.
5 stages and 3 buffers at 128 x 192), so the epilogues take turns too: a warpgroup
waits for its epilogue turn (named barriers 5 / 6) before staging its first sub-tile,
and its store warp passes the turn once its TMA stores have read the ring
(cp.async.bulk.wait_group.read 0). The next epilogue is the other warpgroup's, at the end
of its K loop, so the drain costs nothing while K loops are longer than epilogues.

Two operand pairs along K (`store="gate_up_halves"`, dgrad: dx of the gated projection):
K = 2F runs over the gate half's ceil(F / 64) K tiles with A = dg and B = the gate rows of
the interleaved weight W [2F, d_in], then the same count with A = du (the kernel's second
tensor) and B = W's up rows. Both B halves are views of W, (d_in, (16, F / 16)) with
strides (1, (d_in, 32 d_in)), the up one 16 rows further (contract.GATE_BLOCK), which the
TMA reads as a rank-4 box of (64, 16, 4) elements per K tile: no copy. Only the producer
knows: it picks the pair by K tile, and the consumers see one K loop twice as long. A
ragged F ends the gate half with a zero-filled partial tile and starts the up half on a
fresh one.

Gradient epilogue (`store="gate_grad_silu"`, dgrad on the wide ping-pong tiles: the
down projection's dh = dy W_down with the SwiGLU gradient): the 128 x tile_n dh tile leaves
as tile_n / 16 blocks of (128 rows, 16 d_ff columns, 2 planes), dg and du, into d_gu [2, L,
M, F]. Each is made in place in an epilogue buffer from the same block of the saved
pre-activation gu [L, M, 2F] (gate and up interleaved in 16-column groups): the store warp
TMA-loads the blocks of the first epi_stage groups when the warpgroup's epilogue turn comes
(one mbarrier per buffer), each group waits for its block, ldmatrix brings it into the
registers' layout, the math runs in FP32, stmatrix writes dg and du back over it and one
TMA box stores both planes; the buffer the previous group's store has read is then
refilled with the block epi_stage - 1 groups ahead. Both tensors are seen as (M, 16, 2,
F / 16, L), so one 5-d TMA box moves a block either way.

Streamed activations: in the skinny variants (fwd 128 x 64, wgrad 64-row tiles), when d_out
fits one tile, every tile of x feeds exactly one CTA tile and x is nearly all the traffic;
its TMA loads then carry an L2 evict-first hint, so the stream of x replaces itself in L2
instead of other lines (other tensors' dirty lines) there, which makes the skinny fwd
and wgrad faster. Elsewhere the hint lost (where x is re-read by two N tiles, or where
the output's writes are a large part of the traffic), so only the skinny variants carry
it.

Grouped (`grouping`, the MoE experts' GEMMs; planner/variants.py's docstring): rows
padded so that every group starts on a tile, and an int32 table (the table tensor, mTable;
the other variants are passed a placeholder they never read). The "rows" forward also
has the gated epilogue (`store="gated_silu"` / `"gated_gelu"`: the MoE experts' gate/up
projection, the second tensor h as for the dense one).
"rows" (fwd, dgrad): the table's entry after the M tiles' (table[max tiles], read once
per CTA) says how many M tiles hold rows, and only those are walked; the producer loads
B from batch table[pid_m], the weight of the tile's group. "k" (wgrad): the walk's
batches are C's (one per group) and batch g's K range is [table[g], table[g + 1]) K tiles
of the one batch of A and B: each group's tile sums its own rows in K order, and an
empty group stores zeros (as a split with no K tile). Both sides read the table the same
way, so the producer and the consumers agree on every tile's K count.

Ragged edges: TMA loads zero-fill out-of-bounds rows/columns of A and B (including the
K tail), and TMA stores clip out-of-bounds rows/columns of C, so no predication is
needed in the kernel body. A split with no K tile writes zeros.

Imported only by jax_cake/build.py (AOT); never at run time.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.utils.distributed import spin_lock_ld_lt_relaxed_wait

from jax_cake import contract
from jax_cake.kernels.epilogue_sm90 import gate_up_block_layouts, make_epilogue, make_gate_up_load, tile_sub_tiles
from jax_cake.kernels.gemm_base_sm90 import ACC_REGS_WIDE, EPI_BARRIER_ID, GemmSm90Base, fence_tensor
from jax_cake.planner.variants import OUTPUT_PROMOTE_EVERY, GemmVariant

_DTYPES = {"bfloat16": cutlass.BFloat16, "float32": cutlass.Float32}

# L2 cache policy of cp.async.bulk.tensor: evict first (CUTLASS's CacheHintSm90::EVICT_FIRST).
_L2_EVICT_FIRST = 0x12F0000000000000
# Two-level accumulation interval in K tiles (64 each). Each promotion drains the
# wgmma pipeline (wait_group(0)), so fewer promotions cost less time; the chain error
# grows ~linearly with the interval (~7e-8 per K tile, see the module docstring):
# 16 tiles predicts ~1.1e-6 relative, well under the 1e-5 fp32 target whatever T, and
# shorter intervals cost time for accuracy nobody needs. With two consumer warpgroups
# the second one promotes half an interval later (a first chain of 8 tiles), so the two
# drains do not coincide.
_PROMOTE_EVERY = 16
# Ping-pong tile widths (tile_m 128). A warpgroup holds the whole 128 x tile_n fp32
# accumulator (tile_n registers per thread), so 256 would spill; up to 192 fits under the
# 232 registers a consumer gets, 208 under the wide split's 240 (gemm_base_sm90).
PINGPONG_TILE_N = (128, 160, 176, 192, 208)
# Named barriers of the ping-pong consumers (1, 2 are the warpgroups' epilogue barriers,
# EPI_BARRIER_ID). Warpgroup w waits for its turn to issue MMAs on MMA_TURN_BARRIER_ID + w,
# a rendezvous of both consumer warpgroups (one arrives, the other waits), and for its turn
# to stage into the shared epilogue ring on EPI_TURN_BARRIER_ID + w, a rendezvous of the
# other warpgroup's store warp (32 arrive) and its own 128 threads (tests/test_pingpong_wide
# runs this protocol on a model of named barriers).
MMA_TURN_BARRIER_ID, MMA_TURN_THREADS = 3, 256
EPI_TURN_BARRIER_ID, EPI_TURN_THREADS = 5, 160


class GemmSm90(GemmSm90Base):
    """One compiled GEMM program (see module docstring). Configure with a GemmVariant."""

    def __init__(self, variant: GemmVariant):
        if variant.tile_m not in (64, 128):
            raise ValueError(f"tile_m must be 64 or 128, got {variant.tile_m}")
        if variant.tile_n not in (64, 128, 160, 176, 192, 208, 256):
            raise ValueError(f"tile_n must be 64, 128, 160, 176, 192, 208 or 256, got {variant.tile_n}")
        if variant.tile_k != 64:
            raise ValueError(f"tile_k must be 64, got {variant.tile_k}")
        if variant.cluster not in ((1, 1), (2, 1)):
            raise ValueError(f"cluster must be (1, 1) or (2, 1), got {variant.cluster}")
        if variant.store not in ("plain", "add", "gated_silu", "gated_gelu", "gate_grad_silu", "gate_up_halves"):
            raise ValueError(
                "store must be 'plain', 'add', 'gated_silu', 'gated_gelu', 'gate_grad_silu' or 'gate_up_halves', "
                f"got {variant.store!r}"
            )
        if variant.store == "gate_up_halves" and (
            variant.program != "dgrad"
            or variant.out_dtype != "bfloat16"
            or variant.schedule not in ("tiles", "pingpong")
        ):
            raise ValueError("store='gate_up_halves' needs dgrad, bfloat16 output and schedule 'tiles' or 'pingpong'")
        if variant.gate_grad is not None and (
            variant.program != "dgrad"
            or variant.out_dtype != "bfloat16"
            or variant.schedule != "pingpong"
            or variant.tile_n == 128
        ):
            # The epilogue's gu loads run on the shared ring of the wide ping-pong tiles.
            raise ValueError("a gate_grad store needs dgrad, bfloat16 output and a ping-pong tile wider than 128")
        if variant.activation is not None and (
            variant.program != "fwd"
            or variant.out_dtype != "bfloat16"
            or variant.schedule not in ("tiles", "pingpong")
            or variant.tile_n % 64 != 0
        ):
            # Each h sub-tile is made from two 32-column sub-tiles of the accumulator.
            raise ValueError(
                "a gated store needs fwd, bfloat16 output, schedule 'tiles' or 'pingpong' and tile_n a multiple of 64"
            )
        if variant.store == "add" and variant.out_dtype != "float32" and variant.program != "fwd":
            # bf16 reduce-add is the forward's residual add (one add per element, no split);
            # split-K partials must be summed in fp32.
            raise ValueError("store='add' needs float32 output (bfloat16: fwd only, the residual add)")
        if variant.store == "add" and variant.program == "fwd" and variant.schedule != "tiles":
            raise ValueError("a fwd store='add' (residual add) variant needs schedule='tiles'")
        if variant.schedule not in ("tiles", "split_tail", "pingpong"):
            raise ValueError(f"schedule must be 'tiles', 'split_tail' or 'pingpong', got {variant.schedule!r}")
        if variant.schedule == "pingpong" and (
            variant.program == "wgrad"
            or variant.tile_m != 128
            or variant.tile_n not in PINGPONG_TILE_N
            or variant.cluster_n != 1
        ):
            raise ValueError(
                f"schedule='pingpong' is for fwd/dgrad with 128 x {PINGPONG_TILE_N} tiles and cluster (cm, 1)"
            )
        if variant.tile_n == 192 and variant.schedule != "pingpong":
            # 64 x 192 per consumer warpgroup would work, but no such variant is measured.
            raise ValueError("tile_n = 192 is for schedule='pingpong'")
        if variant.schedule == "split_tail" and (variant.cluster != (1, 1) or variant.store != "plain"):
            raise ValueError("schedule='split_tail' needs cluster (1, 1) and store='plain'")
        if variant.grouping is not None and (
            (variant.grouping, variant.program) not in (("rows", "fwd"), ("rows", "dgrad"), ("k", "wgrad"))
            or variant.schedule != "tiles"
            or (variant.store != "plain" and not (variant.activation and variant.grouping == "rows"))
            or variant.cluster != (1, 1)
            or variant.tile_m != 128
            or variant.promote_in != "registers"
        ):
            raise ValueError(
                "a grouped variant is fwd or dgrad with grouping 'rows', or wgrad with grouping 'k', on 128-row "
                "tiles with schedule 'tiles', store 'plain' (or a gated one: fwd), cluster (1, 1) and its total in "
                "registers"
            )
        if variant.promote_in not in ("registers", "output"):
            raise ValueError(f"promote_in must be 'registers' or 'output', got {variant.promote_in!r}")
        if variant.promote_in == "output" and (
            not variant.promote or variant.store != "plain" or variant.schedule not in ("tiles", "split_tail")
        ):
            raise ValueError(
                "promote_in='output' is for fp32 wgrad with store='plain', schedule 'tiles' or 'split_tail'"
            )
        if variant.promote and variant.promote_in == "registers" and variant.tile_n > 160:
            # 64 x tile_n fp32 per consumer warpgroup twice (partial + total) is tile_n
            # registers per thread: 256 at tile_n = 256, over the 232 a consumer gets.
            raise ValueError("promote in registers (fp32 wgrad) needs tile_n <= 160: use promote_in='output'")
        self.variant = variant
        self.grouping = variant.grouping
        self.reduce_add = variant.store == "add"
        self.activation = variant.activation  # the gated epilogue's, else None
        self.gate_grad = variant.gate_grad  # the gradient epilogue's activation, else None
        self.gate_up_halves = variant.store == "gate_up_halves"
        self.split_tail = variant.schedule == "split_tail"
        self.pingpong = variant.schedule == "pingpong"
        self.promote = variant.promote and variant.promote_in == "registers"
        self.promote_out = variant.promote and variant.promote_in == "output"
        self.tile_mnk = (variant.tile_m, variant.tile_n, variant.tile_k)
        # Cluster (cm, 1): the cm CTAs of a cluster own vertically adjacent M tiles of
        # the same N tile and TMA-multicast the shared B tile (each loads 1/cm of it).
        self.cluster_m = variant.cluster_m
        self.ab_dtype = cutlass.BFloat16
        self.acc_dtype = cutlass.Float32
        self.c_dtype = _DTYPES[variant.out_dtype]
        # Consumer warpgroups; the threads that share one tile (its accumulator, stage
        # releases and epilogue): all consumers, or with ping-pong one warpgroup.
        # fp32 accumulator registers per consumer thread: a ping-pong warpgroup holds the
        # whole tile, a cooperative one its 64 rows (twice with the register total).
        acc_regs = variant.tile_m * variant.tile_n // 128 if self.pingpong else 64 * variant.tile_n // 128
        # The gradient epilogue loads gu beside the whole accumulator: the wide register split.
        acc_regs = max(acc_regs * (2 if self.promote else 1), ACC_REGS_WIDE if variant.gate_grad else 0)
        self._init_cta(2 if self.pingpong else variant.tile_m // 64, acc_regs)
        self.tile_threads = 128 if self.pingpong else self.mma_threads
        # Epilogue buffers (32-column sub-tiles): a sub-tile waits only for the store that
        # last read its buffer. dgrad gets one per sub-tile (the whole tile): at small
        # K = d_out it is bound by writing C, and its stores then drain under the next
        # tile's K loop; fwd (128, 256) lost a little with it (one A/B stage fewer), so
        # the others keep up to four. The ring index is epi_idx % epi_stage, so the number
        # of sub-tiles per tile must be a multiple of epi_stage: tile_n = 160 (five
        # sub-tiles) gets one buffer per sub-tile.
        sub_tiles = variant.tile_n // self.epi_tile[1]
        whole_tile = variant.program == "dgrad" or sub_tiles % 4 != 0
        self.epi_stage = sub_tiles if whole_tile else min(4, sub_tiles)
        if self.activation is not None:
            # Three stores per pair of sub-tiles (two of the pre-activation, one of h) cycle
            # through one ring of buffers, whose size must divide the tile's store count.
            stores = 3 * (sub_tiles // 2)
            self.epi_stage = max(d for d in (1, 2, 3, 4) if stores % d == 0)
        if self.promote_out:
            # Two fp32 buffers leave room for a fourth A/B stage at 128 x 256 (four
            # would leave three).
            self.epi_stage = 2
        # Ping-pong 128 x 128: each warpgroup has its own epi_stage buffers. Wider
        # ping-pong tiles (`shared_epi`) share one ring of buffers between the two
        # warpgroups, whose epilogues take turns (each drains its stores' reads of the
        # ring before passing the turn, module docstring): the A/B ring gets every stage
        # that leaves room for two buffers, the buffers fill what remains (up to one per
        # sub-tile). A tile starts on a drained ring, so its sub-tile count need not be a
        # multiple of epi_stage.
        self.shared_epi = self.pingpong and variant.tile_n != 128
        buffer_bytes = self.epi_tile[0] * self.epi_tile[1] * (self.c_dtype.width // 8)
        stage_bytes = (variant.tile_m + variant.tile_n) * variant.tile_k * 2
        if self.shared_epi:
            self.ab_stage = self._ring_stages(stage_bytes, 2 * buffer_bytes)
            self.epi_stage = self._fill_buffers(self.ab_stage, stage_bytes, buffer_bytes, sub_tiles)
            self.epi_buffers = self.epi_stage
            if self.gate_grad is not None and self.epi_stage < 2:
                # One buffer cannot load the next gu block while its store drains.
                raise ValueError(f"{variant.name}: the gradient epilogue needs two epilogue buffers")
        else:
            self.epi_buffers = self.epi_stage * (2 if self.pingpong else 1)
            self.ab_stage = self._ring_stages(stage_bytes, buffer_bytes * self.epi_buffers)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mC: cute.Tensor,
        mAux: cute.Tensor,
        mTable: cute.Tensor,
        splits: cutlass.Int32,
        raster: cutlass.Int32,
        max_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        a_layout = utils.LayoutEnum.from_tensor(mA)
        b_layout = utils.LayoutEnum.from_tensor(mB)
        c_layout = utils.LayoutEnum.from_tensor(mC)
        self.c_layout = c_layout

        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            a_layout.sm90_mma_major_mode(),
            b_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            (1 if self.pingpong else self.num_mma_wg, 1, 1),
            tiler_mn=(64, self.tile_mnk[1]),
        )
        a_smem_staged, b_smem_staged, epi_smem_staged = self._smem_layouts(
            a_layout, self.ab_dtype, b_layout, self.ab_dtype, c_layout, self.c_dtype, self.ab_stage, self.epi_buffers
        )
        # The gradient epilogue's buffers hold (tile_m, 16, 2) blocks (gate_up_block_layouts);
        # the other variants pass their own layout again (never used).
        epi_blocks_staged = epi_smem_staged
        if cutlass.const_expr(self.gate_grad is not None):
            epi_smem_staged, epi_blocks_staged = gate_up_block_layouts(self.tile_mnk[0], self.epi_buffers)
        # The K loop's second half (gate_up_halves: the up half; the other variants pass
        # the first half's atoms again, never used).
        b_first, b_second = mB, mB
        if cutlass.const_expr(self.gate_up_halves):
            b_first, b_second = self._gate_up_rows(mB, cute.size(mA, mode=[1]))
        tma_atom_a, tma_a = self._tma_load(mA, a_smem_staged, self.tile_mnk[0])
        tma_atom_b, tma_b = self._tma_load(b_first, b_smem_staged, self.tile_mnk[1], multicast=self.cluster_m)
        tma_atom_a2, tma_a2, tma_atom_b2, tma_b2 = tma_atom_a, tma_a, tma_atom_b, tma_b
        if cutlass.const_expr(self.gate_up_halves):
            tma_atom_a2, tma_a2 = self._tma_load(mAux, a_smem_staged, self.tile_mnk[0])
            tma_atom_b2, tma_b2 = self._tma_load(b_second, b_smem_staged, self.tile_mnk[1], multicast=self.cluster_m)
        if cutlass.const_expr(self.reduce_add):
            store_op = cute.nvgpu.cpasync.CopyReduceBulkTensorTileS2GOp()
        else:
            store_op = cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp()
        if cutlass.const_expr(self.gate_grad is not None):
            # d_gu in planes [2, L, M, F] (dg, du): each 16-column group's block of both.
            tma_atom_c, tma_c = self._tma_blocks(store_op, self._planes_view(mC), epi_blocks_staged)
        else:
            tma_atom_c, tma_c = self._tma_store(store_op, mC, epi_smem_staged)
        # promote_in="output": later chains reduce-add into the tile the first one stored.
        tma_atom_c_add, tma_c_add = tma_atom_c, tma_c
        if cutlass.const_expr(self.promote_out):
            tma_atom_c_add, tma_c_add = self._tma_store(
                cute.nvgpu.cpasync.CopyReduceBulkTensorTileS2GOp(), mC, epi_smem_staged
            )
        # The epilogue's second tensor through the same buffers: the gated epilogue's
        # output h (mAux, laid out as C, stored), the gradient epilogue's pre-activation gu
        # (mAux [L, M, 2F] interleaved, loaded by blocks); the other variants pass C's atom
        # in its place (never used).
        tma_atom_aux, tma_aux = tma_atom_c, tma_c
        if cutlass.const_expr(self.activation is not None):
            tma_atom_aux, tma_aux = self._tma_store(cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mAux, epi_smem_staged)
        if cutlass.const_expr(self.gate_grad is not None):
            tma_atom_aux, tma_aux = self._tma_blocks(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), self._interleaved_view(mAux), epi_blocks_staged
            )
        self.shared_storage = self._shared_storage(
            self.ab_stage,
            {
                "sA": (self.ab_dtype, a_smem_staged),
                "sB": (self.ab_dtype, b_smem_staged),
                "sC": (self.c_dtype, epi_smem_staged),
            },
            epi_barriers=self.epi_buffers if self.gate_grad is not None else 0,
        )

        # Persistent grid: at most one CTA per SM (max_ctas, from the caller), each
        # cluster walking cluster tiles (m, n, batch, split) with a stride of the
        # number of clusters.
        cm = self.cluster_m
        tiles_m = cutlass.Int32((cute.size(mC, mode=[0]) + self.tile_mnk[0] - 1) // self.tile_mnk[0])
        tiles_mc = (tiles_m + cm - 1) // cm
        # N from B (C is twice as wide with the gate_grad store).
        tiles_n = cutlass.Int32((cute.size(mB, mode=[0]) + self.tile_mnk[1] - 1) // self.tile_mnk[1])
        # (A grouped "rows" variant sizes its grid for every M tile C has room for.)
        num_tiles = tiles_mc * tiles_n * self._batches(mA, mC) * splits
        grid_x = cutlass.min(num_tiles, max_ctas // cm) * cm
        if cutlass.const_expr(self.split_tail):
            # num_tiles counts every tile `splits` times; the kernel derives rem from the
            # grid: tiles >= max_ctas gives grid = max_ctas, fewer gives rem = tiles.
            grid_x = cutlass.min(num_tiles, max_ctas)

        self.kernel(
            tma_atom_a,
            tma_a,
            tma_atom_b,
            tma_b,
            tma_atom_a2,
            tma_a2,
            tma_atom_b2,
            tma_b2,
            tma_atom_c,
            tma_c,
            tma_atom_c_add,
            tma_c_add,
            tma_atom_aux,
            tma_aux,
            mAux,
            mTable,
            tiled_mma,
            a_smem_staged,
            b_smem_staged,
            epi_smem_staged,
            epi_blocks_staged,
            splits,
            raster,
        ).launch(
            grid=[grid_x, 1, 1],
            block=[self.threads, 1, 1],
            cluster=[cm, 1, 1],
            stream=stream,
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_atom_a2: cute.CopyAtom,
        mA2: cute.Tensor,
        tma_atom_b2: cute.CopyAtom,
        mB2: cute.Tensor,
        tma_atom_c: cute.CopyAtom,
        mC: cute.Tensor,
        tma_atom_c_add: cute.CopyAtom,
        mC_add: cute.Tensor,
        tma_atom_aux: cute.CopyAtom,
        mAuxT: cute.Tensor,
        mWs: cute.Tensor,
        mTable: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        epi_smem_staged: cute.ComposedLayout,
        epi_blocks_staged: cute.ComposedLayout,
        splits: cutlass.Int32,
        raster: cutlass.Int32,
    ):
        tidx, warp_idx, wg_idx = self._warp_roles()

        if warp_idx == 0:
            self._prefetch_descriptors(tma_atom_a, tma_atom_b, tma_atom_c)
            if cutlass.const_expr(self.gate_up_halves):
                self._prefetch_descriptors(tma_atom_a2, tma_atom_b2)
            if cutlass.const_expr(self.gate_grad is not None):
                self._prefetch_descriptors(tma_atom_aux)

        bidx, _, _ = cute.arch.block_idx()
        grid_x, _, _ = cute.arch.grid_dim()
        cm = self.cluster_m
        # Cluster id / count; the rank picks this CTA's M tile inside the cluster tile.
        cluster_id = cutlass.Int32(bidx) // cm
        num_clusters = cutlass.Int32(grid_x) // cm
        rank = 0
        if cutlass.const_expr(cm > 1):
            rank = cutlass.Int32(cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()))
        # Tile counts fit in 32 bits; keep all index arithmetic in Int32.
        num_l = self._batches(mA, mC)
        tiles_m = cutlass.Int32((cute.size(mC, mode=[0]) + self.tile_mnk[0] - 1) // self.tile_mnk[0])
        # The grouped variants' table (module docstring); None for the others.
        table = None
        if cutlass.const_expr(self.grouping is not None):
            table = mTable.iterator
        if cutlass.const_expr(self.grouping == "rows"):
            tiles_m = cute.arch.load(table + tiles_m, cutlass.Int32)  # the M tiles that hold rows
        tiles_mc = (tiles_m + cm - 1) // cm
        tiles_n = cutlass.Int32((cute.size(mB, mode=[0]) + self.tile_mnk[1] - 1) // self.tile_mnk[1])
        num_tiles = tiles_mc * tiles_n * num_l * splits
        # K tiles per split: split s reduces K tiles [s * per_split, (s + 1) * per_split).
        k_tiles = cutlass.Int32((cute.size(mA, mode=[1]) + self.tile_mnk[2] - 1) // self.tile_mnk[2])
        # gate_up_halves: K runs over the gate half's tiles, then the up half's.
        k_half = k_tiles
        if cutlass.const_expr(self.gate_up_halves):
            k_tiles = 2 * k_half
        per_split = (k_tiles + splits - 1) // splits
        # Work items: tile ids (times splits); with a split tail, the whole tiles [0, dp)
        # and then the pieces of the rem tail tiles, piece-major.
        num_items, dp, rem = num_tiles, num_tiles, 1
        if cutlass.const_expr(self.split_tail):
            whole = num_tiles // splits
            rem = whole % num_clusters
            dp = whole - rem
            num_items = dp + rem * splits
            rem = cutlass.max(rem, 1)  # no tail item reads it when rem == 0

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        epi_bars = None
        if cutlass.const_expr(self.gate_grad is not None):
            # One mbarrier per epilogue buffer: its gu block's TMA load (one arrival and
            # the block's bytes). Made visible by the operand ring's init fence and sync.
            epi_bars = storage.epi_mbar.data_ptr()
            if warp_idx == 0:
                with cute.arch.elect_one():
                    for b in cutlass.range_constexpr(self.epi_buffers):
                        cute.arch.mbarrier_init(epi_bars + b, 1)
            cute.arch.mbarrier_init_fence()

        tx_bytes = self._stage_bytes(self.ab_dtype, a_smem_staged) + self._stage_bytes(self.ab_dtype, b_smem_staged)
        # The tile's consumer warps release each stage (in every CTA of the cluster).
        ab_pipe = self._ring(storage, self.ab_stage, tx_bytes, self.tile_threads // 32, cm)
        sA = self._smem_tensor(storage.sA, a_smem_staged)
        sB = self._smem_tensor(storage.sB, b_smem_staged)
        sC = self._smem_tensor(storage.sC, epi_smem_staged)
        sC_blocks = self._smem_tensor(storage.sC, epi_blocks_staged)

        if wg_idx == 0:
            # ------------------------------------------------------------ producer
            self._producer_regs()
            if warp_idx == 0:
                prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
                # Persistent: this cluster walks cluster tiles id, id + #clusters, ...;
                # the stage ring carries over, so the next tile's loads overlap this
                # tile's epilogue.
                b_mask = None
                if cutlass.const_expr(cm > 1):
                    cta_layout_mnk = cute.make_layout((cm, 1, 1))
                    b_mask = cute.make_layout_image_mask(cta_layout_mnk, cta_layout_mnk.get_flat_coord(rank), mode=0)
                # Whether the x operand (fwd: A, wgrad: B) streams through a skinny
                # variant: each of its tiles feeds one CTA tile only (module docstring).
                a_streams, b_streams = False, False
                if cutlass.const_expr(self.variant.streams_x and self.variant.program == "fwd"):
                    a_streams = tiles_n == 1
                if cutlass.const_expr(self.variant.streams_x and self.variant.program == "wgrad"):
                    b_streams = tiles_m == 1
                for item in cutlass.range(cluster_id, num_items, num_clusters, unroll=1):
                    tile_id, piece, pieces = self._item(item, dp, rem, splits)
                    pid_mc, pid_n, l_idx, split = self._decode(tile_id, tiles_mc, tiles_n, num_l, raster)
                    pid_m = pid_mc * cm + rank
                    k_begin, k_cnt = self._k_range(split, per_split, k_tiles, piece, pieces)
                    a_l, b_l = l_idx, l_idx
                    if cutlass.const_expr(self.grouping == "rows"):
                        a_l, b_l = cutlass.Int32(0), cute.arch.load(table + pid_m, cutlass.Int32)
                    if cutlass.const_expr(self.grouping == "k"):
                        a_l, b_l = cutlass.Int32(0), cutlass.Int32(0)
                        k_begin, k_cnt = self._group_k_range(table, l_idx)
                    gA = cute.local_tile(mA, self.tile_mnk, (pid_m, pid_n, None, a_l), proj=(1, None, 1))
                    gB = cute.local_tile(mB, self.tile_mnk, (pid_m, pid_n, None, b_l), proj=(None, 1, 1))
                    tAsA, tAgA = self._tma_part(tma_atom_a, sA, gA)
                    # With a cluster, this CTA loads slice `rank` of B and multicasts it.
                    tBsB, tBgB = self._tma_part(tma_atom_b, sB, gB, rank, cm)
                    if cutlass.const_expr(self.gate_up_halves):
                        gA2 = cute.local_tile(mA2, self.tile_mnk, (pid_m, pid_n, None, l_idx), proj=(1, None, 1))
                        gB2 = cute.local_tile(mB2, self.tile_mnk, (pid_m, pid_n, None, l_idx), proj=(None, 1, 1))
                        tAsA2, tAgA2 = self._tma_part(tma_atom_a2, sA, gA2)
                        tBsB2, tBgB2 = self._tma_part(tma_atom_b2, sB, gB2, rank, cm)
                        up_pair = ((tma_atom_a2, tAgA2, tAsA2, False), (tma_atom_b2, tBgB2, tBsB2, False))
                    # Each K tile's operand pair (_load_k_tile); with gate_up_halves the gate
                    # half's K tiles come from it, the up half's from up_pair.
                    pair = ((tma_atom_a, tAgA, tAsA, a_streams), (tma_atom_b, tBgB, tBsB, b_streams))
                    for kt in cutlass.range(k_cnt, unroll=1):
                        ab_pipe.producer_acquire(prod_state)
                        k_coord = k_begin + kt
                        bar = ab_pipe.producer_get_barrier(prod_state)
                        if cutlass.const_expr(self.gate_up_halves):
                            if k_coord < k_half:
                                self._load_k_tile(*pair, k_coord, prod_state.index, bar, b_mask)
                            else:
                                self._load_k_tile(*up_pair, k_coord - k_half, prod_state.index, bar, b_mask)
                        else:
                            self._load_k_tile(*pair, k_coord, prod_state.index, bar, b_mask)
                        ab_pipe.producer_commit(prod_state)
                        prod_state.advance()
                if cutlass.const_expr(cm > 1):
                    # Do not exit while peers may still release (remote-arrive on) our
                    # stages: wait until every stage is empty.
                    ab_pipe.producer_tail(prod_state)
        else:
            # ------------------------------------------------------------ consumers
            self._consumer_regs()
            mma_wg = wg_idx - 1
            mma_tidx = tidx - 128
            thr_mma = tiled_mma.get_slice(mma_wg * 128)
            # The warp that issues this tile's TMA stores, and this tile's epilogue buffers.
            store_warp, buf_base, epi_barrier_id = 4, 0, EPI_BARRIER_ID
            if cutlass.const_expr(self.pingpong):
                mma_tidx = tidx - 128 * wg_idx
                thr_mma = tiled_mma.get_slice(0)
                store_warp, buf_base, epi_barrier_id = 4 * wg_idx, mma_wg * self.epi_stage, EPI_BARRIER_ID + mma_wg
                if cutlass.const_expr(self.shared_epi):
                    buf_base = 0
            tCsA = thr_mma.partition_A(sA)
            tCsB = thr_mma.partition_B(sB)
            tCrA = tiled_mma.make_fragment_A(tCsA)
            tCrB = tiled_mma.make_fragment_B(tCsB)
            # Accumulator shape from a tile-shaped view (same for every tile).
            if cutlass.const_expr(self.gate_grad is None):
                gC0 = cute.local_tile(mC, self.tile_mnk, (0, 0, None, 0), proj=(1, 1, None))
            else:
                # C is the planes view (M, 16, 2, F / 16, L): the tile's shape alone.
                gC0 = cute.make_identity_tensor((self.tile_mnk[0], self.tile_mnk[1]))
            tCgC = thr_mma.partition_C(gC0)
            acc = cute.make_rmem_tensor(tCgC.shape, self.acc_dtype)
            if cutlass.const_expr(self.promote):
                acc_k = cute.make_rmem_tensor(tCgC.shape, self.acc_dtype)
            num_k_blocks = cute.size(tCrA, mode=[2])
            promote_phase = mma_wg * (_PROMOTE_EVERY // 2)

            # Epilogue plumbing shared by all tiles.
            staging, c_pipe = make_epilogue(
                tiled_mma,
                self.c_layout,
                self.c_dtype,
                self.acc_dtype,
                acc,
                sC,
                mma_tidx,
                self.epi_stage,
                self.tile_threads,
                epi_barrier_id,
            )
            gate_up_load = None
            if cutlass.const_expr(self.gate_grad is not None):
                gate_up_load = make_gate_up_load(staging, tiled_mma, self.c_layout, sC, mma_tidx)

            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            item_begin, item_step = cluster_id, num_clusters
            if cutlass.const_expr(self.pingpong):
                # Warpgroup w takes every other tile of this CTA, starting with its w-th;
                # the turn to issue MMAs passes between the two through the MMA turn
                # barriers (each a 256-thread rendezvous: one arrives, the other waits).
                item_begin, item_step = cluster_id + mma_wg * num_clusters, 2 * num_clusters
                my_turn = pipeline.NamedBarrier(barrier_id=MMA_TURN_BARRIER_ID + mma_wg, num_threads=MMA_TURN_THREADS)
                their_turn = pipeline.NamedBarrier(
                    barrier_id=MMA_TURN_BARRIER_ID + 1 - mma_wg, num_threads=MMA_TURN_THREADS
                )
                # Shared epilogue ring: the turn to stage into it passes the same way, from
                # the store warp (once its stores have read the ring) to the other
                # warpgroup (a 160-thread rendezvous: 32 arrive, 128 wait).
                my_epi = pipeline.NamedBarrier(barrier_id=EPI_TURN_BARRIER_ID + mma_wg, num_threads=EPI_TURN_THREADS)
                their_epi = pipeline.NamedBarrier(
                    barrier_id=EPI_TURN_BARRIER_ID + 1 - mma_wg, num_threads=EPI_TURN_THREADS
                )
                if mma_wg == 1:
                    # The first tile is warpgroup 0's: skip its stages, give it the turn.
                    read_state.advance(k_tiles)
                    release_state.advance(k_tiles)
                    if cluster_id < num_items:
                        their_turn.arrive()
                        if cutlass.const_expr(self.shared_epi):
                            if warp_idx == store_warp:
                                their_epi.arrive()
            for item in cutlass.range(item_begin, num_items, item_step, unroll=1):
                tile_id, piece, pieces = self._item(item, dp, rem, splits)
                pid_mc, pid_n, l_idx, split = self._decode(tile_id, tiles_mc, tiles_n, num_l, raster)
                pid_m = pid_mc * cm + rank
                k_begin, k_cnt = self._k_range(split, per_split, k_tiles, piece, pieces)
                if cutlass.const_expr(self.grouping == "k"):
                    k_begin, k_cnt = self._group_k_range(table, l_idx)
                acc.fill(0.0)
                if cutlass.const_expr(self.promote_out):
                    # A chain goes into C at each interval's last K tile before
                    # chains_end (the tile's last chain goes out in the epilogue); the
                    # pieces of a cut tail tile never write C before their sum.
                    chains_end = k_cnt - 1
                    if cutlass.const_expr(self.split_tail):
                        if pieces > 1:
                            chains_end = 0
                # With `promote`, wgmma accumulates into acc_k, which is added into acc
                # (round-to-nearest fp32) every _PROMOTE_EVERY K tiles and at the end.
                mma_acc = acc
                if cutlass.const_expr(self.promote):
                    acc_k.fill(0.0)
                    mma_acc = acc_k
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                if cutlass.const_expr(self.pingpong):
                    my_turn.arrive_and_wait()
                for kt in cutlass.range(k_cnt, unroll=1):
                    ab_pipe.consumer_wait(read_state)
                    cute.nvgpu.warpgroup.fence()
                    for kb in cutlass.range(num_k_blocks, unroll_full=True):
                        kb_coord = (None, None, kb, read_state.index)
                        cute.gemm(tiled_mma, mma_acc, tCrA[kb_coord], tCrB[kb_coord], mma_acc)
                    cute.nvgpu.warpgroup.commit_group()
                    # Keep one wgmma group in flight; the previous stage is now free.
                    cute.nvgpu.warpgroup.wait_group(1)
                    if kt > 0:
                        ab_pipe.consumer_release(release_state)
                        release_state.advance()
                    read_state.advance()
                    if cutlass.const_expr(self.promote):
                        # Consumer warpgroups promote half an interval apart, so one
                        # keeps the tensor cores busy while the other drains.
                        if (kt + promote_phase) % _PROMOTE_EVERY == _PROMOTE_EVERY - 1:
                            cute.nvgpu.warpgroup.wait_group(0)
                            fence_tensor(acc_k)
                            acc.store(acc.load() + acc_k.load())
                            acc_k.fill(0.0)
                    if cutlass.const_expr(self.promote_out):
                        # Both warpgroups store this chain into C (the first plainly, later
                        # ones by reduce-add) and restart from zero; the tile's last chain
                        # goes out in the epilogue below.
                        if kt % OUTPUT_PROMOTE_EVERY == OUTPUT_PROMOTE_EVERY - 1 and kt < chains_end:
                            cute.nvgpu.warpgroup.wait_group(0)
                            fence_tensor(acc)
                            p_coord = (pid_m, pid_n, None, l_idx)
                            p_plain = tile_sub_tiles(tma_atom_c, mC, sC, self.tile_mnk, self.epi_tile, p_coord)
                            p_add = tile_sub_tiles(tma_atom_c_add, mC_add, sC, self.tile_mnk, self.epi_tile, p_coord)
                            if warp_idx == store_warp:
                                # The previous chain's adds must be complete before these.
                                cute.arch.cp_async_bulk_wait_group(0, read=False)
                            self._store_tile(
                                staging,
                                c_pipe,
                                warp_idx,
                                store_warp,
                                buf_base,
                                self.c_dtype,
                                (tma_atom_c, *p_plain),
                                (tma_atom_c_add, *p_add),
                                kt == OUTPUT_PROMOTE_EVERY - 1,
                            )
                            acc.fill(0.0)
                if cutlass.const_expr(self.pingpong):
                    # Every MMA of this tile is issued: the other warpgroup's K loop may
                    # start while this one drains and stores.
                    if item + num_clusters < num_items:
                        their_turn.arrive()
                cute.nvgpu.warpgroup.wait_group(0)
                if cutlass.const_expr(self.promote):
                    fence_tensor(acc_k)
                    acc.store(acc.load() + acc_k.load())
                if cutlass.const_expr(self.promote_out):
                    fence_tensor(acc)
                if k_cnt > 0:
                    ab_pipe.consumer_release(release_state)
                    release_state.advance()

                store_c = True
                if cutlass.const_expr(self.split_tail):
                    # Split-tail fixup (module docstring): pieces hand their partials to
                    # the tile's last piece, which adds them in piece order.
                    store_c = piece == pieces - 1
                    tile_elems = self.tile_mnk[0] * self.tile_mnk[1]
                    slots = rem * (splits - 1)
                    flags = cute.recast_ptr(mWs.iterator, dtype=cutlass.Int32)
                    partials = mWs.iterator + (slots + 31) // 32 * 32 + mma_tidx
                    slot = piece * rem + (tile_id - dp)
                    if piece < pieces - 1:
                        mine = cute.make_tensor(
                            partials + slot * tile_elems, cute.make_layout(cute.size(acc), stride=self.tile_threads)
                        )
                        for v in cutlass.range_constexpr(cute.size(acc)):
                            mine[v] = acc[v]
                        staging.epi_bar.arrive_and_wait()
                        if mma_tidx == 0:
                            cute.arch.fence_acq_rel_gpu()
                            cute.arch.store(flags + slot, cutlass.Int32(1), sem="release", scope="gpu")
                    else:
                        for earlier in cutlass.range(pieces - 1, unroll=1):
                            other = earlier * rem + (tile_id - dp)
                            if mma_tidx == 0:
                                spin_lock_ld_lt_relaxed_wait(flags + other, expected_val=1, scope="gpu")
                                cute.arch.fence_acq_rel_gpu()
                            staging.epi_bar.arrive_and_wait()
                            theirs = partials + other * tile_elems
                            for v in cutlass.range_constexpr(cute.size(acc)):
                                acc[v] = acc[v] + cute.arch.load(
                                    theirs + v * self.tile_threads, cutlass.Float32, cop="cg"
                                )

                if store_c:
                    # -------------------------------------------------------- epilogue
                    # plain store: batch z = split * L + l of C (the workspace when
                    # splits > 1); reduce-add: batch l (all splits add into one tile).
                    c_batch = split * num_l + l_idx
                    if cutlass.const_expr(self.reduce_add):
                        c_batch = l_idx
                    c_coord = (pid_m, pid_n, None, c_batch)
                    if cutlass.const_expr(self.gate_grad is None):
                        plain = tile_sub_tiles(tma_atom_c, mC, sC, self.tile_mnk, self.epi_tile, c_coord)
                    if cutlass.const_expr(self.promote_out):
                        # After earlier chains (K loop above) the last one reduce-adds, once
                        # their stores are complete.
                        chained = chains_end >= OUTPUT_PROMOTE_EVERY
                        add = tile_sub_tiles(tma_atom_c_add, mC_add, sC, self.tile_mnk, self.epi_tile, c_coord)
                        if warp_idx == store_warp:
                            cute.arch.cp_async_bulk_wait_group(0, read=False)
                        self._store_tile(
                            staging,
                            c_pipe,
                            warp_idx,
                            store_warp,
                            buf_base,
                            self.c_dtype,
                            (tma_atom_c_add, *add),
                            (tma_atom_c, *plain),
                            chained,
                        )
                    else:
                        if cutlass.const_expr(self.shared_epi):
                            my_epi.arrive_and_wait()
                        if cutlass.const_expr(self.gate_grad is not None):
                            # dh tile -> dg and du (d_gu's two planes), from the
                            # pre-activation in the second tensor, by 16-column groups.
                            self._store_gate_grad_tile(
                                staging,
                                gate_up_load,
                                c_pipe,
                                warp_idx,
                                store_warp,
                                (tma_atom_c, mC),
                                (tma_atom_aux, mAuxT),
                                sC_blocks,
                                epi_bars,
                                pid_m,
                                pid_n * (self.tile_mnk[1] // 16),
                                l_idx,
                                (item - cluster_id) // num_clusters,
                                self.gate_grad,
                            )
                        elif cutlass.const_expr(self.activation is not None):
                            # The pre-activation to C, h (half as wide: tile_n / 2 columns) to H.
                            h_tile = (self.tile_mnk[0], self.tile_mnk[1] // 2, self.tile_mnk[2])
                            h_parts = tile_sub_tiles(tma_atom_aux, mAuxT, sC, h_tile, self.epi_tile, c_coord)
                            self._store_gated_tile(
                                staging,
                                c_pipe,
                                warp_idx,
                                store_warp,
                                buf_base,
                                (tma_atom_c, *plain),
                                (tma_atom_aux, *h_parts),
                                self.activation,
                            )
                        else:
                            self._store_tile(
                                staging, c_pipe, warp_idx, store_warp, buf_base, self.c_dtype, (tma_atom_c, *plain)
                            )
                        if cutlass.const_expr(self.shared_epi):
                            # The ring is the other warpgroup's once these stores have read it.
                            if warp_idx == store_warp:
                                cute.arch.cp_async_bulk_wait_group(0, read=True)
                                if item + num_clusters < num_items:
                                    their_epi.arrive()
                if cutlass.const_expr(self.pingpong):
                    # Step over the stages of the other warpgroup's next tile.
                    read_state.advance(k_tiles)
                    release_state.advance(k_tiles)
            if warp_idx == store_warp:
                c_pipe.producer_tail()

    @cute.jit
    def _load_k_tile(self, a, b, k_coord, stage, bar, b_mask):
        """TMA loads of one K tile of A and of B into ring stage `stage`, completing `bar`.

        a, b: (atom, gmem K tiles, smem stages, streams) of each operand; a streamed
        operand's loads carry the L2 evict-first hint (module docstring). In a (cm, 1)
        cluster B is multicast to the CTAs of b_mask (None without a cluster; B is never
        streamed in one)."""
        self._load_operand(*a, k_coord, stage, bar, None)
        self._load_operand(*b, k_coord, stage, bar, b_mask)

    @cute.jit
    def _load_operand(self, atom, g_tiles, s_stages, streams, k_coord, stage, bar, mcast_mask):
        """One operand's TMA load of K tile k_coord into stage `stage` (_load_k_tile)."""
        if cutlass.const_expr(mcast_mask is not None):
            cute.copy(atom, g_tiles[(None, k_coord)], s_stages[(None, stage)], tma_bar_ptr=bar, mcast_mask=mcast_mask)
        elif streams:
            cute.copy(
                atom,
                g_tiles[(None, k_coord)],
                s_stages[(None, stage)],
                tma_bar_ptr=bar,
                cache_policy=cutlass.Int64(_L2_EVICT_FIRST),
            )
        else:
            cute.copy(atom, g_tiles[(None, k_coord)], s_stages[(None, stage)], tma_bar_ptr=bar)

    def _tma_blocks(self, op, m_blocks, blocks_staged):
        """(atom, TMA tensor) moving one (tile_m, 16, 2) block of m_blocks (M, 16, 2, F / 16,
        L) between global memory and one buffer of blocks_staged, by `op`."""
        one = cute.slice_(blocks_staged, (None, None, None, 0))
        return cute.nvgpu.cpasync.make_tiled_tma_atom(op, m_blocks, one, (self.tile_mnk[0], 16, 2))

    @staticmethod
    def _planes_view(mC):
        """d_gu [2, L, M, F] bf16, passed as C (M, F, 2L): dg in plane 0, du in plane 1 ->
        (M, 16, 2, F / 16, L), index (row, column in group, plane, group, batch)."""
        num_l = cute.size(mC, mode=[2]) // 2
        s_m, s_l = mC.stride[0], mC.stride[2]
        layout = cute.make_layout(
            (cute.size(mC, mode=[0]), 16, 2, cute.size(mC, mode=[1]) // 16, num_l),
            stride=(s_m, 1, num_l * s_l, 16, s_l),
        )
        return cute.make_tensor(mC.iterator, layout)

    @staticmethod
    def _interleaved_view(m_gu):
        """gu [L, M, 2F] bf16 (M, 2F, L), gate and up columns interleaved in blocks of
        contract.GATE_BLOCK -> the same (M, 16, 2, F / 16, L) index as _planes_view."""
        blk = contract.GATE_BLOCK
        s_m, s_l = m_gu.stride[0], m_gu.stride[2]
        layout = cute.make_layout(
            (cute.size(m_gu, mode=[0]), blk, 2, cute.size(m_gu, mode=[1]) // (2 * blk), cute.size(m_gu, mode=[2])),
            stride=(s_m, 1, blk, 2 * blk, s_l),
        )
        return cute.make_tensor(m_gu.iterator, layout)

    @staticmethod
    def _gate_up_rows(mB, d_ff):
        """The dgrad's B = W [L, 2F, d_in] read N-major as (d_in, 2F, L), its gate and up
        rows interleaved in blocks of contract.GATE_BLOCK (reference.interleave) -> two
        (d_in, F, L) views, the gate rows and the up rows, each K index k at row
        2 * GATE_BLOCK * (k // GATE_BLOCK) + k % GATE_BLOCK (+ GATE_BLOCK for up): no copy."""
        blk = contract.GATE_BLOCK
        s_k, s_l = mB.stride[1], mB.stride[2]
        layout = cute.make_layout(
            (cute.size(mB, mode=[0]), (blk, d_ff // blk), cute.size(mB, mode=[2])),
            stride=(1, (s_k, 2 * blk * s_k), s_l),
        )
        return cute.make_tensor(mB.iterator, layout), cute.make_tensor(mB.iterator + blk * s_k, layout)

    def _batches(self, mA, mC):
        """The batches the tiles walk: A's, or for a grouped "k" variant C's (one per group)."""
        if cutlass.const_expr(self.grouping == "k"):
            return cutlass.Int32(cute.size(mC, mode=[2]))
        return cutlass.Int32(cute.size(mA, mode=[2]))

    @cute.jit
    def _group_k_range(self, table, group):
        """(first K tile, K tile count) of `group` in a grouped "k" variant's table."""
        k_begin = cute.arch.load(table + group, cutlass.Int32)
        return k_begin, cute.arch.load(table + group + 1, cutlass.Int32) - k_begin

    @cute.jit
    def _item(self, item, dp, rem, splits):
        """Work item -> (tile id for _decode, piece, pieces): the item itself (one piece)
        without a split tail; with one, whole tiles below dp, then tail pieces piece-major."""
        tile_id, piece, pieces = item, 0, 1
        if cutlass.const_expr(self.split_tail):
            tail = cutlass.max(item - dp, 0)
            tile_id = cutlass.min(item, dp) + tail % rem
            piece = tail // rem
            pieces = cutlass.Int32(1) + (splits - 1) * cutlass.Int32(item >= dp)
        return tile_id, piece, pieces

    @cute.jit
    def _k_range(self, split, per_split, k_tiles, piece, pieces):
        """(first K tile, K tile count): the split's range, or with a split tail the
        piece's share of the whole K loop."""
        k_begin = split * per_split
        k_cnt = cutlass.max(cutlass.min(per_split, k_tiles - k_begin), 0)
        if cutlass.const_expr(self.split_tail):
            per_piece = (k_tiles + pieces - 1) // pieces
            k_begin = piece * per_piece
            k_cnt = cutlass.max(cutlass.min(per_piece, k_tiles - k_begin), 0)
        return k_begin, k_cnt

    @cute.jit
    def _decode(self, tile_id, tiles_m, tiles_n, num_l, raster):
        """Linear tile id -> (pid_m, pid_n, l, split). Tiles go in bands of `raster` rows
        of M tiles (0: one band of all of them), M fastest within a band, then N
        (jax_cake.contract's raster codes: 1 walks N first); batch, then split, vary
        slowest."""
        tiles_mn = tiles_m * tiles_n
        mn = tile_id % tiles_mn
        z = tile_id // tiles_mn
        band = tiles_m
        if raster > 0:
            band = cutlass.min(raster, tiles_m)
        band_tiles = band * tiles_n
        band_idx = mn // band_tiles
        first_m = band_idx * band
        rows = cutlass.min(band, tiles_m - first_m)
        within = mn - band_idx * band_tiles
        pid_m = first_m + within % rows
        pid_n = within // rows
        return pid_m, pid_n, z % num_l, z // num_l
