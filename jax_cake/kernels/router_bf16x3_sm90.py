"""Fused FP32 GEMM by BF16x3 emulation for sm_90a (Hopper), written in CuTe DSL.

C[M, N, s] = sum_k A[M, K] * B[N, K] with fp32 logical operands and fp32 C, where every
product is done as three bf16 wgmma products into fp32:

    a = a_hi + a_lo,  a_hi = bf16_rn(a),  a_lo = bf16_rn(a - f32(a_hi))
    a . b ~= a_hi b_hi + a_hi b_lo + a_lo b_hi        (a_lo b_lo, ~2^-18 relative, dropped)

This is the router GEMM of jax_cake (logits = x w^T and both gradients), the same
algorithm as XLA's BF16_BF16_F32_X3 but fused. Per operand (router_variants.PRESPLIT):
the activation x is read as fp32 and split on chip; w and g, small and re-read by many
CTAs, arrive as bf16 (hi, lo) pairs split once per call by the caller and are TMA-loaded
straight into shared memory.

Persistent: at most one CTA per SM (max_ctas), each walking linear tiles bid, bid + grid,
... of the (split, M, N) tile space (fwd N fastest, the others M fastest, so neighbouring
CTAs share an operand tile in L2). The rings and their barrier phases carry over from
tile to tile: loads of the next tile start while a tile's epilogue runs, and its TMA
stores drain under the next K loop.

CTA layouts (warp-specialized; two MMA warpgroups of 64 rows each at tile_m = 128):
  fwd (A in registers): warpgroup 0, warp 0 streams each K tile's fp32 A and bf16 B
     hi/lo tiles into one ring (PipelineTmaAsync; empty = lane 0 of each MMA warp). Each
     MMA thread loads its wgmma-A fragment of the fp32 tile, splits it in registers
     (two buffers, so one wgmma group stays in flight while the next tile is split) and
     issues the wgmma with A from registers (RS).
  dgrad / wgrad (split into shared memory): the transform warpgroups (two when an
     operand is split on chip, else one) split fp32 stages from an fp32 ring into a bf16
     ring laid out as a TMA-fed bf16 GEMM wants it (same swizzled layouts and
     majorness), run `fence.proxy.async.shared::cta` and arrive on the bf16 full
     barrier; warp 0 also TMA-loads the pre-split operands' hi/lo tiles into the same
     bf16 stage (its arrive-with-expected-bytes is one more arrival). The MMA warpgroups
     issue SS wgmma from the bf16 ring, keeping one group in flight.
  MMA order per K tile: A_lo.B_hi, A_hi.B_lo, then A_hi.B_hi, so the small terms are
     added while the chain is small. Two-level accumulation: every _PROMOTE_EVERY K tiles
     a warpgroup drains its chain (wait_group 0) and adds it into an fp32 register total
     with FADD; the next chain starts with ACCUMULATE = False. wgmma's fp32 accumulation
     loses precision along a chain (about 1.85e-8 relative per k16 wgmma on the H200: one
     chain over K = 16384 gave 5.7e-5), so chains stay short. The two warpgroups' drains
     are spread over the interval. Two 64 x tile_n accumulators per thread limit tile_n
     to 128. Epilogue: registers -> swizzled smem (2 buffers) -> TMA store.

Split-K: a tile's split s reduces a contiguous range of K tiles and stores into batch s
of C, so with splits > 1 C is the fp32 workspace [splits, M, N] and a separate pass sums
it in split order (bitwise reproducible). A split with no K tile writes zeros.

Ragged edges: TMA loads zero-fill out-of-bounds rows and the K tail (zeros split into
zero hi and lo), TMA stores clip out-of-bounds rows/columns of C.

Imported only by jax_cake/build.py (AOT); never at run time.
"""

from __future__ import annotations

import os
import pathlib
import time

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils

from jax_cake.kernels import c_table
from jax_cake.kernels.gemm_sm90 import _fence_tensor
from jax_cake.planner.router_variants import VARIANTS, RouterVariant

# Registers per thread after setmaxnreg, by the number of transform warpgroups (with two
# MMA warpgroups): (transform, MMA). A transform thread holds _SPLIT_GROUP 4-element fp32
# vectors in flight plus addresses (ptxas used ~70); each MMA warpgroup holds two
# 64 x tile_n fp32 accumulators (the wgmma chain and the promoted total: tile_n = 128
# registers per thread) plus descriptors and the epilogue (SASS uses R0-R135 at
# tile_n = 128, no local memory). 128 * 120 + 256 * 184 = 62464 and
# 256 * 88 + 256 * 168 = 65536, both <= 65536.
_REGS = {1: (120, 184), 2: (88, 168)}
# fwd (A in registers): one TMA-only warpgroup; an MMA thread also holds its fp32 x
# fragment and the bf16 hi / lo fragments of one K tile. 128 * 40 + 256 * 232 = 64512.
_REGS_RS = (40, 232)
# Two-level accumulation interval in K tiles (32 each). wgmma's fp32 accumulation in the
# tensor core loses precision along one chain (measured on the H200: about 1.85e-8
# relative per k16 wgmma in the chain, i.e. 1.5e-5 at K = 4096 and 5.7e-5 at
# K = 16384 with all three products in one chain). Every 2 K tiles: chains of 12 wgmma
# (64 K elements): 4.36e-6 to 4.45e-6 on the H200 (docs/ROUTER_NOTES.md). Every 4 tiles
# measured the same error and fwd only 0.7 % faster (H200, 2026-11-29): the drains are
# not what bounds the loop, so the shorter chain stays. The warpgroups' drains are
# spread over the interval, so the other warpgroup's wgmma cover each one.
_PROMOTE_EVERY = 2
# Passes (one 16-byte load each) whose loads are issued back to back in the split.
_SPLIT_GROUP = 8


