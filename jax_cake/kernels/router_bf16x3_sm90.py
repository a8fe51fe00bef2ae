"""Fused FP32 GEMM by BF16x3 emulation for sm_90a (Hopper), written in CuTe DSL.

C[M, N, s] = sum_k A[M, K] * B[N, K] with fp32 logical operands and fp32 C, where every
product is done as three bf16 wgmma products into fp32:

    a = a_hi + a_lo,  a_hi = bf16_rn(a),  a_lo = bf16_rn(a - f32(a_hi))
    a . b ~= a_hi b_hi + a_hi b_lo + a_lo b_hi        (a_lo b_lo, ~2^-18 relative, dropped)

This is the router GEMM of jax_cake (logits = x w^T and both gradients), the same
algorithm as XLA's BF16_BF16_F32_X3 but fused. The activation x is read as fp32 and split
on chip; w and g, small and re-read by many CTAs, arrive as bf16 (hi, lo) pairs split once
per call by the caller (router_variants.PRESPLIT). wgrad runs transposed (dw^T = x^T g,
router_variants.TRANSPOSED), so x is the A operand wherever it is read.

Persistent: at most one CTA per SM (max_ctas), each walking linear tiles bid, bid + grid,
... of the (split, M, N) tile space (fwd N fastest, the others M fastest, so neighbouring
CTAs share an operand tile in L2). The ring and its barrier phases carry over from tile to
tile: loads of the next tile start while a tile's epilogue runs, and its TMA stores drain
under the next K loop.

CTA (warp-specialized, in the frame of gemm_base_sm90.GemmSm90Base; this module holds the
BF16x3 split, the triple MMA and the router's tile walk): warpgroup 0, warp 0 streams
each K tile's A and B hi/lo tiles by TMA into one ring (PipelineTmaAsync; empty = lane 0
of each MMA warp); two MMA warpgroups of 64 rows each at tile_m = 128.
  A in registers (fwd, wgrad: A = x, fp32): each MMA thread loads its wgmma-A fragment
     of the fp32 stage, splits it in registers (two elements per conversion) into one of
     three register buffers, so two wgmma groups stay in flight while the next K tile is
     loaded and split, and issues the wgmma with A from registers (RS).
  A pre-split (dgrad: A = g): SS wgmma on the hi and lo stages, one group in flight.
  MMA order per K tile: A_lo.B_hi, A_hi.B_lo, then A_hi.B_hi, so the small terms are
     added while the chain is small. Two-level accumulation: every 2 (RS: 4) K tiles
     a warpgroup drains its chain (wait_group 0) and adds it into an fp32 register total
     with FADD; the next chain starts with ACCUMULATE = False. wgmma's fp32 accumulation
     loses precision about linearly along a chain (on the order of 1e-8 relative per k16
     wgmma), so chains stay short. The two warpgroups' drains are spread over the
     interval. Two 64 x tile_n accumulators per thread limit tile_n to 128. Epilogue:
     registers -> swizzled smem -> TMA store.

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
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from jax_cake.kernels.epilogue_sm90 import make_epilogue, tile_sub_tiles
from jax_cake.kernels.gemm_base_sm90 import EPI_BARRIER_ID, GemmSm90Base, fence_tensor
from jax_cake.planner.router_variants import VARIANTS, RouterVariant

# Two-level accumulation interval in K tiles (32 each). wgmma's fp32 accumulation in the
# tensor core loses precision along one chain, about linearly with the chain's length
# (on the order of 1e-8 relative per k16 wgmma), so with all three products in one chain
# a long K misses the fp32 target; chains of 2 K tiles (12 wgmma, 64 K elements) stay
# well inside it. The warpgroups' drains are spread over the interval, so the other
# warpgroup's wgmma cover each one.
_PROMOTE_EVERY = 2
# A in registers (fwd, wgrad): three A register buffers keep two wgmma groups in flight
# while the next K tile is loaded and split, which pays only with chains longer than two
# K tiles, so these chains are four K tiles (256 K elements): faster than two buffers and
# chains of two, at the same error.
_A_BUFFERS_RS = 3
_PROMOTE_EVERY_RS = 4


def _asm_u32(ptx: str, constraints: str, args, *, loc=None, ip=None):
    """One pure inline-PTX expression with a 32-bit result (operands: fp32 or u32 scalars)."""
    return cutlass.Uint32(
        llvm.inline_asm(
            T.i32(),
            [a.ir_value(loc=loc, ip=ip) for a in args],
            ptx,
            constraints,
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def _bf16x2_hi(a0, a1, *, loc=None, ip=None):
    """bf16 round-to-nearest-even of (a0, a1) packed in one register, a0 in the low half:
    one F2FP.BF16.F32.PACK_AB for two elements."""
    return _asm_u32(
        "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [cutlass.Float32(a0), cutlass.Float32(a1)], loc=loc, ip=ip
    )


@dsl_user_op
def _bf16x2_lo(a0, a1, hi, *, loc=None, ip=None):
    """bf16 round-to-nearest-even of (a0 - hi0, a1 - hi1) packed like _bf16x2_hi, where hi
    is _bf16x2_hi(a0, a1). Widening a bf16 to fp32 is a 16-bit shift, and a - hi is exact."""
    ptx = (
        "{ .reg .b32 t0, t1; .reg .f32 f0, f1;"
        " shl.b32 t0, $3, 16; and.b32 t1, $3, 0xffff0000;"
        " mov.b32 f0, t0; mov.b32 f1, t1;"
        " sub.rn.f32 f0, $1, f0; sub.rn.f32 f1, $2, f1;"
        " cvt.rn.bf16x2.f32 $0, f1, f0; }"
    )
    return _asm_u32(ptx, "=r,f,f,r", [cutlass.Float32(a0), cutlass.Float32(a1), cutlass.Uint32(hi)], loc=loc, ip=ip)


@cute.jit
def _split_pairs(src: cute.Tensor, hi: cute.Tensor, lo: cute.Tensor):
    """hi, lo (bf16 pairs viewed as u32) = the split of the fp32 fragment src, two elements
    per register: 3 instructions per element against ~6 for integer rounding, same bits."""
    for i in cutlass.range_constexpr(cute.size(hi)):
        h = _bf16x2_hi(src[2 * i], src[2 * i + 1])
        hi[i] = h
        lo[i] = _bf16x2_lo(src[2 * i], src[2 * i + 1], h)


class RouterBf16x3Sm90(GemmSm90Base):
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
        if not variant.b_presplit:
            raise ValueError("B must arrive pre-split (bf16 hi and lo); only A can be split on chip")
        self.variant = variant
        self.a_rs = variant.a_in_registers
        self.promote_every = _PROMOTE_EVERY_RS if self.a_rs else _PROMOTE_EVERY
        self.a_buffers = _A_BUFFERS_RS if self.a_rs else 1
        self.n_first = variant.program == "fwd"
        self.tile_mnk = (variant.tile_m, variant.tile_n, variant.tile_k)
        self.acc_dtype = cutlass.Float32
        self.io_dtype = cutlass.Float32
        self.mma_dtype = cutlass.BFloat16
        # A's stage: fp32 (split in registers) or bf16 hi and lo.
        self.a_dtype = self.io_dtype if self.a_rs else self.mma_dtype
        self._init_cta(variant.tile_m // 64)
        # Epilogue buffers (tile_m x 32 fp32 each). dgrad (K = E = 256: 8 K tiles per
        # tile) writes a 64 KB fp32 tile per 8 K tiles: a buffer per sub-tile lets the
        # stores drain under the next tile's K loop. fwd and wgrad (long K) store little
        # per K tile: two.
        self.epi_stage = variant.tile_n // 32 if variant.program == "dgrad" else 2
        tm, tn, tk = self.tile_mnk
        # One ring: a stage holds a K tile's A (fp32, or bf16 hi and lo) and B hi and lo.
        stage_bytes = tm * tk * (4 if self.a_rs else 2 * 2) + tn * tk * 2 * 2
        self.stages = self._ring_stages(stage_bytes, tm * 32 * 4 * self.epi_stage)
        if self.stages < 2:
            raise ValueError(f"tile {self.tile_mnk} does not fit two stages in shared memory")

    # ------------------------------------------------------------------ host side
    def _operand_tma(self, m_hi, m_lo, pre, staged, rows):
        """(atom, tensor, atom_lo, tensor_lo): one TMA per K tile for an operand split on
        chip (the lo pair repeats it and is not used), two (hi, lo) for a pre-split one."""
        atom, t = self._tma_load(m_hi, staged, rows)
        if not pre:
            return atom, t, atom, t
        atom_lo, t_lo = self._tma_load(m_lo, staged, rows)
        return atom, t, atom_lo, t_lo

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
        """mA: fp32 A split on chip (mA_lo is the same tensor again and is not read), or the
        bf16 hi part of a pre-split A (mA_lo its lo part); mB, mB_lo: B's bf16 hi and lo."""
        a_layout = utils.LayoutEnum.from_tensor(mA)
        b_layout = utils.LayoutEnum.from_tensor(mB)
        c_layout = utils.LayoutEnum.from_tensor(mC)
        self.c_layout = c_layout

        # A from registers has one fragment layout whatever A's layout in shared memory (wgrad's
        # x tile is M-major there): each thread loads its elements from the fp32 stage.
        a_mode = cute.nvgpu.OperandMajorMode.K if self.a_rs else a_layout.sm90_mma_major_mode()
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.mma_dtype,
            self.mma_dtype,
            a_mode,
            b_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            (self.num_mma_wg, 1, 1),
            tiler_mn=(64, self.tile_mnk[1]),
            a_source=cute.nvgpu.warpgroup.OperandSource.RMEM if self.a_rs else cute.nvgpu.warpgroup.OperandSource.SMEM,
        )
        tm, tn, tk = self.tile_mnk
        a_staged, b_staged, epi_staged = self._smem_layouts(
            a_layout, self.a_dtype, b_layout, self.mma_dtype, c_layout, self.io_dtype, self.stages, self.epi_stage
        )
        tma_atom_a, tma_a, tma_atom_a_lo, tma_a_lo = self._operand_tma(mA, mA_lo, not self.a_rs, a_staged, tm)
        tma_atom_b, tma_b, tma_atom_b_lo, tma_b_lo = self._operand_tma(mB, mB_lo, True, b_staged, tn)
        tma_atom_c, tma_c = self._tma_store(cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mC, epi_staged)
        f32, bf16 = self.io_dtype, self.mma_dtype
        a_buffers = {"sA32": (f32, a_staged)} if self.a_rs else {"sAhi": (bf16, a_staged), "sAlo": (bf16, a_staged)}
        self.shared_storage = self._shared_storage(
            self.stages, {**a_buffers, "sBhi": (bf16, b_staged), "sBlo": (bf16, b_staged), "sC": (f32, epi_staged)}
        )

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
            a_staged,
            b_staged,
            epi_staged,
            splits,
        ).launch(
            grid=[cutlass.max(cutlass.min(num_tiles, max_ctas), 1), 1, 1],
            block=[self.threads, 1, 1],
            stream=stream,
        )

    # ---------------------------------------------------------------- device side
    def _tile_coords(self, tile, tiles_m, tiles_n, k_tiles, per_split):
        """(pid_m, pid_n, split, k_begin, k_cnt) of linear tile index `tile` (plain Python,
        traced inline). fwd walks N fastest, so the E / tile_n CTAs that share an x tile
        run side by side and x comes from HBM once; dgrad / wgrad walk M fastest, so
        neighbouring CTAs share the B tile (w in dgrad, g in the transposed wgrad) in L2,
        and wgrad's E / tile_n CTAs on one x tile run in the same wave. A split with no
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
        a_staged: cute.ComposedLayout,
        b_staged: cute.ComposedLayout,
        epi_staged: cute.ComposedLayout,
        splits: cutlass.Int32,
    ):
        tidx, warp_idx, wg_idx = self._warp_roles()

        if warp_idx == 0:
            # Without a pre-split A, tma_atom_a_lo is tma_atom_a again.
            a_atoms = (tma_atom_a,) if self.a_rs else (tma_atom_a, tma_atom_a_lo)
            self._prefetch_descriptors(*a_atoms, tma_atom_b, tma_atom_b_lo, tma_atom_c)

        # Persistent: CTA `bid` takes tiles bid, bid + grid, ... of the (split, M, N) tile
        # space; the ring and its phases carry over from one tile to the next, so the
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

        # The ring: full = 1 producer arrive + the stage's TMA bytes (A fp32, or A hi and lo;
        # B hi and lo); empty = lane 0 of every MMA warp, once its wgmma on the stage are done.
        a_bytes = self._stage_bytes(self.a_dtype, a_staged)
        tx = (1 if self.a_rs else 2) * a_bytes + 2 * self._stage_bytes(self.mma_dtype, b_staged)
        pipe = self._ring(storage, self.stages, tx, self.mma_threads // 32)
        sA32 = sAhi = sAlo = None
        if cutlass.const_expr(self.a_rs):
            sA32 = self._smem_tensor(storage.sA32, a_staged)
        else:
            sAhi = self._smem_tensor(storage.sAhi, a_staged)
            sAlo = self._smem_tensor(storage.sAlo, a_staged)
        sBhi = self._smem_tensor(storage.sBhi, b_staged)
        sBlo = self._smem_tensor(storage.sBlo, b_staged)
        sC = self._smem_tensor(storage.sC, epi_staged)

        if wg_idx == 0:
            # ------------------------------------------------------------ TMA loads
            self._producer_regs()
            if warp_idx == 0:
                part = self._tma_part
                load_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                for tile in cutlass.range(bid, num_tiles, nctas, unroll=1):
                    pid_m, pid_n, split, k_begin, k_cnt = self._tile_coords(tile, *tile_args)
                    gA, gA_lo, gB, gB_lo = self._ab_tiles(mA, mA_lo, mB, mB_lo, pid_m, pid_n)
                    if cutlass.const_expr(self.a_rs):
                        tAs, tAg = part(tma_atom_a, sA32, gA)
                    else:
                        tAs, tAg = part(tma_atom_a, sAhi, gA)
                        tAsLo, tAgLo = part(tma_atom_a_lo, sAlo, gA_lo)
                    tBs, tBg = part(tma_atom_b, sBhi, gB)
                    tBsLo, tBgLo = part(tma_atom_b_lo, sBlo, gB_lo)
                    for kt in cutlass.range(k_cnt, unroll=1):
                        pipe.producer_acquire(load_state)
                        bar = pipe.producer_get_barrier(load_state)
                        k_coord = k_begin + kt
                        s_idx = load_state.index
                        cute.copy(tma_atom_a, tAg[(None, k_coord)], tAs[(None, s_idx)], tma_bar_ptr=bar)
                        if cutlass.const_expr(not self.a_rs):
                            cute.copy(tma_atom_a_lo, tAgLo[(None, k_coord)], tAsLo[(None, s_idx)], tma_bar_ptr=bar)
                        cute.copy(tma_atom_b, tBg[(None, k_coord)], tBs[(None, s_idx)], tma_bar_ptr=bar)
                        cute.copy(tma_atom_b_lo, tBgLo[(None, k_coord)], tBsLo[(None, s_idx)], tma_bar_ptr=bar)
                        pipe.producer_commit(load_state)
                        load_state.advance()
        else:
            # ------------------------------------------------------------ MMA warps
            self._consumer_regs()
            mma_wg = wg_idx - 1
            mma_tidx = tidx - 128
            # The MMA warpgroups promote on different K tiles (spread over the interval),
            # so while one drains its wgmma chain and adds it up, the other's wgmma keep
            # the tensor cores busy.
            phase = (mma_wg * self.promote_every) // self.num_mma_wg
            gC0 = cute.local_tile(mC, self.tile_mnk, (0, 0, None, 0), proj=(1, 1, None))
            # Two-level accumulation: wgmma accumulates promote_every K tiles from zero
            # into acc_k, which is then added (FADD, round-to-nearest fp32) into acc.
            if cutlass.const_expr(self.a_rs):
                # A in registers: each thread loads its fragment of the fp32 A tile (its
                # warpgroup's 64 rows), splits it into bf16 hi and lo registers and issues
                # the K tile's wgmma with A from registers. a_buffers register buffers (K
                # tiles take them in turn, the loop body is unrolled a_buffers times so each
                # names its buffer statically) let a_buffers - 1 wgmma groups stay in flight
                # while the next tile is loaded and split.
                thr_mma = tiled_mma.get_slice(mma_tidx)
                tCsA = thr_mma.partition_A(sA32)
                a_frag_shape = tCsA[(None, None, None, 0)].shape
                rA32 = cute.make_rmem_tensor(a_frag_shape, self.io_dtype)
                rAhi = [cute.make_rmem_tensor(a_frag_shape, self.mma_dtype) for _ in range(self.a_buffers)]
                rAlo = [cute.make_rmem_tensor(a_frag_shape, self.mma_dtype) for _ in range(self.a_buffers)]
                # The same registers as bf16 pairs, written by _split_pairs.
                rAhi2 = [cute.recast_tensor(t, cutlass.Uint32) for t in rAhi]
                rAlo2 = [cute.recast_tensor(t, cutlass.Uint32) for t in rAlo]
            else:
                thr_mma = tiled_mma.get_slice(mma_wg * 128)
                tCrAhi = tiled_mma.make_fragment_A(thr_mma.partition_A(sAhi))
                tCrAlo = tiled_mma.make_fragment_A(thr_mma.partition_A(sAlo))
            tCrBhi = tiled_mma.make_fragment_B(thr_mma.partition_B(sBhi))
            tCrBlo = tiled_mma.make_fragment_B(thr_mma.partition_B(sBlo))
            acc_shape = thr_mma.partition_C(gC0).shape
            acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            acc_k = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            num_k_blocks = cute.size(tCrBhi, mode=[2])
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)

            # Epilogue pieces that do not depend on the tile.
            staging, c_pipe = make_epilogue(
                tiled_mma,
                self.c_layout,
                self.io_dtype,
                self.acc_dtype,
                acc,
                sC,
                mma_tidx,
                self.epi_stage,
                self.mma_threads,
                EPI_BARRIER_ID,
            )
            first_mma_warp = 4

            for tile in cutlass.range(bid, num_tiles, nctas, unroll=1):
                pid_m, pid_n, split, k_begin, k_cnt = self._tile_coords(tile, *tile_args)
                acc.fill(0.0)
                if cutlass.const_expr(self.a_rs):
                    nb = self.a_buffers
                    for kp in cutlass.range((k_cnt + nb - 1) // nb, unroll=1):
                        for j in cutlass.range_constexpr(nb):
                            kt = kp * nb + j
                            if kt < k_cnt:
                                pos = (kt + phase) % self.promote_every
                                accumulate = (pos != 0) & (kt != 0)
                                chain_end = (pos == self.promote_every - 1) | (kt == k_cnt - 1)
                                pipe.consumer_wait(read_state)
                                cute.autovec_copy(tCsA[(None, None, None, read_state.index)], rA32)
                                # Buffer j was last read by the wgmma of K tile kt - nb, done
                                # since the wait_group(nb - 1) of tile kt - 1.
                                _split_pairs(rA32, rAhi2[j], rAlo2[j])
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
                                # Keep nb - 1 groups in flight: tile kt - nb + 1's wgmma are
                                # done, so its stage (B tiles) and its A buffer are free.
                                cute.nvgpu.warpgroup.wait_group(nb - 1)
                                if kt >= nb - 1:
                                    pipe.consumer_release(release_state)
                                    release_state.advance()
                                read_state.advance()
                                # Promote: drain the chain and add it into the fp32 total.
                                if chain_end:
                                    cute.nvgpu.warpgroup.wait_group(0)
                                    fence_tensor(acc_k)
                                    acc.store(acc.load() + acc_k.load())
                    cute.nvgpu.warpgroup.wait_group(0)
                    # The tile's last nb - 1 stages (their wgmma are done).
                    for _ in cutlass.range(cutlass.min(k_cnt, nb - 1), unroll=1):
                        pipe.consumer_release(release_state)
                        release_state.advance()
                else:
                    for kt in cutlass.range(k_cnt, unroll=1):
                        pos = (kt + phase) % self.promote_every
                        # wgmma accumulates into acc_k unless this K tile starts a chain.
                        accumulate = (pos != 0) & (kt != 0)
                        chain_end = (pos == self.promote_every - 1) | (kt == k_cnt - 1)
                        pipe.consumer_wait(read_state)
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
                            pipe.consumer_release(release_state)
                            release_state.advance()
                        read_state.advance()
                        # Promote: drain the chain and add it into the fp32 total (FADD,
                        # round-to-nearest). The fence keeps the FADDs after the wait (see
                        # gemm_base_sm90._fence_f32: otherwise ptxas serializes every wgmma).
                        if chain_end:
                            cute.nvgpu.warpgroup.wait_group(0)
                            fence_tensor(acc_k)
                            acc.store(acc.load() + acc_k.load())
                    cute.nvgpu.warpgroup.wait_group(0)
                    # The tile's last stage (its wgmma are done).
                    if k_cnt > 0:
                        pipe.consumer_release(release_state)
                        release_state.advance()

                # -------------------------------------------------------- epilogue
                # registers -> swizzled smem (epi_stage buffers) -> TMA store, which clips the
                # edges. The store of a tile drains while the next tile's K loop runs; with a
                # whole tile of buffers (dgrad) the MMA warps never wait on this tile's stores.
                c_coord = (pid_m, pid_n, None, split)
                sub_tiles = tile_sub_tiles(tma_atom_c, mC, sC, self.tile_mnk, self.epi_tile, c_coord)
                self._store_tile(staging, c_pipe, warp_idx, first_mma_warp, 0, None, (tma_atom_c, *sub_tiles))
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
    c = _fake_operand(cutlass.Float32, 0 if v.c_major == "m" else 1)
    return cute.compile(
        RouterBf16x3Sm90(v), a, a_lo, b, b_lo, c, cutlass.Int32(1), cutlass.Int32(132), make_fake_stream()
    )


def _default_log(msg: str) -> None:
    print(f"[jax_cake.build] {msg}", flush=True)


def export_router_kernels(obj_dir, log=_default_log) -> list[dict]:
    """Compiles and exports every router variant to `<obj_dir>/<name>.{h,o}`.

    CUTE_DSL_ARCH must already be set (to sm_90a) by the caller before cutlass was
    first imported, as jax_cake/build.py:export_kernels does. The table ffi/router_ffi.cc
    includes is jax_cake/build.py's to write (jax_cake.module_table).

    `log` takes one message (build.py's `_log` fits). Returns one dict per variant, in
    table order: name (= function prefix), header and object paths, program and tile.
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
    return out
