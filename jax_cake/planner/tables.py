"""Plan tables: per-architecture data files of measured verdicts.

A table (`tables/<arch>.json`) holds SM-count ranges; each range holds rows keyed by
(op, d_in, d_out, out dtype, batch) and a token range, with the program that wins there,
token counts excluded from the row, and where the verdict came from:
- "split" (wgrad only): the arrival-order split-K program, with its tile/splits where
  recorded; only `deterministic=False` reads these rows.
- "xla": XLA's own dot (the XLA path) was faster than jax_cake's program; read under both
  values of `deterministic` (XLA's GEMMs are reproducible, docs/planner.md), for fwd,
  dgrad and wgrad.
- "det": the deterministic program (what no row means too). A fwd or dgrad det row with
  a tile, schedule and cluster names the variant measured fastest at that point, which
  plan() runs instead of its rule's pick (under both values of `deterministic`: fwd and
  dgrad are one pass over K, reproducible either way); written by
  `python -m benchmarks.tune_tiles`.
The first row (in file order) that matches, covers the token count and does not exclude
it wins; no such row: the deterministic program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from pathlib import Path
from typing import Iterator, Mapping

from jax_cake import contract

TABLE_DIR = Path(__file__).parent / "tables"  # <arch>.json, read by load()


@dataclasses.dataclass(frozen=True)
class Row:
    d_in: int
    d_out: int
    out: str  # the plan's out dtype: w's dtype for wgrad, bfloat16 for fwd and dgrad
    min_tokens: int
    max_tokens: int
    program: str  # "split", "det" or "xla"
    exclude_tokens: tuple[int, ...]
    source: str
    tile: tuple[int | None, ...] | None = None
    splits: int | None = None
    reduction: str | None = None
    raster: str | None = None
    ctas: int | None = None
    op: str = "wgrad"  # "fwd", "dgrad" or "wgrad" (absent in the JSON: wgrad)
    batch: int = 1
    # xla rows: the measured median time ratio XLA / jax_cake; tile rows: the rule's
    # pick's median time / the row variant's (above 1)
    ratio: float | None = None
    schedule: str | None = None  # tile rows: "tiles" or "pingpong" (contract.SCHEDULES)
    cluster: tuple[int, int] | None = None  # tile rows: (1, 1) or (2, 1)

    def covers(self, tokens: int) -> bool:
        return self.min_tokens <= tokens <= self.max_tokens


@dataclasses.dataclass(frozen=True)
class SmRange:
    min_sms: int
    max_sms: int | None  # None: open above
    rows: tuple[Row, ...]

    def holds(self, sm_count: int) -> bool:
        return self.min_sms <= sm_count and (self.max_sms is None or sm_count <= self.max_sms)


@dataclasses.dataclass(frozen=True)
class Table:
    arch: str
    source: str
    sm_ranges: tuple[SmRange, ...]


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a table says about one point under deterministic=False."""

    program: str  # "split", "det" or "xla"
    row: Row | None
    why: str
    where: str = ""  # the table and the row's point, where a row speaks (for plan reasons)
    variant: Row | None = None  # a tile row that speaks here: the fwd/dgrad variant to run


_VALID_PROGRAMS = ("split", "det", "xla")
_VALID_OPS = ("fwd", "dgrad", "wgrad")
# What a tile row may name: the fwd/dgrad schedules (wgrad's split tail is not one) and clusters.
_TILE_ROW_SCHEDULES = tuple(s for s in contract.SCHEDULES if s != "split_tail")
_TILE_ROW_CLUSTERS = ((1, 1), (2, 1))


def _check_tile_row(arch: str, row: dict, op: str) -> None:
    """A det row with a tile names a fwd/dgrad variant in full; schedule and cluster
    belong to such rows only."""
    where = f"plan table {arch}: {op} {row['d_in']} -> {row['d_out']} ({row['program']} row)"
    tile, schedule, cluster = row.get("tile"), row.get("schedule"), row.get("cluster")
    if row["program"] != "det" or tile is None:
        for field, value in (("schedule", schedule), ("cluster", cluster)):
            if value is not None:
                raise ValueError(f"{where}: {field} {value!r} belongs to fwd/dgrad det rows with a tile only")
        return
    if op not in ("fwd", "dgrad"):
        raise ValueError(f"{where}: tile {tile!r} on a det row names a fwd or dgrad variant, not {op}")
    if not (isinstance(tile, (list, tuple)) and len(tile) == 3 and all(type(t) is int and t > 0 for t in tile)):
        raise ValueError(f"{where}: tile {tile!r} is not 3 positive ints [M, N, K]")
    if schedule not in _TILE_ROW_SCHEDULES:
        raise ValueError(f"{where}: schedule {schedule!r} is not one of {_TILE_ROW_SCHEDULES}")
    if cluster is None or tuple(cluster) not in _TILE_ROW_CLUSTERS:
        raise ValueError(f"{where}: cluster {cluster!r} is not [1, 1] or [2, 1]")


