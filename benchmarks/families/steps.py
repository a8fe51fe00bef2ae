"""What the step families (residual, accumulate, gated) share: a point is (T, d_in, d_out)
of --tokens x --d_in x --d_out, and each arm is a whole step program (buf, *args) -> (buf,
...) that the family builds; harness.measure_arms times the arms in paired groups, every
step followed by an L2 flush. The table gives each arm's us per point and mode, and
baseline / fused for every other arm (above 1: the fused arm is faster).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Mapping, Sequence

from absl import app, flags

from benchmarks import harness, plan_rule
from benchmarks import markdown as md

FLAGS = flags.FLAGS
READS = ("tokens", "d_in", "d_out", "arms")


def points(out_dtype: str) -> list[harness.Point]:
    return [
        harness.Point(int(t), int(i), int(o), out_dtype) for i in FLAGS.d_in for o in FLAGS.d_out for t in FLAGS.tokens
    ]


def rows(samples: Sequence[dict], arms: Sequence[str], op: str, extra: Sequence[tuple] = ()) -> list[dict]:
    """One row per (point, mode): each arm's us and every other arm's us over the fused
    arm's; `extra` are (column, value) pairs after T."""
    medians = harness.run_medians(samples)
    keys = sorted({(k[0], k[2]) for k in medians}, key=lambda k: (plan_rule.MODES.index(k[1]), k[0].d_in, -k[0].d_out))
    out = []
    for point, mode in keys:
        us = {a: medians.get((point, op, mode, a)) for a in arms}
        row = {"d_in -> d_out": f"{point.d_in} -> {point.d_out}", "T": point.tokens, **dict(extra), "mode": mode}
        row.update({f"{a} us": us[a] for a in arms})
        if "fused" in arms:
            fused = us["fused"]
            row.update({f"{a}/fused": us[a] / fused if us[a] and fused else None for a in arms if a != "fused"})
        out.append(row)
    return out


def family(
    name: str,
    about: str,
    op: str,
    all_arms: Sequence[str],
    measure: Callable[[harness.Point, Sequence[str], str], dict[str, list[float]]],
    note: Callable[[], str],
    defaults: Mapping[str, object],
    out_dtype: str = "bfloat16",
    reads: Sequence[str] = (),
    extra: Callable[[], Sequence[tuple]] = lambda: (),
) -> harness.Family:
    """The harness Family of a step family: measure(point, arms, timer kind) -> {arm: per-group
    median us}; note() follows the table's header line; extra() -> (column, value) pairs."""

    def check():
        arms = list(FLAGS.arms)
        if not arms or any(a not in all_arms for a in arms):
            raise app.UsageError(f"--arms: {arms} must be a non-empty subset of {list(all_arms)} (--family={name})")

    def child(mode: str, run: int, timer_kind: str) -> list[dict]:
        samples = []
        for point in points(out_dtype):
            suffix = "".join(f" {c} {v}" for c, v in extra())
            print(f"[{mode} run {run}] {name} {point.label}{suffix}", file=sys.stderr, flush=True)
            for arm, groups_us in measure(point, list(FLAGS.arms), timer_kind).items():
                sample = {**dataclasses.asdict(point), "op": op, "mode": mode, "run": run, "arm": arm}
                samples.append({**sample, "groups_us": groups_us})
        return samples

    def report(header: dict, samples: Sequence[dict]) -> harness.Report:
        arms = list(FLAGS.arms)
        table = rows(samples, arms, op, extra())
        columns = list(dict.fromkeys(c for r in table for c in r)) or ["d_in -> d_out", "T", "mode"]
        text = "\n".join([harness.header_line(header) + note(), "", *md.dict_table(columns, table)]) + "\n"
        return harness.Report(text, columns, table)

    return harness.Family(name, about, (*READS, *reads), {"arms": list(all_arms), **defaults}, child, report, check)
