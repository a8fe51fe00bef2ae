"""The pieces of the C epilogue both sm_90a kernel families use: registers -> swizzled
shared memory -> TMA store, in sub-tiles of (tile_m, 32) columns (16 for tiles 176 or 208 wide) through `epi_stage`
buffers.

Here: the construction, each tile's sub-tile partitions, which accumulator registers
make each sub-tile, and the staging of a sub-tile into its buffer (the accumulator's,
or the gated epilogue's h made from two of them), all plain trace-time
Python with no control flow. The store loop around them (the store warp's acquire / TMA
store / commit are branches on the warp index, dynamic control flow the DSL takes only in
its jit functions) is gemm_base_sm90.GemmSm90Base._store_tile.

Imported only by the kernel modules (AOT); never at run time.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils


# The tanh-form GELU's constants (jax.nn.gelu(approximate=True)): sqrt(2 / pi) and the cubic's.
_GELU_C = 0.7978845608028654
_GELU_A = 0.044715


class SubTileStaging(NamedTuple):
    """What `stage_sub_tile` needs (no pipeline object: the DSL would have to carry it
    through the kernels' dynamic tile loops, where this tuple is passed)."""

    tiled_copy_r2s: Any  # registers -> shared memory, C's dtype
    tRS_sD: Any  # this thread's view of the staged C buffers
    tRS_rAcc: Any  # the accumulator retiled for the copy
    tRS_rD_layout: Any  # one sub-tile's registers
    tRS_rD: Any  # one sub-tile's registers, accumulator dtype
    tRS_cD: Any  # the (row, column) of each of those registers in its sub-tile
    tRS_cD_offsets: Any  # the same, minus those of register 0: the same for every thread (static)
    epi_bar: Any  # named barrier of the consumer threads


class EpiloguePieces(NamedTuple):
    staging: SubTileStaging  # its epi_bar also serves the kernels' other consumer rendezvous
    c_pipe: Any  # PipelineTmaStore over the epi_stage buffers


def make_epilogue(
    tiled_mma, c_layout, c_dtype, acc_dtype, acc, sC, mma_tidx, epi_stage: int, mma_threads: int, barrier_id: int
) -> EpiloguePieces:
    """The copies, register views, store pipeline and barrier of the epilogue (trace time,
    in the consumer warps; acc is the accumulator the tiles are stored from)."""
    copy_atom_r2s = sm90_utils.get_smem_store_op(c_layout, elem_ty_d=c_dtype, elem_ty_acc=acc_dtype)
    copy_atom_c = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(c_layout.is_m_major_c(), 4), c_dtype)
    tiled_copy_c_atom = cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma)
    tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, tiled_copy_c_atom)
    thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx)
    rD_shape = cute.shape(thr_copy_r2s.partition_S(sC))
    tRS_rD_layout = cute.make_layout(rD_shape[:3])
    epi_tile = (cute.size(sC, mode=[0]), cute.size(sC, mode=[1]))  # flat: (row, column) coordinates
    return EpiloguePieces(
        staging=SubTileStaging(
            tiled_copy_r2s=tiled_copy_r2s,
            tRS_sD=thr_copy_r2s.partition_D(sC),
            tRS_rAcc=tiled_copy_r2s.retile(acc),
            tRS_rD_layout=tRS_rD_layout,
            tRS_rD=cute.make_rmem_tensor_like(tRS_rD_layout, acc_dtype),
            tRS_cD=thr_copy_r2s.partition_S(cute.make_identity_tensor(epi_tile)),
            tRS_cD_offsets=tiled_copy_r2s.get_slice(0).partition_S(cute.make_identity_tensor(epi_tile)),
            epi_bar=pipeline.NamedBarrier(barrier_id=barrier_id, num_threads=mma_threads),
        ),
        c_pipe=pipeline.PipelineTmaStore.create(
            num_stages=epi_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, mma_threads),
        ),
    )


def tile_sub_tiles(tma_atom_c, mC, sC, tile_mnk, epi_tile, coord):
    """One tile's sub-tiles of C: (the TMA partitions of the staged buffers and of the tile
    in C, the number of sub-tiles, the layout from a sub-tile index to its coordinate).
    coord: the tile's (m, n, None, batch) in mC."""
    gC = cute.local_tile(mC, tile_mnk, coord, proj=(1, 1, None))
    gC_epi = cute.zipped_divide(gC, epi_tile)
    bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
        tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_epi
    )
    shape = gC_epi.shape[1]
    return bSG_sD, bSG_gD, cute.size(gC_epi, mode=[1]), cute.make_layout(shape, stride=(shape[1], 1))