def parse(data: dict) -> Table:
    """Builds a Table from its JSON form, checking every field (a bad table fails loudly)."""
    ranges = []
    for r in data["sm_ranges"]:
        rows = []
        for row in r["rows"]:
            if row["program"] not in _VALID_PROGRAMS:
                raise ValueError(
                    f"plan table {data['arch']}: program {row['program']!r} is not one of {_VALID_PROGRAMS}"
                )
            if row["out"] not in ("float32", "bfloat16"):
                raise ValueError(f"plan table {data['arch']}: out {row['out']!r} is not float32 or bfloat16")
            op = row.get("op", "wgrad")
            if op not in _VALID_OPS:
                raise ValueError(f"plan table {data['arch']}: op {op!r} is not one of {_VALID_OPS}")
            if row["program"] == "split" and op != "wgrad":
                raise ValueError(f"plan table {data['arch']}: a {op} row cannot run the split program (wgrad only)")
            _check_tile_row(data["arch"], row, op)
            rows.append(
                Row(
                    d_in=int(row["d_in"]),
                    d_out=int(row["d_out"]),
                    out=row["out"],
                    min_tokens=int(row["min_tokens"]),
                    max_tokens=int(row["max_tokens"]),
                    program=row["program"],
                    exclude_tokens=tuple(int(t) for t in row.get("exclude_tokens", ())),
                    source=row.get("source", ""),
                    tile=tuple(row["tile"]) if row.get("tile") is not None else None,
                    splits=row.get("splits"),
                    reduction=row.get("reduction"),
                    raster=row.get("raster"),
                    ctas=row.get("ctas"),
                    op=op,
                    batch=int(row.get("batch", 1)),
                    ratio=float(row["ratio"]) if row.get("ratio") is not None else None,
                    schedule=row.get("schedule"),
                    cluster=tuple(row["cluster"]) if row.get("cluster") is not None else None,
                )
            )
        ranges.append(SmRange(int(r["min_sms"]), r.get("max_sms"), tuple(rows)))
    return Table(data["arch"], data.get("source", ""), tuple(ranges))


@functools.cache
def _load_file(arch: str) -> Table | None:
    path = TABLE_DIR / f"{arch}.json"
    if not path.exists():
        return None
    return parse(json.loads(path.read_text()))


_overrides: dict[str, Table] = {}


def load(arch: str) -> Table | None:
    """The table for `arch` (an override from `use_table` first), or None."""
    if arch in _overrides:
        return _overrides[arch]
    return _load_file(arch)


@contextlib.contextmanager
def use_table(table: Table) -> Iterator[None]:
    """Plans inside the block read `table` for its architecture (tests, the tuner).

    Planning happens at trace time: a function jitted before the block keeps its plan.
    """
    previous = _overrides.get(table.arch)
    _overrides[table.arch] = table
    try:
        yield
    finally:
        if previous is None:
            _overrides.pop(table.arch, None)
        else:
            _overrides[table.arch] = previous


def verdict(
    arch: str,
    sm_count: int,
    d_in: int,
    d_out: int,
    out: str,
    tokens: int,
    *,
    op: str = "wgrad",
    batch: int = 1,
    deterministic: bool = False,
) -> Verdict:
    """The table's program for one point; "det" when no row covers it.

    deterministic=True skips split rows (it never runs the split program): only xla and
    det rows speak for it.
    """
    table = load(arch)
    if table is None:
        return Verdict("det", None, f"no plan table for {arch}")
    excluded = None
    for sm_range in table.sm_ranges:
        if not sm_range.holds(sm_count):
            continue
        for row in sm_range.rows:
            if (row.op, row.d_in, row.d_out, row.out, row.batch) != (op, d_in, d_out, out, batch):
                continue
            if not row.covers(tokens) or (deterministic and row.program == "split"):
                continue
            where = (
                f"the {arch} plan table ({sm_count} SMs, {op} {d_in} -> {d_out} {out}"
                + (f", batch {batch}" if batch != 1 else "")
                + f", tokens {row.min_tokens}..{row.max_tokens})"
            )
            if tokens in row.exclude_tokens:
                excluded = excluded or (row, where)
                continue
            if row.program == "xla":
                measured = f": median time ratio {row.ratio:.3f}" if row.ratio is not None else ""
                why = f"{where} records XLA's dot faster here ({row.source}{measured})"
                return Verdict("xla", row, why, where)
            variant = row if row.program == "det" and row.tile is not None else None
            return Verdict(row.program, row, f"{where}: {row.program} ({row.source})", where, variant)
    if excluded is not None:
        row, where = excluded
        return Verdict(
            "det",
            row,
            f"{where}: {tokens} tokens is excluded, the deterministic program won there ({row.source})",
        )
    return Verdict(
        "det", None, f"no {arch} table row for {sm_count} SMs, {op} {d_in} -> {d_out} {out} at {tokens} tokens"
    )


def is_tile_row(row: Mapping) -> bool:
    """Whether a row in its JSON form is a per-shape tile row (a det row naming its variant,
    written by benchmarks.tune_tiles)."""
    return row.get("program") == "det" and row.get("tile") is not None


def is_range_for(sm_range: Mapping, sms: int) -> bool:
    """Whether a range in its JSON form is the one for exactly `sms` SMs: the range a tuner
    that measured on a GPU of `sms` SMs writes."""
    return (sm_range["min_sms"], sm_range.get("max_sms")) == (sms, sms)