def _split_rn(v, f32, bf16):
    """(hi as fp32, lo as bf16) of an fp32 vector: hi = bf16 round-to-nearest-even of v.

    hi is rounded in integer arithmetic (full rate) instead of single-element F2F
    conversions (quarter rate): keep the top 16 bits of v + 0x7FFF + lsb. hi as fp32 is
    exact, so v - hi is exact and only lo takes one (packed) conversion.
    """
    bits = v.bitcast(cutlass.Uint32)
    lsb = (bits // cutlass.Uint32(0x10000)) & cutlass.Uint32(1)
    rounded = bits + cutlass.Uint32(0x7FFF) + lsb
    hi32 = (rounded & cutlass.Uint32(0xFFFF0000)).bitcast(f32).reshape(v.shape)
    return hi32, (v - hi32).to(bf16)


def _stage_bytes(dtype, staged):
    """Bytes of one stage of a staged (.., .., stage) shared-memory layout: a TMA transaction."""
    return cute.size_in_bytes(dtype, cute.slice_(staged, (None, None, 0)))


# Named barrier ids (0 is __syncthreads).
_EPI_BARRIER_ID = 1


class RouterBf16x3Sm90:
    """One compiled BF16x3 GEMM program (see module docstring). Configure with a RouterVariant."""

    def __init__(self, variant: RouterVariant):
        if variant.tile_m not in (64, 128):
            raise ValueError(f"tile_m must be 64 or 128, got {variant.tile_m}")
        if variant.tile_n not in (64, 128):
            # Two 64 x tile_n fp32 accumulators per MMA thread (wgmma chain + total):
            # 256 registers at tile_n = 256, over the 232 a consumer can get.
            raise ValueError(f"tile_n must be 64 or 128, got {variant.tile_n}")
        if variant.tile_k != 32:
            raise ValueError(f"tile_k must be 32 (one 128-byte fp32 row per K-major stage), got {variant.tile_k}")
        # The on-chip split's thread mapping (_split_tile): K-major tiles take
        # transform_threads / 8 rows per pass, M/N-major tiles 128 rows per pass.
        for major, rows, what in (
            (variant.a_major, variant.tile_m, "tile_m"),
            (variant.b_major, variant.tile_n, "tile_n"),
        ):
            if major != "k" and rows % 128 != 0:
                raise ValueError(f"{what} must be a multiple of 128 for an M/N-major operand, got {rows}")
        self.variant = variant
        self.a_pre = variant.a_presplit
        self.b_pre = variant.b_presplit
        self.n_first = variant.program == "fwd"
        self.tile_mnk = (variant.tile_m, variant.tile_n, variant.tile_k)
        self.acc_dtype = cutlass.Float32
        self.io_dtype = cutlass.Float32
        self.mma_dtype = cutlass.BFloat16
        self.num_mma_wg = variant.tile_m // 64
        self.mma_threads = 128 * self.num_mma_wg
        self.transform_wgs = variant.transform_wgs
        self.transform_threads = 128 * self.transform_wgs
        self.threads = self.transform_threads + self.mma_threads
        self.epi_stage = 2
        self.smem_capacity = utils.get_smem_capacity_in_bytes("sm_90")
        tm, tn, tk = self.tile_mnk
        # The fp32 ring holds only the operands split on chip; pre-split operands go by
        # TMA straight into the bf16 ring.
        f32_stage_bytes = ((0 if self.a_pre else tm) + (0 if self.b_pre else tn)) * tk * 4
        bf16_stage_bytes = (tm + tn) * tk * 2 * 2  # hi and lo
        self.has_f32 = f32_stage_bytes > 0
        self.has_pre = self.a_pre or self.b_pre
        self.a_rs = variant.a_in_registers
        if self.a_rs:
            # One ring: the fp32 A tile and the pre-split B tiles of a K tile share a stage
            # (one TMA barrier), released once both MMA warpgroups' wgmma are done.
            if self.a_pre or not self.b_pre or variant.a_major != "k":
                raise ValueError("A in registers needs an on-chip-split, K-major A and a pre-split B")
            self.epi_tile = (tm, 32)
            epi_bytes = tm * 32 * 4 * self.epi_stage
            stage_bytes = tm * tk * 4 + tn * tk * 2 * 2
            budget = self.smem_capacity - 2048
            self.s32 = self.s16 = min(8, (budget - epi_bytes) // stage_bytes)
            if self.s32 < 2:
                raise ValueError(f"tile {self.tile_mnk} does not fit two stages in shared memory")
            self.smem_bytes = self.s32 * stage_bytes + epi_bytes
            return
        # Epilogue sub-tile: all rows x 32 columns per TMA store. The bf16 ring gets 4 stages
        # when a pre-split operand's TMA loads land in it (they are issued when a stage
        # frees, so the ring depth is their lookahead), else 2; fewer if they do not fit.
        self.epi_tile = (tm, 32)
        self.s32 = 2 if self.has_f32 else 0
        self.s16 = 4 if self.has_pre else 2
        budget = self.smem_capacity - 2048  # mbarriers + alignment padding
        while True:
            epi_bytes = self.epi_tile[0] * self.epi_tile[1] * 4 * self.epi_stage
            total = self.s32 * f32_stage_bytes + self.s16 * bf16_stage_bytes + epi_bytes
            if total <= budget:
                break
            if self.s16 > 2:
                self.s16 -= 1
                continue
            if self.epi_tile[1] > 16:
                self.epi_tile = (tm, 16)
                continue
            raise ValueError(f"tile {self.tile_mnk} needs {total} bytes of shared memory, over {budget}")
        # Spend what is left on deeper prefetch: the fp32 ring if there is one (the TMA runs
        # further ahead of the split), else the bf16 ring.
        if self.has_f32:
            while total + f32_stage_bytes <= budget and self.s32 < 4:
                self.s32 += 1
                total += f32_stage_bytes
        else:
            while total + bf16_stage_bytes <= budget and self.s16 < 6:
                self.s16 += 1
                total += bf16_stage_bytes
        self.smem_bytes = total

    # ------------------------------------------------------------------ host side
    def _operand_tma(self, m_hi, m_lo, pre, make_layout, layout_enum, rows):
        """(fp32 staged layout or None, atom, tensor, atom_lo, tensor_lo) for one operand.

        An operand split on chip gets one TMA into the fp32 ring (its second atom repeats
        the first and is not used); a pre-split one gets two TMAs (hi, lo) straight into
        the bf16 ring.
        """
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tk = self.tile_mnk[2]
        if pre:
            one16 = cute.slice_(make_layout(layout_enum, self.tile_mnk, self.mma_dtype, 1), (None, None, 0))
            atom_hi, t_hi = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, m_hi, one16, (rows, tk))
            atom_lo, t_lo = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, m_lo, one16, (rows, tk))
            return None, atom_hi, t_hi, atom_lo, t_lo
        staged32 = make_layout(layout_enum, self.tile_mnk, self.io_dtype, self.s32)
        one32 = cute.slice_(staged32, (None, None, 0))
        atom, t = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, m_hi, one32, (rows, tk))
        return staged32, atom, t, atom, t

    def _shared_storage(self, a32_staged, b32_staged, a16_staged, b16_staged, epi_staged):
        """The CTA's shared memory: barriers, the fp32 ring of on-chip-split operands, the bf16 ring, C."""
        f32, bf16 = self.io_dtype, self.mma_dtype

        def buf(dtype, layout):
            return cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], 1024]

        # Built as a dict: the fields depend on the variant (and this module's annotations
        # are strings under `from __future__ import annotations`).
        fields = {
            "mbar32": cute.struct.MemRange[cutlass.Int64, max(self.s32, 1) * 2],
            "mbar16": cute.struct.MemRange[cutlass.Int64, self.s16 * 2],
        }
        if not self.a_pre:
            fields["sA32"] = buf(f32, a32_staged)
        if not self.b_pre:
            fields["sB32"] = buf(f32, b32_staged)
        if not self.a_rs:  # A in registers: its bf16 parts never touch shared memory
            fields["sAhi"] = buf(bf16, a16_staged)
            fields["sAlo"] = buf(bf16, a16_staged)
        fields["sBhi"] = buf(bf16, b16_staged)
        fields["sBlo"] = buf(bf16, b16_staged)
        fields["sC"] = buf(f32, epi_staged)
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,
        mA_lo: cute.Tensor,
        mB: cute.Tensor,
        mB_lo: cute.Tensor,
        mC: cute.Tensor,
        splits: cutlass.Int32,
        max_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """mA, mB: fp32 operands split on chip, or the bf16 hi parts of pre-split ones (then
        mA_lo / mB_lo are their lo parts; for an on-chip operand its lo argument is the
        same fp32 tensor again and is not read)."""
        a_layout = utils.LayoutEnum.from_tensor(mA)
        b_layout = utils.LayoutEnum.from_tensor(mB)
        c_layout = utils.LayoutEnum.from_tensor(mC)
        self.c_layout = c_layout
        self.a_k_major = a_layout.is_k_major_a()
        self.b_k_major = b_layout.is_k_major_b()

        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.mma_dtype,
            self.mma_dtype,
            a_layout.sm90_mma_major_mode(),
            b_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            (self.num_mma_wg, 1, 1),
            tiler_mn=(64, self.tile_mnk[1]),
            a_source=cute.nvgpu.warpgroup.OperandSource.RMEM if self.a_rs else cute.nvgpu.warpgroup.OperandSource.SMEM,
        )
        tm, tn, tk = self.tile_mnk
        # bf16 stages (wgmma source), same majorness as the source operand.
        a16_staged = sm90_utils.make_smem_layout_a(a_layout, self.tile_mnk, self.mma_dtype, self.s16)
        b16_staged = sm90_utils.make_smem_layout_b(b_layout, self.tile_mnk, self.mma_dtype, self.s16)
        epi_staged = sm90_utils.make_smem_layout_epi(self.io_dtype, c_layout, self.epi_tile, self.epi_stage)
        epi_one = cute.slice_(epi_staged, (None, None, 0))

        a32_staged, tma_atom_a, tma_a, tma_atom_a_lo, tma_a_lo = self._operand_tma(
            mA, mA_lo, self.a_pre, sm90_utils.make_smem_layout_a, a_layout, tm
        )
        b32_staged, tma_atom_b, tma_b, tma_atom_b_lo, tma_b_lo = self._operand_tma(
            mB, mB_lo, self.b_pre, sm90_utils.make_smem_layout_b, b_layout, tn
        )
        tma_atom_c, tma_c = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mC, epi_one, self.epi_tile
        )
        # Placeholders keep the kernel signature fixed for operands without an fp32 ring.
        if cutlass.const_expr(a32_staged is None):
            a32_staged = a16_staged
        if cutlass.const_expr(b32_staged is None):
            b32_staged = b16_staged

        self.shared_storage = self._shared_storage(a32_staged, b32_staged, a16_staged, b16_staged, epi_staged)

        m = cute.size(mC, mode=[0])
        n = cute.size(mC, mode=[1])
        num_tiles = cutlass.Int32((m + tm - 1) // tm) * cutlass.Int32((n + tn - 1) // tn) * splits
        # Persistent: at most max_ctas CTAs (one per SM), each walking tiles (kernel).
        self.kernel(
            tma_atom_a,
            tma_a,
            tma_atom_a_lo,
            tma_a_lo,
            tma_atom_b,
            tma_b,
            tma_atom_b_lo,
            tma_b_lo,
            tma_atom_c,
            tma_c,
            tiled_mma,
            a32_staged,
            b32_staged,
            a16_staged,
            b16_staged,
            epi_staged,
            splits,
        ).launch(
            grid=[cutlass.max(cutlass.min(num_tiles, max_ctas), 1), 1, 1],
            block=[self.threads, 1, 1],
            stream=stream,
        )

    # ---------------------------------------------------------------- device side
    @staticmethod
    def _tma_part(atom, s_tensor, g_tensor):
        """(smem stages, gmem K tiles) of one TMA load, the CTA's whole tile per copy."""
        return cute.nvgpu.cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(s_tensor, 0, 2), cute.group_modes(g_tensor, 0, 2)
        )

    @staticmethod
    def _load_f32(pipe32, state, k_coord, a32_load, b32_load):
        """TMA of K tile k_coord of the on-chip-split operands into fp32 stage state.index.

        Plain Python (traced inline): a32_load / b32_load are (atom, gmem K tiles, smem
        stages), or None for an operand that arrives pre-split.
        """
        pipe32.producer_acquire(state)
        bar = pipe32.producer_get_barrier(state)
        for load in (a32_load, b32_load):
            if load is not None:
                atom, g_tiles, s_stages = load
                cute.copy(atom, g_tiles[(None, k_coord)], s_stages[(None, state.index)], tma_bar_ptr=bar)
        pipe32.producer_commit(state)

    @cute.jit
    def _split_tile(
        self,
        src32: cute.Tensor,
        dst_hi: cute.Tensor,
        dst_lo: cute.Tensor,
        k_major: cutlass.Constexpr,
        tid: cutlass.Int32,
    ):
        """dst_hi, dst_lo = bf16 split of src32, one (rows, tile_k) tile, by the transform threads.

        Both sides are indexed by the same logical (row, k) coordinates through the same
        thread/value mapping, so any swizzle on either side is handled by the layouts.
        Each thread moves 4 elements contiguous in the operand's major mode per pass
        (one 16-byte load, two 8-byte stores).
        """
        t = self.transform_threads
        if cutlass.const_expr(k_major):  # 8 threads x 4 values along K (32), t / 8 rows
            thr_layout = cute.make_layout((t // 8, 8), stride=(8, 1))
            val_layout = cute.make_layout((1, 4))
        else:  # 32 threads x 4 values along M/N (128), t / 32 along K
            thr_layout = cute.make_layout((32, t // 32), stride=(1, 32))
            val_layout = cute.make_layout((4, 1))
        ld_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.io_dtype, num_bits_per_copy=128)
        st_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.mma_dtype, num_bits_per_copy=64)
        tiled_ld = cute.make_tiled_copy_tv(ld_atom, thr_layout, val_layout)
        tiled_st = cute.make_tiled_copy_tv(st_atom, thr_layout, val_layout)
        thr_ld = tiled_ld.get_slice(tid)
        thr_st = tiled_st.get_slice(tid)
        tS = thr_ld.partition_S(src32)
        tHi = thr_st.partition_D(dst_hi)
        tLo = thr_st.partition_D(dst_lo)
        n_p = cute.size(tS, mode=[1])
        n_q = cute.size(tS, mode=[2])
        n_pass = n_p * n_q
        rhi = cute.make_fragment_like(tHi[(None, 0, 0)])
        rlo = cute.make_fragment_like(tLo[(None, 0, 0)])
        # Loads of a group of passes first, then their converts and stores: the compiler
        # cannot move a shared-memory load above a shared-memory store it cannot prove
        # disjoint, so without grouping every pass would wait out a full load latency.
        for g0 in cutlass.range_constexpr(0, n_pass, _SPLIT_GROUP):
            frags = []
            for j in cutlass.range_constexpr(min(_SPLIT_GROUP, n_pass - g0)):
                i = g0 + j
                r32 = cute.make_fragment_like(tS[(None, 0, 0)])
                cute.copy(tiled_ld, tS[(None, i % n_p, i // n_p)], r32)
                frags.append(r32)
            for j in cutlass.range_constexpr(min(_SPLIT_GROUP, n_pass - g0)):
                i = g0 + j
                hi32, lo = _split_rn(frags[j].load(), self.io_dtype, self.mma_dtype)
                rhi.store(hi32.to(self.mma_dtype))  # exact: hi32 is a bf16 value (packed cvt)
                rlo.store(lo)
                cute.copy(tiled_st, rhi, tHi[(None, i % n_p, i // n_p)])
                cute.copy(tiled_st, rlo, tLo[(None, i % n_p, i // n_p)])

    def _tile_coords(self, tile, tiles_m, tiles_n, k_tiles, per_split):
        """(pid_m, pid_n, split, k_begin, k_cnt) of linear tile index `tile` (plain Python,
        traced inline). fwd walks N fastest, so the E / tile_n CTAs that share an x tile
        run side by side and x comes from HBM once; dgrad / wgrad walk M fastest, so
        neighbouring CTAs share the B tile (w in dgrad, x in wgrad) in L2. A split with no
        K tile gets k_cnt = 0 and stores zeros."""
        if self.n_first:
            pid_n = tile % tiles_n
            rest = tile // tiles_n
            pid_m = rest % tiles_m
        else:
            pid_m = tile % tiles_m
            rest = tile // tiles_m
            pid_n = rest % tiles_n
        split = rest // (tiles_m if self.n_first else tiles_n)
        k_begin = split * per_split
        k_cnt = cutlass.max(cutlass.min(per_split, k_tiles - k_begin), 0)
        return pid_m, pid_n, split, k_begin, k_cnt

    def _ab_tiles(self, mA, mA_lo, mB, mB_lo, pid_m, pid_n):
        """gA, gA_lo (bM, bK, k tiles) and gB, gB_lo (bN, bK, k tiles); unit batch mode."""
        t = self.tile_mnk
        return (
            cute.local_tile(mA, t, (pid_m, pid_n, None, 0), proj=(1, None, 1)),
            cute.local_tile(mA_lo, t, (pid_m, pid_n, None, 0), proj=(1, None, 1)),
            cute.local_tile(mB, t, (pid_m, pid_n, None, 0), proj=(None, 1, 1)),
            cute.local_tile(mB_lo, t, (pid_m, pid_n, None, 0), proj=(None, 1, 1)),
        )

    @cute.kernel
    def kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_a_lo: cute.CopyAtom,
        mA_lo: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_atom_b_lo: cute.CopyAtom,
        mB_lo: cute.Tensor,
        tma_atom_c: cute.CopyAtom,
        mC: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a32_staged: cute.ComposedLayout,
        b32_staged: cute.ComposedLayout,
        a16_staged: cute.ComposedLayout,
        b16_staged: cute.ComposedLayout,
        epi_staged: cute.ComposedLayout,
        splits: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = warp_idx // 4
        lane = cute.arch.lane_idx()

        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)
            if cutlass.const_expr(self.a_pre):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a_lo)
            if cutlass.const_expr(self.b_pre):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b_lo)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_c)

        # Persistent: CTA `bid` takes tiles bid, bid + grid, ... of the (split, M, N) tile
        # space; the rings and their phases carry over from one tile to the next, so the
        # loads of a tile start while the previous tile's epilogue runs.
        tm, tn, tk = self.tile_mnk
        tiles_m = cutlass.Int32((cute.size(mC, mode=[0]) + tm - 1) // tm)
        tiles_n = cutlass.Int32((cute.size(mC, mode=[1]) + tn - 1) // tn)
        num_tiles = tiles_m * tiles_n * splits
        k_tiles = cutlass.Int32((cute.size(mA, mode=[1]) + tk - 1) // tk)
        per_split = (k_tiles + splits - 1) // splits
        bid, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        tile_args = (tiles_m, tiles_n, k_tiles, per_split)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        pipe = pipe32 = pipe16 = None
        tx16 = 0
        if cutlass.const_expr(self.a_rs):
            # One ring (A in registers): full = 1 producer arrive + the fp32 A and bf16 B
            # hi/lo TMA bytes; empty = lane 0 of every MMA warp, once its wgmma are done.
            tx = _stage_bytes(self.io_dtype, a32_staged)
            tx += 2 * _stage_bytes(self.mma_dtype, b16_staged)
            pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar32.data_ptr(),
                num_stages=self.s32,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_threads // 32),
                tx_count=tx,
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            )
            sAhi = sAlo = None
        else:
            # fp32 ring (operands split on chip): full = 1 producer arrive (warp 0, elected) +
            # TMA bytes; empty = one arrive per transform warp (lane 0 signals in
            # PipelineTmaAsync.consumer_release).
            tx32 = 0
            if cutlass.const_expr(not self.a_pre):
                tx32 += _stage_bytes(self.io_dtype, a32_staged)
            if cutlass.const_expr(not self.b_pre):
                tx32 += _stage_bytes(self.io_dtype, b32_staged)
            if cutlass.const_expr(self.has_f32):
                pipe32 = pipeline.PipelineTmaAsync.create(
                    barrier_storage=storage.mbar32.data_ptr(),
                    num_stages=self.s32,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                    consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.transform_threads // 32),
                    tx_count=tx32,
                    cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
                )
            # bf16 ring: full = one arrive per transform thread (each after its own proxy
            # fence), plus, with pre-split operands, warp 0's arrive-with-expected-bytes for
            # their TMA loads into the stage; empty = one arrive per MMA warp (lane 0 only,
            # see the release below).
            if cutlass.const_expr(self.a_pre):
                tx16 += 2 * _stage_bytes(self.mma_dtype, a16_staged)
            if cutlass.const_expr(self.b_pre):
                tx16 += 2 * _stage_bytes(self.mma_dtype, b16_staged)
            pipe16 = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar16.data_ptr(),
                num_stages=self.s16,
                producer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, self.transform_threads + (1 if self.has_pre else 0)
                ),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_threads // 32),
            )
            sAhi = storage.sAhi.get_tensor(a16_staged.outer, swizzle=a16_staged.inner)
            sAlo = storage.sAlo.get_tensor(a16_staged.outer, swizzle=a16_staged.inner)
        sBhi = storage.sBhi.get_tensor(b16_staged.outer, swizzle=b16_staged.inner)
        sBlo = storage.sBlo.get_tensor(b16_staged.outer, swizzle=b16_staged.inner)
        sC = storage.sC.get_tensor(epi_staged.outer, swizzle=epi_staged.inner)

        transform_regs, mma_regs = _REGS_RS if self.a_rs else _REGS[self.transform_wgs]
        if wg_idx < self.transform_wgs:
            # ------------------------------------------------------- load + transform
            if cutlass.const_expr(self.num_mma_wg == 2):
                cute.arch.setmaxregister_decrease(transform_regs)
            part = self._tma_part
            if cutlass.const_expr(self.a_rs):
                # Warp 0 streams K tiles (fp32 A, bf16 B hi and lo) into the one ring.
                if warp_idx == 0:
                    sA32 = storage.sA32.get_tensor(a32_staged.outer, swizzle=a32_staged.inner)
                    load_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.s32)
                    for tile in cutlass.range(bid, num_tiles, nctas, unroll=1):
                        pid_m, pid_n, split, k_begin, k_cnt = self._tile_coords(tile, *tile_args)
                        gA, gA_lo, gB, gB_lo = self._ab_tiles(mA, mA_lo, mB, mB_lo, pid_m, pid_n)
                        tAsA, tAgA = part(tma_atom_a, sA32, gA)
                        tBsHi, tBgHi = part(tma_atom_b, sBhi, gB)
                        tBsLo, tBgLo = part(tma_atom_b_lo, sBlo, gB_lo)
                        for kt in cutlass.range(k_cnt, unroll=1):
                            pipe.producer_acquire(load_state)
                            bar = pipe.producer_get_barrier(load_state)
                            k_coord = k_begin + kt
                            s_idx = load_state.index
                            cute.copy(tma_atom_a, tAgA[(None, k_coord)], tAsA[(None, s_idx)], tma_bar_ptr=bar)
                            cute.copy(tma_atom_b, tBgHi[(None, k_coord)], tBsHi[(None, s_idx)], tma_bar_ptr=bar)
                            cute.copy(tma_atom_b_lo, tBgLo[(None, k_coord)], tBsLo[(None, s_idx)], tma_bar_ptr=bar)
                            pipe.producer_commit(load_state)
                            load_state.advance()
            else:
                sA32 = sB32 = None
                if cutlass.const_expr(not self.a_pre):
                    sA32 = storage.sA32.get_tensor(a32_staged.outer, swizzle=a32_staged.inner)
                if cutlass.const_expr(not self.b_pre):
                    sB32 = storage.sB32.get_tensor(b32_staged.outer, swizzle=b32_staged.inner)
                load_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, max(self.s32, 1))
                read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, max(self.s32, 1))
                write_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.s16)
                for tile in cutlass.range(bid, num_tiles, nctas, unroll=1):
                    pid_m, pid_n, split, k_begin, k_cnt = self._tile_coords(tile, *tile_args)
                    gA, gA_lo, gB, gB_lo = self._ab_tiles(mA, mA_lo, mB, mB_lo, pid_m, pid_n)
                    # TMA partitions: on-chip operands into the fp32 ring (a32_load /
                    # b32_load: atom, gmem K tiles, smem stages), pre-split ones (hi, lo)
                    # into the bf16 ring.
                    a32_load = b32_load = None
                    if cutlass.const_expr(self.a_pre):
                        tAsHi, tAgHi = part(tma_atom_a, sAhi, gA)
                        tAsLo, tAgLo = part(tma_atom_a_lo, sAlo, gA_lo)
                    else:
                        tAsA, tAgA = part(tma_atom_a, sA32, gA)
                        a32_load = (tma_atom_a, tAgA, tAsA)
                    if cutlass.const_expr(self.b_pre):
                        tBsHi, tBgHi = part(tma_atom_b, sBhi, gB)
                        tBsLo, tBgLo = part(tma_atom_b_lo, sBlo, gB_lo)
                    else:
                        tBsB, tBgB = part(tma_atom_b, sB32, gB)
                        b32_load = (tma_atom_b, tBgB, tBsB)
                    # Prologue: warp 0 fills the fp32 ring (free at a tile's start: the
                    # previous tile consumed every stage it loaded).
                    if cutlass.const_expr(self.has_f32):
                        if warp_idx == 0:
                            for kt in cutlass.range(cutlass.min(k_cnt, self.s32), unroll=1):
                                self._load_f32(pipe32, load_state, k_begin + kt, a32_load, b32_load)
                                load_state.advance()
                    for kt in cutlass.range(k_cnt, unroll=1):
                        pipe16.producer_acquire(write_state)
                        k_coord = k_begin + kt
                        if cutlass.const_expr(self.has_pre):
                            # The stage is free: load the pre-split hi and lo tiles into it.
                            if warp_idx == 0:
                                bar16 = pipe16.producer_get_barrier(write_state)
                                with cute.arch.elect_one():
                                    cute.arch.mbarrier_arrive_and_expect_tx(bar16, tx16)
                                w16 = write_state.index
                                if cutlass.const_expr(self.a_pre):
                                    cute.copy(tma_atom_a, tAgHi[(None, k_coord)], tAsHi[(None, w16)], tma_bar_ptr=bar16)
                                    cute.copy(
                                        tma_atom_a_lo, tAgLo[(None, k_coord)], tAsLo[(None, w16)], tma_bar_ptr=bar16
                                    )
                                if cutlass.const_expr(self.b_pre):
                                    cute.copy(tma_atom_b, tBgHi[(None, k_coord)], tBsHi[(None, w16)], tma_bar_ptr=bar16)
                                    cute.copy(
                                        tma_atom_b_lo, tBgLo[(None, k_coord)], tBsLo[(None, w16)], tma_bar_ptr=bar16
                                    )
                        if cutlass.const_expr(self.has_f32):
                            pipe32.consumer_wait(read_state)
                            if cutlass.const_expr(not self.a_pre):
                                self._split_tile(
                                    sA32[(None, None, read_state.index)],
                                    sAhi[(None, None, write_state.index)],
                                    sAlo[(None, None, write_state.index)],
                                    self.a_k_major,
                                    tidx,
                                )
                            if cutlass.const_expr(not self.b_pre):
                                self._split_tile(
                                    sB32[(None, None, read_state.index)],
                                    sBhi[(None, None, write_state.index)],
                                    sBlo[(None, None, write_state.index)],
                                    self.b_k_major,
                                    tidx,
                                )
                            # Generic-proxy smem writes -> visible to wgmma (async proxy).
                            cute.arch.fence_proxy("async.shared", space="cta")
                        pipe16.producer_commit(write_state)
                        write_state.advance()
                        if cutlass.const_expr(self.has_f32):
                            # Every lane of this warp has finished reading the fp32 stage.
                            cute.arch.sync_warp()
                            pipe32.consumer_release(read_state)
                            read_state.advance()
                            # Refill the stage just consumed with K tile kt + s32 (waits
                            # until every transform warp has released it).
                            if warp_idx == 0:
                                if kt + self.s32 < k_cnt:
                                    self._load_f32(pipe32, load_state, k_coord + self.s32, a32_load, b32_load)
                                    load_state.advance()
        else:
            # ------------------------------------------------------------ MMA warps
            if cutlass.const_expr(self.num_mma_wg == 2):
                cute.arch.setmaxregister_increase(mma_regs)
            mma_wg = wg_idx - self.transform_wgs
            mma_tidx = tidx - self.transform_threads
            # The MMA warpgroups promote on different K tiles (spread over the interval),
            # so while one drains its wgmma chain and adds it up, the other's wgmma keep
            # the tensor cores busy.
            phase = (mma_wg * _PROMOTE_EVERY) // self.num_mma_wg
            gC0 = cute.local_tile(mC, self.tile_mnk, (0, 0, None, 0), proj=(1, 1, None))
            # Two-level accumulation: wgmma accumulates _PROMOTE_EVERY K tiles from zero
            # into acc_k, which is then added (FADD, round-to-nearest fp32) into acc.
            if cutlass.const_expr(self.a_rs):
                # A in registers: each thread loads its fragment of the fp32 A tile (its
                # warpgroup's 64 rows), splits it into bf16 hi and lo registers and issues
                # the K tile's wgmma with A from registers. Two register buffers (K tiles
                # alternate between them, the loop body is unrolled twice so each names
                # its buffer statically) let one wgmma group stay in flight while the
                # next tile is loaded and split.
                thr_mma = tiled_mma.get_slice(mma_tidx)
                sA32 = storage.sA32.get_tensor(a32_staged.outer, swizzle=a32_staged.inner)
                tCsA = thr_mma.partition_A(sA32)
                a_frag_shape = tCsA[(None, None, None, 0)].shape
                rA32 = cute.make_rmem_tensor(a_frag_shape, self.io_dtype)
                rAhi = [cute.make_rmem_tensor(a_frag_shape, self.mma_dtype) for _ in range(2)]
                rAlo = [cute.make_rmem_tensor(a_frag_shape, self.mma_dtype) for _ in range(2)]
                ring_stages = self.s32
            else:
                thr_mma = tiled_mma.get_slice(mma_wg * 128)
                tCrAhi = tiled_mma.make_fragment_A(thr_mma.partition_A(sAhi))
                tCrAlo = tiled_mma.make_fragment_A(thr_mma.partition_A(sAlo))
                ring_stages = self.s16
            tCrBhi = tiled_mma.make_fragment_B(thr_mma.partition_B(sBhi))
            tCrBlo = tiled_mma.make_fragment_B(thr_mma.partition_B(sBlo))
            acc_shape = thr_mma.partition_C(gC0).shape
            acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            acc_k = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            num_k_blocks = cute.size(tCrBhi, mode=[2])
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ring_stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ring_stages)

            # Epilogue pieces that do not depend on the tile.
            c_layout = self.c_layout
            copy_atom_r2s = sm90_utils.get_smem_store_op(c_layout, elem_ty_d=self.io_dtype, elem_ty_acc=self.acc_dtype)
            copy_atom_c = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(c_layout.is_m_major_c(), 4), self.io_dtype
            )
            tiled_copy_c_atom = cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma)
            tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, tiled_copy_c_atom)
            thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx)
            tRS_sD = thr_copy_r2s.partition_D(sC)
            tRS_rAcc = tiled_copy_r2s.retile(acc)
            rD_shape = cute.shape(thr_copy_r2s.partition_S(sC))
            tRS_rD_layout = cute.make_layout(rD_shape[:3])
            tRS_rD = cute.make_rmem_tensor_like(tRS_rD_layout, self.acc_dtype)
            size_tRS_rD = cute.size(tRS_rD)
            c_pipe = pipeline.PipelineTmaStore.create(
                num_stages=self.epi_stage,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_threads),
            )
            epi_bar = pipeline.NamedBarrier(barrier_id=_EPI_BARRIER_ID, num_threads=self.mma_threads)
            first_mma_warp = self.transform_threads // 32

            for tile in cutlass.range(bid, num_tiles, nctas, unroll=1):
                pid_m, pid_n, split, k_begin, k_cnt = self._tile_coords(tile, *tile_args)
                acc.fill(0.0)
                if cutlass.const_expr(self.a_rs):
                    for kp in cutlass.range((k_cnt + 1) // 2, unroll=1):
                        for j in cutlass.range_constexpr(2):
                            kt = kp * 2 + j
                            if kt < k_cnt:
                                pos = (kt + phase) % _PROMOTE_EVERY
                                accumulate = (pos != 0) & (kt != 0)
                                chain_end = (pos == _PROMOTE_EVERY - 1) | (kt == k_cnt - 1)
                                pipe.consumer_wait(read_state)
                                cute.autovec_copy(tCsA[(None, None, None, read_state.index)], rA32)
                                # Buffer j was last read by the wgmma of K tile kt - 2, done
                                # since the wait_group(1) of tile kt - 1.
                                hi32, lo = _split_rn(rA32.load(), self.io_dtype, self.mma_dtype)
                                rAhi[j].store(hi32.to(self.mma_dtype))
                                rAlo[j].store(lo)
                                cute.nvgpu.warpgroup.fence()
                                for p in cutlass.range_constexpr(3):
                                    for kb in cutlass.range_constexpr(num_k_blocks):
                                        a_coord = (None, None, kb)
                                        b_coord = (None, None, kb, read_state.index)
                                        if cutlass.const_expr(p == 0 and kb == 0):
                                            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, accumulate)
                                        if cutlass.const_expr(p == 0):
                                            cute.gemm(tiled_mma, acc_k, rAlo[j][a_coord], tCrBhi[b_coord], acc_k)
                                        elif cutlass.const_expr(p == 1):
                                            cute.gemm(tiled_mma, acc_k, rAhi[j][a_coord], tCrBlo[b_coord], acc_k)
                                        else:
                                            cute.gemm(tiled_mma, acc_k, rAhi[j][a_coord], tCrBhi[b_coord], acc_k)
                                        if cutlass.const_expr(p == 0 and kb == 0):
                                            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                                cute.nvgpu.warpgroup.commit_group()
                                # Keep one group in flight: tile kt - 1's wgmma are done, so
                                # its stage (B tiles) and its A buffer are free.
                                cute.nvgpu.warpgroup.wait_group(1)
                                if kt > 0:
                                    pipe.consumer_release(release_state)
                                    release_state.advance()
                                read_state.advance()
                                # Promote: drain the chain and add it into the fp32 total.
                                if chain_end:
                                    cute.nvgpu.warpgroup.wait_group(0)
                                    _fence_tensor(acc_k)
                                    acc.store(acc.load() + acc_k.load())
                    cute.nvgpu.warpgroup.wait_group(0)
                    # The tile's last stage (its wgmma are done).
                    if k_cnt > 0:
                        pipe.consumer_release(release_state)
                        release_state.advance()
                else:
                    for kt in cutlass.range(k_cnt, unroll=1):
                        pos = (kt + phase) % _PROMOTE_EVERY
                        # wgmma accumulates into acc_k unless this K tile starts a chain.
                        accumulate = (pos != 0) & (kt != 0)
                        chain_end = (pos == _PROMOTE_EVERY - 1) | (kt == k_cnt - 1)
                        pipe16.consumer_wait(read_state)
                        cute.nvgpu.warpgroup.fence()
                        # Small terms first (lo.hi and hi.lo of every k block, then hi.hi), so
                        # the chain adds them while acc_k is smallest. The first wgmma of a
                        # chain overwrites acc_k (ACCUMULATE = False): no zeroing.
                        for p in cutlass.range_constexpr(3):
                            for kb in cutlass.range_constexpr(num_k_blocks):
                                kb_coord = (None, None, kb, read_state.index)
                                if cutlass.const_expr(p == 0 and kb == 0):
                                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, accumulate)
                                if cutlass.const_expr(p == 0):
                                    cute.gemm(tiled_mma, acc_k, tCrAlo[kb_coord], tCrBhi[kb_coord], acc_k)
                                elif cutlass.const_expr(p == 1):
                                    cute.gemm(tiled_mma, acc_k, tCrAhi[kb_coord], tCrBlo[kb_coord], acc_k)
                                else:
                                    cute.gemm(tiled_mma, acc_k, tCrAhi[kb_coord], tCrBhi[kb_coord], acc_k)
                                if cutlass.const_expr(p == 0 and kb == 0):
                                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                        cute.nvgpu.warpgroup.commit_group()
                        # Keep one wgmma group in flight; the previous bf16 stage is now free.
                        cute.nvgpu.warpgroup.wait_group(1)
                        if kt > 0:
                            if lane == 0:
                                pipe16.consumer_release(release_state)
                            release_state.advance()
                        read_state.advance()
                        # Promote: drain the chain and add it into the fp32 total (FADD,
                        # round-to-nearest). The fence keeps the FADDs after the wait (see
                        # gemm_sm90._fence_f32: otherwise ptxas serializes every wgmma).
                        if chain_end:
                            cute.nvgpu.warpgroup.wait_group(0)
                            _fence_tensor(acc_k)
                            acc.store(acc.load() + acc_k.load())
                    cute.nvgpu.warpgroup.wait_group(0)
                    # The tile's last stage (its wgmma are done).
                    if k_cnt > 0:
                        if lane == 0:
                            pipe16.consumer_release(release_state)
                        release_state.advance()

                # -------------------------------------------------------- epilogue
                # registers -> swizzled smem (2 buffers) -> TMA store, which clips the edges.
                # The store of a tile drains while the next tile's K loop runs.
                gC = cute.local_tile(mC, self.tile_mnk, (pid_m, pid_n, None, split), proj=(1, 1, None))
                gC_epi = cute.zipped_divide(gC, self.epi_tile)
                bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
                    tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_epi
                )
                epi_tile_num = cute.size(gC_epi, mode=[1])
                epi_tile_shape = gC_epi.shape[1]
                epi_tile_layout = cute.make_layout(epi_tile_shape, stride=(epi_tile_shape[1], 1))
                for epi_idx in cutlass.range_constexpr(epi_tile_num):
                    for v in cutlass.range_constexpr(size_tRS_rD):
                        tRS_rD[v] = tRS_rAcc[epi_idx * size_tRS_rD + v]
                    buf = epi_idx % self.epi_stage
                    cute.copy(tiled_copy_r2s, tRS_rD, tRS_sD[(None, None, None, buf)])
                    # Ordinary smem stores must be visible to the TMA (async proxy).
                    cute.arch.fence_view_async_shared()
                    epi_bar.arrive_and_wait()
                    gmem_coord = epi_tile_layout.get_hier_coord(epi_idx)
                    if warp_idx == first_mma_warp:
                        cute.copy(tma_atom_c, bSG_sD[(None, buf)], bSG_gD[(None, gmem_coord)])
                        c_pipe.producer_commit()
                        c_pipe.producer_acquire()
                    epi_bar.arrive_and_wait()
            if warp_idx == first_mma_warp:
                c_pipe.producer_tail()


