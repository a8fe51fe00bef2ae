"""The pieces of the C epilogue both sm_90a kernel families use: registers -> swizzled
shared memory -> TMA store, in sub-tiles of (tile_m, 32) columns (16 for tiles 176 or 208 wide) through `epi_stage`
buffers.

Here: the construction, each tile's sub-tile partitions, which accumulator registers
make each sub-tile, and the staging of a sub-tile into its buffer (the accumulator's,
the gated epilogue's h made from two of them, or the gradient epilogue's dg and du made in
place from the pre-activation loaded into the buffer), all plain trace-time Python with
no control flow. The store loop around them (the store warp's acquire / TMA
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

from jax_cake.contract import GELU_A, GELU_C


class SubTileStaging(NamedTuple):
    """What `stage_sub_tile` needs (no pipeline object: the DSL would have to carry it
    through the kernels' dynamic tile loops, where this tuple is passed)."""

    tiled_copy_r2s: Any  # registers -> shared memory, C's dtype
    tRS_sD: Any  # this thread's view of the staged C buffers
    tRS_rAcc: Any  # the accumulator retiled for the copy
    tRS_rD_layout: Any  # one sub-tile's registers
    tRS_rD: Any  # one sub-tile's registers, accumulator dtype
    epi_bar: Any  # named barrier of the consumer threads


class EpiloguePieces(NamedTuple):
    staging: SubTileStaging  # its epi_bar also serves the kernels' other consumer rendezvous
    c_pipe: Any  # PipelineTmaStore over the epi_stage buffers


def _tiled_copy_c_atom(tiled_mma, c_layout, c_dtype):
    """The accumulator's thread layout as a tiled copy (stmatrix): what the copies between
    registers and the staged buffers follow."""
    copy_atom_c = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(c_layout.is_m_major_c(), 4), c_dtype)
    return cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma)


