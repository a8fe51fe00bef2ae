"""Forcing overrides: `force(...)` pins parts of the plans traced inside its block.

The benchmark and the tuner time each arm (an algorithm, tile, split count, schedule or
cluster) this way. The planner reads the block once where a plan starts (`active`: one
frozen `Pins`, or None outside a block), narrows it to the GEMM being planned
(`for_gemm`) and passes the pins down to the rules they override (jax_cake.planner.choose).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import numpy as np

from jax_cake import contract
from jax_cake.planner.plan_type import GROUPED_OPS


@dataclasses.dataclass(frozen=True)
class Pins:
    """The pins of one `force` block (its arguments, checked): program "det", "split" or
    "xla"; the others None where the block leaves them to the planner."""

    program: str
    splits: int | None = None
    tile: tuple[int, int, int] | None = None
    schedule: str | None = None
    cluster: tuple[int, int] | None = None
    raster: str | None = None
    gemm: tuple[str, int, int, int] | None = None


_active: Pins | None = None


def active() -> Pins | None:
    """The pins of the current `force` block, None outside one."""
    return _active


def for_gemm(block: Pins | None, op: str, m: int, n: int, k: int) -> Pins | None:
    """The pins of `block` that apply to the GEMM (op, m, n, k) (Plan.op, m, n, k): all of
    them, unless the block names one GEMM (`force(gemm=...)`) and it is another; None
    (the planner's own plan) there and outside a block."""
    if block is None or (block.gemm is not None and block.gemm != (op, m, n, k)):
        return None
    return block


def is_int(v) -> bool:
    """A Python or numpy integer, not a bool (the planner's sizes and pins)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


@contextlib.contextmanager
def force(
    program: str,
    *,
    splits: int | None = None,
    tile: tuple[int, int, int] | None = None,
    schedule: str | None = None,
    cluster: tuple[int, int] | None = None,
    raster: str | None = None,
    gemm: tuple[str, int, int, int] | None = None,
) -> Iterator[None]:
    """Plans traced inside the block use `program` for the weight gradient.

    program: the algorithm, "det" or "split" (Plan.algorithm), or "xla" (the XLA path for
    every op). schedule "pingpong" runs fwd and dgrad on the ping-pong 128 x 128 variants,
    "tiles" on the cooperative tiles (None: the planner's rule, `choose.pingpong_rule`).
    cluster (1, 1) or (2, 1) sets fwd/dgrad's CTA pairing where the library holds that
    variant (None: the planner's rule). raster: the kernels' tile walk, "m", "n" or "m<B>"
    (Plan.raster; None: the planner's rule). gemm: (op, m, n, k) as Plan.op, m, n, k ("fwd":
    tokens, d_out, d_in; "dgrad": tokens, d_in, d_out; "wgrad": d_out, d_in, tokens; the
    grouped ops' as the same roles', tokens the unpadded rows): the
    pins apply to that GEMM only, every other plan in the block is the planner's own (to
    try one GEMM's variants inside a whole training step). Planning is at trace time: jit
    a new function inside the block (a function traced earlier keeps its plan). The grouped
    kernels take the block's raster, and its tile where a grouped variant of the op has it
    (planner.grouped.kernel_tiles; another tile leaves them on their default).
    """
    if program not in ("det", "split", "xla"):
        raise ValueError(f"force: program must be 'det', 'split' or 'xla', got {program!r}")
    if schedule not in (None, "pingpong", "tiles"):
        raise ValueError(f"force: schedule must be None, 'pingpong' or 'tiles', got {schedule!r}")
    if cluster not in (None, (1, 1), (2, 1)):
        raise ValueError(f"force: cluster must be None, (1, 1) or (2, 1), got {cluster!r}")
    if splits is not None:
        if not is_int(splits):
            raise TypeError(f"force: splits must be None or an int, got {type(splits).__name__}")
        if splits < 1:
            raise ValueError(f"force: splits must be >= 1, got {splits}")
        splits = int(splits)
    if tile is not None:
        if not (isinstance(tile, (tuple, list)) and len(tile) == 3 and all(is_int(d) for d in tile)):
            raise TypeError(f"force: tile must be None or (tile_m, tile_n, tile_k), three ints, got {tile!r}")
        if min(tile) < 1:
            raise ValueError(f"force: tile sizes must be >= 1, got {tile!r}")
        tile = tuple(int(d) for d in tile)
    if raster is not None:
        try:
            contract.raster_code(raster)
        except ValueError as e:
            raise ValueError(f"force: {e}") from None
    gemm_ops = ("fwd", "dgrad", "wgrad", *GROUPED_OPS)
    if gemm is not None and not (
        len(gemm) == 4 and gemm[0] in gemm_ops and all(isinstance(d, int) and d > 0 for d in gemm[1:])
    ):
        raise ValueError(f"force: gemm must be None or (op, m, n, k) with op one of {gemm_ops}, got {gemm!r}")
    global _active
    saved = _active
    _active = Pins(
        program,
        splits=splits,
        tile=tile,
        schedule=schedule,
        cluster=cluster,
        raster=raster,
        gemm=None if gemm is None else tuple(gemm),
    )
    try:
        yield
    finally:
        _active = saved
