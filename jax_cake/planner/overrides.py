"""Forcing overrides: `force(...)` pins parts of the plans traced inside its block.

The benchmark and the tuner time each arm (an algorithm, tile, split count, schedule or
cluster) this way; the planner (jax_cake.planner.choose) reads the pins with `forced`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np

from jax_cake import contract

_forced: dict[str, Any] = {}


def forced(key: str) -> Any:
    """The pinned value of `key` ("program", "splits", "tile", "schedule", "cluster",
    "raster"), or
    None outside a `force` block or where the block leaves it to the planner."""
    return _forced.get(key)


def applies(op: str, m: int, n: int, k: int) -> bool:
    """Whether the pins of the current block apply to the GEMM (op, m, n, k) (Plan.op, m,
    n, k): always, unless the block names one GEMM (`force(gemm=...)`)."""
    gemm = _forced.get("gemm")
    return gemm is None or tuple(gemm) == (op, m, n, k)


@contextlib.contextmanager
def released() -> Iterator[None]:
    """No pins inside the block (a GEMM that the current block's `gemm` does not name)."""
    saved = dict(_forced)
    _forced.clear()
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)


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
    tokens, d_out, d_in; "dgrad": tokens, d_in, d_out; "wgrad": d_out, d_in, tokens): the
    pins apply to that GEMM only, every other plan in the block is the planner's own (to
    try one GEMM's variants inside a whole training step). Planning is at trace time: jit
    a new function inside the block (a function traced earlier keeps its plan).
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
    if gemm is not None and not (
        len(gemm) == 4 and gemm[0] in ("fwd", "dgrad", "wgrad") and all(isinstance(d, int) and d > 0 for d in gemm[1:])
    ):
        raise ValueError(f"force: gemm must be None or (op, m, n, k) with op 'fwd', 'dgrad' or 'wgrad', got {gemm!r}")
    saved = dict(_forced)
    _forced.clear()
    _forced.update(
        program=program, splits=splits, tile=tile, schedule=schedule, cluster=cluster, raster=raster, gemm=gemm
    )
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)