# ---------------------------------------------------------------------- AOT export
def _fake_operand(dtype, unit_stride_mode: int):
    """A rank-3 (rows, cols, batch) fake tensor with dynamic extents and strides.

    The non-unit strides are multiples of 16 bytes (TMA row strides: d and E multiples of
    8, see router_variants.py).
    """
    from cutlass.cute.runtime import make_fake_tensor

    shape = tuple(cute.sym_int64() for _ in range(3))
    stride = [cute.sym_int64(divisibility=16 // (dtype.width // 8)) for _ in range(3)]
    stride[unit_stride_mode] = 1
    return make_fake_tensor(dtype, shape, tuple(stride), assumed_align=16)


def compile_variant(v: RouterVariant):
    """cute.compile of one variant with fully dynamic shapes (CUTE_DSL_ARCH set by the caller).

    Arguments: (A, A_lo, B, B_lo, C): a pre-split operand is a bf16 (hi, lo) pair, an
    on-chip one an fp32 tensor passed twice (the second is not read).
    """
    from cutlass.runtime import make_fake_stream

    def operand(pre, major):
        unit = 1 if major == "k" else 0
        if pre:
            return _fake_operand(cutlass.BFloat16, unit), _fake_operand(cutlass.BFloat16, unit)
        t = _fake_operand(cutlass.Float32, unit)
        return t, t

    a, a_lo = operand(v.a_presplit, v.a_major)
    b, b_lo = operand(v.b_presplit, v.b_major)
    c = _fake_operand(cutlass.Float32, 1)
    return cute.compile(
        RouterBf16x3Sm90(v), a, a_lo, b, b_lo, c, cutlass.Int32(1), cutlass.Int32(132), make_fake_stream()
    )


def write_router_variant_table(variants, obj_dir: pathlib.Path) -> pathlib.Path:
    """Generates jax_cake_router_variants.inc: module loaders, launchers, kRouterVariants[].

    Included by ffi/router_ffi.cc after it defines jax_cake::router::{RouterOperand,
    RouterArgs, RouterVariantEntry}. Separate names from the dense table so both
    translation units link into one library.
    """
    lines = c_table.error_hook_lines(
        "jax_cake/kernels/router_bf16x3_sm90.py", ["jax_cake", "router", "gen"], undef_first=True
    )
    for v in variants:
        lines.append(f'#include "{v.name}.h"')
    lines.append("namespace jax_cake { namespace router { namespace gen {")
    operands = [("a", "mA"), ("a_lo", "mA_lo"), ("b", "mB"), ("b_lo", "mB_lo"), ("c", "mC")]
    for v in variants:
        lines += c_table.launcher_lines(v.name, "RouterArgs", operands, "g.splits, g.max_ctas")
    lines.append("}  // namespace gen")
    lines.append("static const RouterVariantEntry kRouterVariants[] = {")
    for v in variants:
        lines.append(
            f'  {{"{v.name}", "{v.program}", {v.tile_m}, {v.tile_n}, {v.tile_k}, gen::load_{v.name}, gen::launch_{v.name}}},'
        )
    lines.append("};")
    lines.append(f"static constexpr int kNumRouterVariants = {len(variants)};")
    lines.append("}  // namespace router")
    lines.append("}  // namespace jax_cake")
    path = obj_dir / "jax_cake_router_variants.inc"
    path.write_text("\n".join(lines) + "\n")
    return path


def _default_log(msg: str) -> None:
    print(f"[jax_cake.build] {msg}", flush=True)


def export_router_kernels(obj_dir, log=_default_log) -> list[dict]:
    """Compiles and exports every router variant to `<obj_dir>/<name>.{h,o}`.

    CUTE_DSL_ARCH must already be set (to sm_90a) by the caller before cutlass was
    first imported, as jax_cake/build.py:export_kernels does. Also writes
    `<obj_dir>/jax_cake_router_variants.inc` (the table ffi/router_ffi.cc includes).

    `log` takes one message (build.py's `_log` fits). Returns one dict per variant, in
    table order: name (= function prefix), header and object paths, program and tile;
    plus a last entry {"name": None, "table": path}.
    """
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch != "sm_90a":
        raise RuntimeError(
            f"export_router_kernels needs CUTE_DSL_ARCH=sm_90a set before cutlass is imported, got {arch!r}"
        )
    obj_dir = pathlib.Path(obj_dir)
    obj_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for v in VARIANTS:
        t0 = time.time()
        compiled = compile_variant(v)
        compiled.export_to_c(str(obj_dir), v.name, v.name)
        log(f"exported {v.name} ({time.time() - t0:.1f} s)")
        out.append(
            {
                "name": v.name,
                "prefix": v.name,
                "header": obj_dir / f"{v.name}.h",
                "object": obj_dir / f"{v.name}.o",
                "program": v.program,
                "tile": v.tile,
            }
        )
    table = write_router_variant_table(list(VARIANTS), obj_dir)
    out.append({"name": None, "table": table})
    return out