def stage_sub_tile(ep: SubTileStaging, epi_idx: int, buf, c_dtype=None) -> None:
    """Sub-tile epi_idx of the accumulator -> staged buffer buf, between two barriers of
    the consumer threads (the first: buf is free, the store warp has waited for it; the
    second: buf is written and fenced for the TMA store). c_dtype: convert to it first
    (None: store the accumulator dtype). Plain trace-time Python (no control flow), so
    the kernels call it inside their persistent tile loops."""
    ep.epi_bar.arrive_and_wait()
    for v in range(cute.size(ep.tRS_rD)):
        ep.tRS_rD[v] = ep.tRS_rAcc[sub_tile_index(v, epi_idx, ep.tRS_rD_layout, ep.tRS_rAcc)]
    src = ep.tRS_rD
    if c_dtype is not None:
        src = cute.make_rmem_tensor_like(ep.tRS_rD_layout, c_dtype)
        src.store(ep.tRS_rD.load().to(c_dtype))
    cute.copy(ep.tiled_copy_r2s, src, ep.tRS_sD[(None, None, None, buf)])
    # Ordinary smem stores must be visible to the TMA (async proxy).
    cute.arch.fence_view_async_shared()
    ep.epi_bar.arrive_and_wait()


def stage_gated_sub_tile(ep: SubTileStaging, pair: int, buf, activation: str) -> None:
    """h sub-tile `pair` (32 columns of h [M, N / 2]) -> staged buffer buf, between the
    same two barriers as stage_sub_tile.

    The accumulator's columns are gate and up entries in blocks of 16 (variants.GATE_BLOCK):
    in sub-tile e, the registers of the copy's first 16-column group are gate values and
    those of its second group, at the same positions, the up values of the same d_ff
    indices. Column group n of h sub-tile `pair` is made from accumulator sub-tile
    2 * pair + n: h = bf16(act(g) * u) in FP32 from g, u rounded to bf16 first (the
    pre-activation's values), as jax_cake.reference.gate."""
    cpy_v, cpy_m, cpy_n = (cute.size(ep.tRS_rD_layout, mode=[i]) for i in range(3))
    assert cpy_n == 2, "a 32-column sub-tile is two 16-column copy groups"
    ep.epi_bar.arrive_and_wait()
    h = cute.make_rmem_tensor_like(ep.tRS_rD_layout, cutlass.BFloat16)
    # One run of cpy_v registers at a time: few temporaries live beside a ping-pong
    # warpgroup's whole accumulator (with the whole sub-tile at once, 128 x 192 spills).
    run = cute.make_layout(cpy_v)
    for n in range(cpy_n):
        for m in range(cpy_m):
            g = cute.make_rmem_tensor(run, ep.tRS_rD.element_type)
            u = cute.make_rmem_tensor(run, ep.tRS_rD.element_type)
            for i in range(cpy_v):
                g[i] = ep.tRS_rAcc[sub_tile_index(i + cpy_v * m, 2 * pair + n, ep.tRS_rD_layout, ep.tRS_rAcc)]
                u[i] = ep.tRS_rAcc[sub_tile_index(i + cpy_v * (m + cpy_m), 2 * pair + n, ep.tRS_rD_layout, ep.tRS_rAcc)]
            gf = g.load().to(cutlass.BFloat16).to(cutlass.Float32)
            uf = u.load().to(cutlass.BFloat16).to(cutlass.Float32)
            act, _ = _act_and_slope(gf, activation, slope=False)
            hr = cute.make_rmem_tensor(run, cutlass.BFloat16)
            hr.store((act * uf).to(cutlass.BFloat16))
            for i in range(cpy_v):
                h[i + cpy_v * (m + cpy_m * n)] = hr[i]
    cute.copy(ep.tiled_copy_r2s, h, ep.tRS_sD[(None, None, None, buf)])
    cute.arch.fence_view_async_shared()
    ep.epi_bar.arrive_and_wait()