def make_epilogue(
    tiled_mma, c_layout, c_dtype, acc_dtype, acc, sC, mma_tidx, epi_stage: int, mma_threads: int, barrier_id: int
) -> EpiloguePieces:
    """The copies, register views, store pipeline and barrier of the epilogue (trace time,
    in the consumer warps; acc is the accumulator the tiles are stored from)."""
    copy_atom_r2s = sm90_utils.get_smem_store_op(c_layout, elem_ty_d=c_dtype, elem_ty_acc=acc_dtype)
    tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, _tiled_copy_c_atom(tiled_mma, c_layout, c_dtype))
    thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx)
    rD_shape = cute.shape(thr_copy_r2s.partition_S(sC))
    tRS_rD_layout = cute.make_layout(rD_shape[:3])
    return EpiloguePieces(
        staging=SubTileStaging(
            tiled_copy_r2s=tiled_copy_r2s,
            tRS_sD=thr_copy_r2s.partition_D(sC),
            tRS_rAcc=tiled_copy_r2s.retile(acc),
            tRS_rD_layout=tRS_rD_layout,
            tRS_rD=cute.make_rmem_tensor_like(tRS_rD_layout, acc_dtype),
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

    The accumulator's columns are gate and up entries in blocks of 16 (jax_cake.contract.GATE_BLOCK):
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


class GateUpLoad(NamedTuple):
    """What `stage_gate_grad_sub_tile` needs besides SubTileStaging: the shared-memory ->
    register copy (ldmatrix) of one staged (tile_m, 32) buffer into registers laid out as
    SubTileStaging.tRS_rD, so that register v holds the buffer's element at the position
    stage_sub_tile writes register v to."""

    tiled_copy_s2r: Any  # shared memory -> registers, bf16
    tSR_sC: Any  # this thread's view of the staged buffers (source)
    tSR_rC: Any  # one sub-tile's registers, bf16, as tRS_rD
    tSR_rC_s2r: Any  # the same registers retiled for the copy


def gate_up_block_layouts(tile_m: int, buffers: int):
    """(buffers of (tile_m, 32) bf16, the same buffers as (tile_m, 16, 2)): the shared-memory
    layouts of the gradient epilogue, whose every 32-column sub-tile is two 16-column blocks
    (gate, then up), each row-major with the 32-byte swizzle, one after the other. A TMA box
    of (16 columns, tile_m rows, 2 blocks) reads or writes such a buffer whole, with the
    blocks at any distance in global memory: the interleaved gu's two 16-column halves of
    one 32-column group, or dg and du in the two planes of d_gu."""
    atom = sm90_utils.make_smem_layout_atom(cute.nvgpu.warpgroup.SmemLayoutAtomKind.K_SW32, cutlass.BFloat16)
    return (
        cute.tile_to_shape(atom, (tile_m, 32, buffers), (0, 1, 2)),
        cute.tile_to_shape(atom, (tile_m, 16, 2, buffers), (0, 1, 2, 3)),
    )


def make_gate_up_load(staging: SubTileStaging, tiled_mma, c_layout, sC, mma_tidx) -> GateUpLoad:
    """The ldmatrix copy of a staged sub-tile back into the staging registers' layout
    (trace time, in the consumer warps; c_layout and sC as make_epilogue's, bf16)."""
    copy_atom_s2r = cute.make_copy_atom(
        cute.nvgpu.warp.LdMatrix8x8x16bOp(c_layout.is_m_major_c(), 4), cutlass.BFloat16
    )
    tiled_copy_s2r = cute.make_tiled_copy_S(copy_atom_s2r, _tiled_copy_c_atom(tiled_mma, c_layout, cutlass.BFloat16))
    thr_copy_s2r = tiled_copy_s2r.get_slice(mma_tidx)
    regs = cute.make_rmem_tensor_like(staging.tRS_rD_layout, cutlass.BFloat16)
    return GateUpLoad(
        tiled_copy_s2r=tiled_copy_s2r,
        tSR_sC=thr_copy_s2r.partition_S(sC),
        tSR_rC=regs,
        tSR_rC_s2r=tiled_copy_s2r.retile(regs),
    )


def stage_gate_grad_sub_tile(ep: SubTileStaging, load: GateUpLoad, sub: int, n: int, buf, activation: str) -> None:
    """The activation's gradient of 16 columns of dh, in place in staged buffer buf: the
    buffer holds the pre-activation's gate and up blocks of those 16 d_ff columns (loaded
    by TMA; the caller waited for them) and leaves holding dg and du, fenced for the TMA
    store after the closing barrier of the consumer threads.

    The accumulator holds dh (the down projection's dgrad, [M, F]); column group n of its
    sub-tile `sub` is those 16 d_ff columns. ldmatrix brings the buffer into registers laid
    out as a staged sub-tile's (GateUpLoad): at each register position of the copy's first
    16-column group sits g, at the same position of the second u, and dh's register at that
    position of group n: dg = bf16(dh * u * act'(g)), du = bf16(dh * act(g)) in FP32 from
    dh rounded to bf16 first (the plain dgrad's output) and the bf16 g, u, as
    jax_cake.reference.gate_grad. No barrier separates the load from the store: ldmatrix
    and stmatrix share one thread layout, so each warp writes back exactly the elements it
    read (its own rows), each computed from the value read at its position."""
    cpy_v, cpy_m, cpy_n = (cute.size(ep.tRS_rD_layout, mode=[i]) for i in range(3))
    assert cpy_n == 2, "a 32-column sub-tile is two 16-column copy groups"
    cute.copy(load.tiled_copy_s2r, load.tSR_sC[(None, None, None, buf)], load.tSR_rC_s2r)
    d = cute.make_rmem_tensor_like(ep.tRS_rD_layout, cutlass.BFloat16)
    run = cute.make_layout(cpy_v)
    for m in range(cpy_m):
        dh = cute.make_rmem_tensor(run, ep.tRS_rD.element_type)
        g = cute.make_rmem_tensor(run, cutlass.BFloat16)
        u = cute.make_rmem_tensor(run, cutlass.BFloat16)
        for i in range(cpy_v):
            dh[i] = ep.tRS_rAcc[sub_tile_index(i + cpy_v * (m + cpy_m * n), sub, ep.tRS_rD_layout, ep.tRS_rAcc)]
            g[i] = load.tSR_rC[i + cpy_v * m]
            u[i] = load.tSR_rC[i + cpy_v * (m + cpy_m)]
        dhf = dh.load().to(cutlass.BFloat16).to(cutlass.Float32)
        act, slope = _act_and_slope(g.load().to(cutlass.Float32), activation)
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


def gate_up_blocks(tma_atom, m_blocks, s_blocks, tile_m: int, group, l_idx):
    """(the TMA partition of the staged blocks [copy, buffer], that of m_blocks' (tile_m,
    16, 2) blocks of 16-column group `group`, batch l_idx [copy, (M tile, 0, 0)]): m_blocks
    is a (M, 16, 2, F / 16, L) TMA tensor over gu or d_gu."""
    g = cute.zipped_divide(m_blocks[(None, None, None, group, l_idx)], (tile_m, 16, 2))
    return cute.nvgpu.cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(s_blocks, 0, 3), g)


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
        return z * (1.0 / (1.0 + cute.math.exp(-2.0 * GELU_C * (z + GELU_A * (z * z * z))))), None
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
