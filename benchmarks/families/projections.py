"""What the projection families (dense, router, batched) share: the ops timed on one
projection y = project(x, w), their table (one row per point, op and mode; each arm's us
and the baseline/new ratios; geomeans per op and mode) and `--merge`.

Ops: fwd (y = x w^T), dgrad (dx), wgrad (dw), bwd = dgrad + wgrad, 2fwd+bwd = the
checkpointed step (forward, forward again under remat, backward; harness.op_fn), and for
the router fwd+bwd (the value and both gradients). Each point, op and arm is one
harness.measure_point: the arms in paired groups, every step followed by an L2 flush.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Mapping, Sequence

from absl import app, flags

from benchmarks import harness, plan_rule
from benchmarks import markdown as md

FLAGS = flags.FLAGS
# Flags every projection family reads (beyond the protocol's); each adds its grid's.
READS = ("tokens", "ops", "arms")
_ARM_LABEL = {"det": "det", "split": "split", "new": "new", "xla": "XLA", "cublas": "cuBLAS"}
_ARM_LABEL.update(xla_x3="XLA x3", xla_highest="XLA highest")


@dataclasses.dataclass(frozen=True)
class OpTable:
    """A projection family's ops, arm kinds and report columns: GPU, SMs, the shape
    columns, op, mode, one "us" column per arm (new last), then baseline/new ratios."""

    ops: tuple[str, ...]
    arms: tuple[str, ...]  # arm kinds, in run order
    shape_columns: tuple[str, ...]
    shape: Callable[[harness.Point], tuple]  # a point's values of the shape columns

    @property
    def report_arms(self) -> list[str]:
        return [a for a in self.arms if a != "new"] + ["new"]

    @property
    def ratio_arms(self) -> list[str]:
        return [a for a in self.arms if a not in ("new", "split")]

    @property
    def columns(self) -> tuple[str, ...]:
        return (
            ("GPU", "SMs", *self.shape_columns, "op", "mode")
            + tuple(f"{_ARM_LABEL[a]} us" for a in self.report_arms)
            + tuple(f"{_ARM_LABEL[a]}/new" for a in self.ratio_arms)
        )


def table_rows(table: OpTable, header: dict, samples: Sequence[dict]) -> list[dict]:
    """One row per (point, op, mode)."""
    medians = harness.run_medians(samples)
    rows = []
    order = lambda k: (
        plan_rule.MODES.index(k[2]),
        k[0].batch,
        k[0].d_in,
        k[0].d_out,
        harness.OUT_DTYPES.index(k[0].out),
        k[0].tokens,
        harness.ALL_OPS.index(k[1]),
    )
    # Arms with options (split/sN/tMxNxK) get their own columns after the family's, in
    # the order first seen, so every arm asked for is reported.
    extra = list(dict.fromkeys(k[3] for k in medians if "/" in k[3]))
    for point, op, mode in sorted({k[:3] for k in medians}, key=order):
        us = {arm: medians.get((point, op, mode, arm)) for arm in [*table.report_arms, *extra]}
        row = {"GPU": header["gpu"], "SMs": header["sms"] or "n/a"}
        row.update(zip(table.shape_columns, table.shape(point)))
        row.update(op=op, mode=mode)
        for arm in table.report_arms:
            row[f"{_ARM_LABEL[arm]} us"] = us[arm]
        for base in table.ratio_arms:
            row[f"{_ARM_LABEL[base]}/new"] = us[base] / us["new"] if us[base] and us["new"] else None
        for arm in extra:
            row[f"{arm} us"] = us[arm]
            row[f"{arm}/new"] = us[arm] / us["new"] if us[arm] and us["new"] else None
        rows.append(row)
    return rows


def report_columns(table: OpTable, rows: Sequence[dict]) -> list[str]:
    """The family's columns, then those of any arm with options the rows carry."""
    columns = list(table.columns)
    return columns + [c for c in dict.fromkeys(c for r in rows for c in r) if c not in columns]


def geomean_lines(table: OpTable, rows: Sequence[dict]) -> list[str]:
    new_ratios = [c for c in report_columns(table, rows) if c.endswith("/new")]
    return harness.geomean_lines(rows, table.ops, lambda picked: new_ratios)


def markdown(table: OpTable, header: dict | None, rows: Sequence[dict], title: str | None = None) -> str:
    """The table with its geomeans; `title` replaces the header line (merged tables)."""
    out = [
        title if title is not None else harness.header_line(header),
        "",
        "Geomeans over rows (range in parentheses):",
        *geomean_lines(table, rows),
        "",
        *md.dict_table(report_columns(table, rows), rows),
    ]
    return "\n".join(out) + "\n"


def merge_rows(table: OpTable, rows: Sequence[dict]) -> list[dict]:
    """One row per (point, op, mode): a later row replaces an earlier one in its place
    (a re-measured subset merged over a full grid)."""
    merged: dict[tuple, dict] = {}
    for row in rows:
        merged[tuple(row.get(c) for c in table.shape_columns) + (row.get("op"), row.get("mode"))] = row
    return list(merged.values())


def merged_title(paths: Sequence[str]) -> str:
    return (
        f"Rows merged from {', '.join(os.path.basename(p) for p in paths)} (each measured as its run's "
        "header says; a later file's row replaces an earlier file's row of the same point, op and mode); "
        "ratios = baseline us / new us (above 1: new is faster)"
    )


def apply_grid(name: str) -> None:
    """--grid's widths into --d_out (or the router's --experts) where that flag is not
    given; children then get them explicitly."""
    if not FLAGS[name].present:
        d_out, experts = harness.GRIDS[FLAGS.grid]
        setattr(FLAGS, name, [str(v) for v in (experts if name == "experts" else d_out)])


def family(
    name: str,
    about: str,
    table: OpTable,
    project: Callable[[harness.ArmSpec], Callable],
    points: Callable[[], list[harness.Point]],
    reads: Sequence[str],
    defaults: Mapping[str, object] | None = None,
    grid: str | None = None,
) -> harness.Family:
    """The harness Family of a projection family: points() are its points from the flags,
    project(arm) -> (x, w) -> y its forward; `grid` names the flag --grid fills in."""

    def check():
        harness.selected("ops", table.ops)
        bad = [a for a in FLAGS.arms if harness.parse_arm(a).kind not in table.arms]
        if bad:
            raise app.UsageError(f"--arms: {bad} not in {list(table.arms)} (--family={name})")
        if grid:
            apply_grid(grid)

    def child(mode: str, run: int, timer_kind: str) -> list[dict]:
        arms = [harness.parse_arm(a) for a in FLAGS.arms]
        common = dict(steps=FLAGS.steps, groups=FLAGS.groups, flush_mb=FLAGS.flush_mb, timer_kind=timer_kind)
        return harness.collect(points(), list(FLAGS.ops), arms, project, mode, run, **common)

    def report(header: dict, samples: Sequence[dict]) -> harness.Report:
        rows = table_rows(table, header, samples)
        return harness.Report(markdown(table, header, rows), report_columns(table, rows), rows)

    def merge(paths: Sequence[str]) -> harness.Report:
        rows = merge_rows(table, harness.read_csv_rows(paths))
        return harness.Report(markdown(table, None, rows, merged_title(paths)), report_columns(table, rows), rows)

    defaults = {"ops": list(table.ops), "arms": list(table.arms), **(defaults or {})}
    return harness.Family(name, about, (*READS, *reads), defaults, child, report, check, merge=merge)