def stage_gate_grad_sub_tile(ep: SubTileStaging, sub: int, n: int, buf, activation: str, gu_view) -> None:
    """The activation's gradient of 16 columns of dh -> one d[gate|up] sub-tile in
    staged buffer buf, between the same two barriers as stage_sub_tile.

    The accumulator holds dh (the down projection's dgrad, [M, F]); column group n of its
    sub-tile `sub` is 16 d_ff indices, whose gate and up pre-activations are the two
    16-column halves of sub-tile 2 * sub + n of gu [M, 2F] (contract.GATE_BLOCK
    interleave). gu_view(row, column) loads gu at a (row, column) of this register's
    sub-tile shifted to that gate column (+ 16: the up one; gemm_base_sm90 clamps it into
    gu's bounds). The staged sub-tile is d_gu's, in the same layout: its first 16 columns
    dg = bf16(dh * u * act'(g)), the next 16 du = bf16(dh * act(g)), in FP32 from dh
    rounded to bf16 first (the plain dgrad's output) and the bf16 g, u, as
    jax_cake.reference.gate_grad."""
    cpy_v, cpy_m, cpy_n = (cute.size(ep.tRS_rD_layout, mode=[i]) for i in range(3))
    assert cpy_n == 2, "a 32-column sub-tile is two 16-column copy groups"
    ep.epi_bar.arrive_and_wait()
    d = cute.make_rmem_tensor_like(ep.tRS_rD_layout, cutlass.BFloat16)
    run = cute.make_layout(cpy_v)
    for m in range(cpy_m):
        dh = cute.make_rmem_tensor(run, ep.tRS_rD.element_type)
        for i in range(cpy_v):
            dh[i] = ep.tRS_rAcc[sub_tile_index(i + cpy_v * (m + cpy_m * n), sub, ep.tRS_rD_layout, ep.tRS_rAcc)]
        # Registers 2j, 2j + 1 of a run hold adjacent columns (an even one first): one
        # 32-bit load fetches both.
        g2 = cute.make_rmem_tensor(cute.make_layout(cpy_v // 2), cutlass.Int32)
        u2 = cute.make_rmem_tensor(cute.make_layout(cpy_v // 2), cutlass.Int32)
        for j in range(cpy_v // 2):
            r, c = ep.tRS_cD_offsets[2 * j + cpy_v * (m + cpy_m * n)]
            # Column c of the sub-tile is in group c // 16 = n.
            g2[j], u2[j] = gu_view(ep.tRS_cD[0], (r, c - 16 * n))
        g = cute.recast_tensor(g2, cutlass.BFloat16)
        u = cute.recast_tensor(u2, cutlass.BFloat16)
        dhf = dh.load().to(cutlass.BFloat16).to(cutlass.Float32)
        gf = g.load().to(cutlass.Float32)
        act, slope = _act_and_slope(gf, activation)
        dg = cute.make_rmem_tensor(run, cutlass.BFloat16)
        du = cute.make_rmem_tensor(run, cutlass.BFloat16)
        dg.store((dhf * u.load().to(cutlass.Float32) * slope).to(cutlass.BFloat16))
        du.store((dhf * act).to(cutlass.BFloat16))
        for i in range(cpy_v):
            d[i + cpy_v * m] = dg[i]
            d[i + cpy_v * (m + cpy_m)] = du[i]
    cute.copy(ep.tiled_copy_r2s, d, ep.tRS_sD[(None, None, None, buf)])
    cute.arch.fence_view_async_shared()
    ep.epi_bar.arrive_and_wait()


def load_gate_up(m_gu32, row0, col0, l_idx, base, offset):
    """(g, u) pairs: the pre-activation gu [M, 2F, L] (gate and up interleaved in blocks
    of 16), read as int32 pairs of adjacent columns (m_gu32 [M, F, L]), at the d_ff
    columns col0 + c, c + 1 (col0 a multiple of 16, c < 16 even) of tile row row0 + r,
    where (r, c) = base + offset: base the thread's (dynamic) coordinate, offset a static
    one, so that the loads of a row share one address up to constant offsets. Rows and
    columns past gu's edges are clamped into it (per row and per 16 columns): those
    elements of the tile are never stored (TMA clips them)."""
    pair = cutlass.min(col0, cute.size(m_gu32, mode=[1]) - 16) + base[1] // 2 + offset[1] // 2
    row = cutlass.min(row0 + base[0] + offset[0], cute.size(m_gu32, mode=[0]) - 1)
    return m_gu32[row, pair, l_idx], m_gu32[row, pair + 8, l_idx]


def _act_and_slope(z, activation: str, slope: bool = True):
    """(act(z), act'(z) or None) in FP32 for FP32 register values z, as
    jax_cake.reference's."""
    if activation == "silu":
        s = 1.0 / (1.0 + cute.math.exp(-z))
        return z * s, (s * (1.0 + z * (1.0 - s)) if slope else None)
    if activation == "gelu":
        # The tanh form, as jax.nn.gelu(approximate=True), through 0.5 (1 + tanh(y)) =
        # 1 / (1 + exp(-2y)): the same value without the cancellation of 1 + tanh(y)
        # near -1 (the DSL's tanh is not accurate enough for it).
        if slope:
            raise ValueError("the gelu gradient epilogue is not built")
        return z * (1.0 / (1.0 + cute.math.exp(-2.0 * _GELU_C * (z + _GELU_A * (z * z * z))))), None
    raise ValueError(f"unknown activation {activation!r}")


def sub_tile_index(v: int, epi_idx: int, rd_layout, r_acc) -> int:
    """Index into the retiled accumulator ((copy V, column groups), M, 1) of register v of
    sub-tile epi_idx, whose registers are (copy V, M, column groups of the sub-tile).

    With one warpgroup per 128-row tile (ping-pong) M is 2, and a sub-tile's registers
    are not one contiguous run of the accumulator (trace-time arithmetic only).
    """
    cpy_v, cpy_m, cpy_n = (cute.size(rd_layout, mode=[i]) for i in range(3))
    groups = cute.size(r_acc, mode=[0]) // cpy_v
    assert cute.size(r_acc, mode=[1]) == cpy_m and cute.size(r_acc) == cpy_v * groups * cpy_m
    i, m, n = v % cpy_v, (v // cpy_v) % cpy_m, v // (cpy_v * cpy_m)
    return i + cpy_v * (epi_idx * cpy_n + n) + cpy_v * groups * m
