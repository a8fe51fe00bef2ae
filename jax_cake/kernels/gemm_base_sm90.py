"""What the sm_90a GEMM kernels of jax_cake (gemm_sm90: dense bf16; router_bf16x3_sm90:
fp32 by BF16x3) have in common.

Both are persistent, warp-specialized TMA + wgmma kernels of one shape: warpgroup 0 is the
producer (its warp 0 streams each K tile's operands by TMA into a ring of shared-memory
stages guarded by a PipelineTmaAsync); warpgroups 1..num_mma_wg are consumers, which issue
wgmma on a stage, release it, and store their tile through (tile_m, 32) sub-tile buffers
of shared memory by TMA (epilogue_sm90). `GemmSm90Base` holds that frame: the CTA's
threads and registers, the ring's depth, the shared-memory layouts and TMA atoms, the
CTA's shared storage, the ring pipeline and the sub-tile store loop. What the kernels do
inside it (operands, tile walk, the K loop and its accumulation) stays in each family's
module.

Imported only by the kernel modules (AOT); never at run time.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from jax_cake.kernels.epilogue_sm90 import gate_up_blocks, stage_gate_grad_sub_tile, stage_gated_sub_tile, stage_sub_tile

# Registers per thread after setmaxnreg (384-thread CTAs only): the producer needs few,
# the two consumer warpgroups hold the accumulators. 128 * 40 + 256 * 232 <= 64K
# registers. A 256-thread CTA (one consumer) already gets up to 255 registers: no
# reconfiguration.
PRODUCER_REGS = 40
CONSUMER_REGS = 232
# Where a consumer thread's accumulator alone takes at least ACC_REGS_WIDE registers (a
# ping-pong 128 x 208 tile: one warpgroup holds 128 x 208 fp32, 208 per thread), the
# producer keeps PRODUCER_REGS_WIDE and the consumers get CONSUMER_REGS_WIDE
# (128 * 24 + 256 * 240 <= 64K).
ACC_REGS_WIDE = 208
PRODUCER_REGS_WIDE = 24
CONSUMER_REGS_WIDE = 240
# Shared memory kept out of the ring and the epilogue buffers: mbarriers and the
# 1024-byte alignment padding of the buffers.
_SMEM_RESERVED = 2048
# Ring depth cap of both families.
_MAX_STAGES = 8
# Named barrier of a tile's consumer threads in the epilogue (0 is __syncthreads).
EPI_BARRIER_ID = 1


@dsl_user_op
def _fence_f32(x, *, loc=None, ip=None):
    """An empty volatile asm that reads and redefines one fp32 register.

    Reading wgmma accumulators must stay after `wgmma.wait_group`; nothing ties plain
    fp32 adds to that wait, so the compiler may hoist them above it, and ptxas then
    serializes every wgmma of the kernel (C7514). Routing each accumulator through a
    side-effecting asm after the wait pins the order (CUTLASS C++ does the same with
    warpgroup_fence_operand).
    """
    return cutlass.Float32(
        llvm.inline_asm(
            T.f32(),
            [cutlass.Float32(x).ir_value(loc=loc, ip=ip)],
            "",
            "=f,0",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc,
            ip=ip,
        )
    )


@cute.jit
def fence_tensor(t: cute.Tensor):
    """_fence_f32 on every element of t: call after a wait_group, before reading t."""
    for i in cutlass.range_constexpr(cute.size(t)):
        t[i] = _fence_f32(t[i])


class GemmSm90Base:
    """The frame of a warp-specialized sm_90a GEMM (module docstring).

    A subclass sets `tile_mnk` and calls `_init_cta` in its __init__, then `_ring_stages`
    once it knows its stage and epilogue bytes; its `epi_stage` is the number of
    epilogue buffers one tile's store loop cycles through.
    """

    # ------------------------------------------------------------ configuration
    def _init_cta(self, num_mma_wg: int, acc_regs: int = 0) -> None:
        """The CTA: one producer warpgroup and num_mma_wg consumer warpgroups; acc_regs,
        the fp32 accumulator registers one consumer thread holds, sizes the setmaxnreg
        split (ACC_REGS_WIDE)."""
        self.num_mma_wg = num_mma_wg
        wide = acc_regs >= ACC_REGS_WIDE
        self.producer_regs = PRODUCER_REGS_WIDE if wide else PRODUCER_REGS
        self.consumer_regs = CONSUMER_REGS_WIDE if wide else CONSUMER_REGS
        self.mma_threads = 128 * num_mma_wg
        self.threads = 128 + self.mma_threads
        # Epilogue sub-tile: all of the tile's rows x 32 columns per TMA store (16 where
        # the tile's width is no multiple of 32: 176, 208).
        self.epi_tile = (self.tile_mnk[0], 32 if self.tile_mnk[1] % 32 == 0 else 16)
        self.smem_capacity = utils.get_smem_capacity_in_bytes("sm_90")

    def _ring_stages(self, stage_bytes: int, epi_bytes: int) -> int:
        """Stages of the operand ring that fit next to epi_bytes of epilogue buffers."""
        return min(_MAX_STAGES, (self.smem_capacity - epi_bytes - _SMEM_RESERVED) // stage_bytes)

    def _fill_buffers(self, stages: int, stage_bytes: int, buffer_bytes: int, most: int) -> int:
        """Epilogue buffers of buffer_bytes (at most `most`) that fit in the shared memory
        `stages` ring stages leave."""
        return min(most, (self.smem_capacity - _SMEM_RESERVED - stages * stage_bytes) // buffer_bytes)

    # ---------------------------------------------------------------- host side
    def _smem_layouts(self, a_layout, a_dtype, b_layout, b_dtype, c_layout, c_dtype, stages: int, epi_buffers: int):
        """(A, B, C) staged shared-memory layouts: `stages` ring stages of the A and B
        tiles, epi_buffers epilogue sub-tile buffers."""
        return (
            sm90_utils.make_smem_layout_a(a_layout, self.tile_mnk, a_dtype, stages),
            sm90_utils.make_smem_layout_b(b_layout, self.tile_mnk, b_dtype, stages),
            sm90_utils.make_smem_layout_epi(c_dtype, c_layout, self.epi_tile, epi_buffers),
        )

    def _tma_load(self, m_x, staged, rows: int, multicast: int = 1):
        """(atom, TMA tensor) loading one (rows, tile_k) K tile of m_x into a stage of
        `staged`; with multicast > 1 each CTA of the cluster loads 1/multicast of it for
        all of them."""
        one = cute.slice_(staged, (None, None, 0))
        tile = (rows, self.tile_mnk[2])
        if multicast > 1:
            return cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp(), m_x, one, tile, num_multicast=multicast
            )
        return cute.nvgpu.cpasync.make_tiled_tma_atom(cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), m_x, one, tile)

    def _tma_store(self, op, m_c, epi_staged):
        """(atom, TMA tensor) storing one epilogue sub-tile buffer into m_c by `op`."""
        return cute.nvgpu.cpasync.make_tiled_tma_atom(op, m_c, cute.slice_(epi_staged, (None, None, 0)), self.epi_tile)

    @staticmethod
    def _shared_storage(stages: int, buffers: dict, epi_barriers: int = 0):
        """The CTA's shared memory: the ring's mbarriers (full and empty per stage), then
        epi_barriers more (the gradient epilogue's loads, one per buffer), then one
        1024-byte aligned buffer per entry of `buffers` (name -> (dtype, staged layout)),
        in order. Built as a dict: the fields depend on the variant (and the kernel
        modules' annotations are strings under `from __future__ import annotations`)."""
        fields = {"mbar": cute.struct.MemRange[cutlass.Int64, stages * 2]}
        if epi_barriers:
            fields["epi_mbar"] = cute.struct.MemRange[cutlass.Int64, epi_barriers]
        for name, (dtype, layout) in buffers.items():
            fields[name] = cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], 1024]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    # -------------------------------------------------------------- device side
    @staticmethod
    def _warp_roles():
        """(thread index, warp index made warp-uniform, warpgroup index)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        return tidx, warp_idx, warp_idx // 4

    @staticmethod
    def _prefetch_descriptors(*atoms) -> None:
        """Prefetch the TMA descriptors of `atoms` (from one warp)."""
        for atom in atoms:
            cute.nvgpu.cpasync.prefetch_descriptor(atom)

    @staticmethod
    def _stage_bytes(dtype, staged) -> int:
        """Bytes of one stage of a staged (.., .., stage) layout: one TMA transaction."""
        return cute.size_in_bytes(dtype, cute.slice_(staged, (None, None, 0)))

    @staticmethod
    def _smem_tensor(field, staged):
        """The staged tensor over one buffer of the shared storage."""
        return field.get_tensor(staged.outer, swizzle=staged.inner)

    def _ring(self, storage, stages: int, tx_count, consumer_warps: int, cm: int = 1):
        """The operand ring's PipelineTmaAsync. Full barrier: one producer arrive + the
        stage's TMA bytes (tx_count). Empty barrier: one arrive per consumer warp (lane 0
        signals in consumer_release); in a (cm, 1) cluster every consumer warp releases
        the stage in all cm CTAs (they all multicast into it), hence cm arrives per warp."""
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps * cm),
            tx_count=tx_count,
            cta_layout_vmnk=cute.make_layout((1, cm, 1, 1)),
            defer_sync=cm > 1,
        )
        if cm > 1:
            # Barrier init must be visible cluster-wide before any peer multicasts.
            pipeline.pipeline_init_arrive(cluster_shape_mn=(cm, 1), is_relaxed=True)
            pipeline.pipeline_init_wait(cluster_shape_mn=(cm, 1))
        return ring

    @staticmethod
    def _tma_part(atom, s_tensor, g_tensor, rank=0, cta_count: int = 1):
        """(smem stages, gmem K tiles) of one TMA load; with cta_count > 1, the slice
        `rank` this CTA loads (and multicasts) of the tile."""
        return cute.nvgpu.cpasync.tma_partition(
            atom, rank, cute.make_layout(cta_count), cute.group_modes(s_tensor, 0, 2), cute.group_modes(g_tensor, 0, 2)
        )

    def _producer_regs(self) -> None:
        """Give registers back to the consumers (two consumer warpgroups only)."""
        if cutlass.const_expr(self.num_mma_wg == 2):
            cute.arch.setmaxregister_decrease(self.producer_regs)

    def _consumer_regs(self) -> None:
        """Take the producer's registers (two consumer warpgroups only)."""
        if cutlass.const_expr(self.num_mma_wg == 2):
            cute.arch.setmaxregister_increase(self.consumer_regs)

    @cute.jit
    def _store_tile(self, staging, c_pipe, warp_idx, store_warp, buf_base, c_dtype, first, second=None, use_first=None):
        """One tile's epilogue: each sub-tile of the accumulator goes to buffer buf_base +
        (its index % epi_stage) and leaves by TMA store from warp store_warp.

        first, second: (atom, smem partition, gmem partition, sub-tile count, index ->
        coordinate layout) of tile_sub_tiles; with a second one (None: only first), each
        sub-tile goes out through first where use_first holds, else through second.
        c_dtype: convert to it while staging (None: the accumulator's dtype)."""
        atom, sD, gD, num, layout = first
        for epi_idx in cutlass.range_constexpr(num):
            buf = buf_base + epi_idx % self.epi_stage
            # Wait only for the store that last read this buffer (epi_stage stores ago):
            # the stores of a tile's last sub-tiles drain under the next tile's K loop.
            if warp_idx == store_warp:
                c_pipe.producer_acquire()
            stage_sub_tile(staging, epi_idx, buf, c_dtype)
            coord = layout.get_hier_coord(epi_idx)
            if warp_idx == store_warp:
                if cutlass.const_expr(second is None):
                    cute.copy(atom, sD[(None, buf)], gD[(None, coord)])
                else:
                    if use_first:
                        cute.copy(atom, sD[(None, buf)], gD[(None, coord)])
                    else:
                        cute.copy(second[0], second[1][(None, buf)], second[2][(None, coord)])
                c_pipe.producer_commit()

    @cute.jit
    def _store_gated_tile(self, staging, c_pipe, warp_idx, store_warp, buf_base, gu, h, activation: cutlass.Constexpr):
        """One tile's gated epilogue: for each pair of accumulator sub-tiles, both go to C
        as bf16 (the pre-activation) and then the h sub-tile made from them
        (stage_gated_sub_tile) to H; the three stores take the ring's buffers in turn.

        gu, h: (atom, smem partition, gmem partition, sub-tile count, index -> coordinate
        layout) of tile_sub_tiles for C's tile and for H's (half as wide)."""
        atom, sD, gD, num, layout = gu
        h_atom, h_sD, h_gD, _, h_layout = h
        for pair in cutlass.range_constexpr(num // 2):
            for j in cutlass.range_constexpr(3):
                buf = buf_base + (3 * pair + j) % self.epi_stage
                if warp_idx == store_warp:
                    c_pipe.producer_acquire()
                if cutlass.const_expr(j < 2):
                    epi_idx = 2 * pair + j
                    stage_sub_tile(staging, epi_idx, buf, cutlass.BFloat16)
                    coord = layout.get_hier_coord(epi_idx)
                    if warp_idx == store_warp:
                        cute.copy(atom, sD[(None, buf)], gD[(None, coord)])
                        c_pipe.producer_commit()
                else:
                    stage_gated_sub_tile(staging, pair, buf, activation)
                    coord = h_layout.get_hier_coord(pair)
                    if warp_idx == store_warp:
                        cute.copy(h_atom, h_sD[(None, buf)], h_gD[(None, coord)])
                        c_pipe.producer_commit()

    @cute.jit
    def _store_gate_grad_tile(
        self,
        staging,
        load,
        c_pipe,
        warp_idx,
        store_warp,
        d_store,
        gu_load,
        s_blocks,
        bars,
        row_tile,
        group0,
        l_idx,
        tile_seq,
        activation: cutlass.Constexpr,
    ):
        """One tile's activation-gradient epilogue on a drained ring of epi_stage (>= 2)
        buffers: the accumulator is a dh tile (M tile row_tile, d_ff columns from 16-column
        group group0 on, batch l_idx); each 16-column group of it makes one (tile_m, 16, 2)
        block of d_gu (dg and du) from the same block of the pre-activation gu.

        The store warp TMA-loads the gu blocks of the first epi_stage groups, one per
        buffer, each completing mbarrier bars + buffer; each group then waits for its block,
        turns it into d_gu's in place (stage_gate_grad_sub_tile) and leaves by TMA store,
        after which the buffer the previous group's store read is refilled with the block
        epi_stage - 1 groups ahead: the loads run under the math and the stores.

        d_store, gu_load: (TMA atom, (M, 16, 2, F / 16, L) TMA tensor) of d_gu and of gu;
        s_blocks: the ring as (tile_m, 16, 2, buffer). tile_seq: this tile's index among the
        CTA's epilogues on the ring, which sets the mbarriers' phases: every epilogue on the
        ring must be one of these, each issuing the same, static, number of loads per buffer
        (no partial, skipped or other epilogue: GemmSm90 allows the gradient store only on
        the ping-pong schedule, where every tile stores), else a wait misses its phase and
        hangs."""
        store_atom, m_d = d_store
        load_atom, m_gu = gu_load
        num = self.tile_mnk[1] // 16
        ring = self.epi_stage
        if warp_idx == store_warp:
            for j in cutlass.range_constexpr(min(ring, num)):
                self._load_gate_up_block(load_atom, m_gu, s_blocks, bars, j, row_tile, group0 + j, l_idx)
        for idx in cutlass.range_constexpr(num):
            buf = idx % ring
            uses = (num - buf + ring - 1) // ring
            cute.arch.mbarrier_wait(bars + buf, (tile_seq * uses + idx // ring) % 2)
            stage_gate_grad_sub_tile(staging, load, idx // 2, idx % 2, buf, activation)
            if warp_idx == store_warp:
                sD, gD = gate_up_blocks(store_atom, m_d, s_blocks, self.tile_mnk[0], group0 + idx, l_idx)
                cute.copy(store_atom, sD[(None, buf)], gD[(None, (row_tile, 0, 0))])
                c_pipe.producer_commit()
                if cutlass.const_expr(idx >= 1 and idx - 1 + ring < num):
                    # The previous group's store has read its buffer: refill it.
                    cute.arch.cp_async_bulk_wait_group(1, read=True)
                    self._load_gate_up_block(
                        load_atom, m_gu, s_blocks, bars, (idx - 1) % ring, row_tile, group0 + idx - 1 + ring, l_idx
                    )

    @cute.jit
    def _load_gate_up_block(self, load_atom, m_gu, s_blocks, bars, buf: cutlass.Constexpr, row_tile, group, l_idx):
        """TMA-load gu's (tile_m, 16, 2) block at (row_tile, group, l_idx) into buffer buf,
        completing mbarrier bars + buf (from the store warp)."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(bars + buf, self.tile_mnk[0] * 32 * 2)
        sS, gS = gate_up_blocks(load_atom, m_gu, s_blocks, self.tile_mnk[0], group, l_idx)
        cute.copy(load_atom, gS[(None, (row_tile, 0, 0))], sS[(None, buf)], tma_bar_ptr=bars + buf)
