"""Per-shape fwd / dgrad tiles for the plan table, chosen from the core family's paired timings.

    python -m benchmarks.bench --family=core --csv=$OUT/core.csv --tokens=8192 --only=c2x1   # on the GPU
    python -m benchmarks.tune_tiles --csv=$OUT/core.csv            # prints the verdicts (no GPU needed)
    python -m benchmarks.tune_tiles --csv=$OUT/core.csv --write    # into jax_cake/planner/tables/<arch>.json

The planner's tile rule (utilization times a per-tile prior) cannot tell apart ping-pong
tiles a few columns wide: at some Llama shapes a 128 x 176 or 128 x 208 variant runs a few
percent faster than the rule's pick, at others slower. This tool reads the core family's CSVs
(every compiled variant forced at each (op, T, d_in, d_out), timed in paired groups with
the arms interleaved) and, per point, compares each variant with the one plan() picks
there without tile rows (the rule's pick, planned for the CSV's GPU on this machine: no
GPU needed). A variant earns a tile row where
- its result matched XLA's (the CSV's `ok`), with the planner's own tile walk;
- it ran faster than the rule's pick in enough of the paired groups that a one-sided
  sign test gives p < 0.05 (at least 5 groups: every one of 5 or 6, 7 of 8, 10 of 12);
- its median time is at least `--min_gain` below the pick's;
and the fastest such variant is written as an fwd / dgrad row of program "det" with its
tile, schedule and cluster at exactly that T (jax_cake/planner/tables.py says how plan()
reads it). A measured point where the rule's pick stays best loses any earlier tile row;
every other row of the table stays. Points where the table runs XLA's dot are skipped.
Several CSVs (core runs on one GPU and jax version, any days) pool each point's
paired groups, so runs too noisy for a verdict alone can reach one together. The printed
table also gives, per point, XLA's time over that of the program the table runs after the
tune, and in how many paired groups XLA was faster: where XLA still wins, and by how much.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Mapping, Sequence

from absl import app, flags

from benchmarks import markdown as md
from benchmarks import plan_rule
from jax_cake.planner import tables

FLAGS = flags.FLAGS
TILE_OPS = ("fwd", "dgrad")
MIN_GROUPS = 5  # the fewest paired groups whose all-win sign test is below 0.05 (2^-5)


@dataclasses.dataclass(frozen=True)
class Arm:
    """One timed variant of one point (a row of the core family's CSV)."""

    tile: tuple[int, int, int]
    cluster: tuple[int, int]
    schedule: str
    us: float
    groups_us: tuple[float, ...]

    @property
    def name(self) -> str:
        sched = "ping-pong" if self.schedule == "pingpong" else "cooperative"
        return f"{self.tile[0]}x{self.tile[1]} {sched} c{self.cluster[0]}x{self.cluster[1]}"


@dataclasses.dataclass(frozen=True)
class Point:
    op: str
    tokens: int
    d_in: int
    d_out: int


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A point's outcome: `winner` is None where the rule's pick stays (or no pick timed)."""

    point: Point
    pick: Arm | None
    winner: Arm | None
    wins: int
    groups: int
    why: str

    def row(self, source: str) -> dict:
        """The table row (tables.Row's JSON form) of a winning variant."""
        p, w = self.point, self.winner
        return {
            "op": p.op,
            "d_in": p.d_in,
            "d_out": p.d_out,
            "out": "bfloat16",
            "min_tokens": p.tokens,
            "max_tokens": p.tokens,
            "program": "det",
            "exclude_tokens": [],
            "tile": list(w.tile),
            "schedule": w.schedule,
            "cluster": list(w.cluster),
            "ratio": round(self.pick.us / w.us, 4),
            "source": source,
            "evidence": self.why,
        }


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split("x"))


XLA = ((), (), "xla")  # the variant key of the core family's XLA arm


def _timed(paths: Sequence[str]) -> tuple[dict[Point, dict[tuple, dict[int, tuple[float, ...]]]], dict]:
    """({point: {variant: {run index: paired groups}}}, header) from the core family's CSVs: fwd /
    dgrad rows with the planner's tile walk, XLA's under the key XLA; an arm whose result
    missed XLA's has no groups. header holds the gpu / sms / jax columns where the CSVs have
    them (the same in every row, else an error) and their dates."""
    runs: dict[Point, dict[tuple, dict[int, tuple[float, ...]]]] = {}
    header: dict = {}
    dates: set[str] = set()
    for index, path in enumerate(paths):
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                if r["op"] not in TILE_OPS or r.get("raster") or not (r["tile"] or r["arm"] == "xla"):
                    continue
                for key in ("gpu", "sms", "jax"):
                    if r.get(key) and header.setdefault(key, r[key]) != r[key]:
                        raise ValueError(f"{path}: rows of two setups ({key} {header[key]} and {r[key]})")
                if r.get("date"):
                    dates.add(r["date"])
                p = Point(r["op"], int(r["T"]), int(r["d_in"]), int(r["d_out"]))
                variant = (_ints(r["tile"]), _ints(r["cluster"]), r["schedule"]) if r["tile"] else XLA
                groups = tuple(float(g) for g in r["groups_us"].split()) if r["ok"] == "True" else ()
                runs.setdefault(p, {}).setdefault(variant, {})[index] = groups
    if dates:
        header["date"] = ", ".join(sorted(dates))
    return runs, header


def _pooled(
    runs: Mapping[Point, Mapping[tuple, Mapping[int, tuple[float, ...]]]], only: tuple | None = None
) -> dict[Point, list[Arm]]:
    """Each point's arms timed (and matching XLA) in every run of it, their groups pooled run
    after run, so that the k-th group of one arm pairs with the k-th of every other. only:
    the one variant key to make arms of (the runs of a point still counted over all)."""
    points: dict[Point, list[Arm]] = {}
    for p, variants in runs.items():
        files = sorted({i for by_file in variants.values() for i in by_file})
        for variant, by_file in variants.items():
            if only is not None and variant != only:
                continue
            if sorted(by_file) != files or not all(by_file.values()):
                continue  # missing from a run, or off XLA's result there: no pairing
            pooled = tuple(g for i in files for g in by_file[i])
            points.setdefault(p, []).append(Arm(*variant, statistics.median(pooled), pooled))
    return points


def read_csvs(paths: Sequence[str]) -> tuple[dict[Point, list[Arm]], dict[Point, Arm], dict]:
    """({point: timed kernel variants}, {point: XLA's arm}, header) from the core family's CSVs.
    Only arms with the planner's tile walk whose result matched XLA's count. A point timed
    in several CSVs (runs of one GPU and jax version) pools its paired groups, run after
    run, over the variants timed and matching XLA in every one of those runs; XLA's arm
    where every run of the point timed it, pooled the same way, so that its groups pair
    with theirs. header: see _timed."""
    runs, header = _timed(paths)
    kernels = {p: {v: g for v, g in variants.items() if v != XLA} for p, variants in runs.items()}
    xla = {p: arm for p, (arm,) in _pooled(runs, only=XLA).items()}
    return _pooled(kernels), xla, header


def without_tile_rows(data: Mapping) -> dict:
    """The table JSON with its tile rows removed: what plan() reads for the rule's pick."""
    return {
        **data,
        "sm_ranges": [
            {**r, "rows": [row for row in r["rows"] if not tables.is_tile_row(row)]} for r in data["sm_ranges"]
        ],
    }


def rule_pick(point: Point, device, rule_table: tables.Table) -> tuple | None:
    """(tile, cluster, schedule) plan() runs at `point` on `device` under `rule_table` (a
    table without tile rows: without_tile_rows), or None where it runs XLA's dot (an xla
    row, or no kernel)."""
    from jax_cake import planner

    with tables.use_table(rule_table):
        p = planner.plan(point.op, tokens=point.tokens, d_in=point.d_in, d_out=point.d_out, device=device)
    if p.backend == "xla":
        return None
    return tuple(p.tile), tuple(p.cluster), p.schedule


def decide(point: Point, arms: Sequence[Arm], pick: tuple | None, min_gain: float) -> Verdict:
    """The point's verdict: the fastest variant that beats the rule's pick (module docstring)."""
    if pick is None:
        return Verdict(point, None, None, 0, 0, "the table runs XLA's dot here")
    base = next((a for a in arms if (a.tile, a.cluster, a.schedule) == pick), None)
    if base is None:
        return Verdict(point, None, None, 0, 0, f"the rule's pick {pick} was not timed")
    n = len(base.groups_us)
    if n < MIN_GROUPS:
        return Verdict(point, base, None, 0, n, f"{n} paired groups: too few for a verdict (at least {MIN_GROUPS})")
    best, best_wins = None, 0
    for a in arms:
        if a is base or len(a.groups_us) != len(base.groups_us):
            continue
        wins = sum(g < b for g, b in zip(a.groups_us, base.groups_us))  # ties are no wins
        if plan_rule.sign_test_p(wins, n) >= plan_rule.SIGN_TEST_P_MAX or a.us > base.us * (1 - min_gain):
            continue
        if best is None or a.us < best.us:
            best, best_wins = a, wins
    if best is None:
        return Verdict(point, base, None, 0, n, f"the rule's {base.name} ({base.us:.1f} us) stays: no variant beat it")
    why = (
        f"T={point.tokens}: {best.name} {best.us:.1f} us against the rule's {base.name} {base.us:.1f} us "
        f"(median of {n} paired groups; faster in {best_wins}/{n}, sign test p={plan_rule.sign_test_p(best_wins, n):.3g})"
    )
    return Verdict(point, base, best, best_wins, n, why)


def merge_rows(data: Mapping, sms: int, verdicts: Sequence[Verdict], source: str) -> dict:
    """`data` with, in its range for exactly `sms` SMs (added if missing), the tile rows of
    the measured points replaced by the winners' rows (appended after the other rows: an
    xla row of the same point, read first, keeps XLA's dot for plans that may use it)."""
    measured = {(v.point.op, v.point.d_in, v.point.d_out, v.point.tokens) for v in verdicts if v.pick is not None}

    def remeasured(row):
        return tables.is_tile_row(row) and any(
            (op, d_in, d_out) == (row["op"], row["d_in"], row["d_out"]) and row["min_tokens"] <= t <= row["max_tokens"]
            for op, d_in, d_out, t in measured
        )

    ranges = [dict(r) for r in data.get("sm_ranges", [])]
    target = next((r for r in ranges if tables.is_range_for(r, sms)), None)
    if target is None:
        target = {"min_sms": sms, "max_sms": sms, "rows": []}
        ranges.append(target)
        ranges.sort(key=lambda r: r["min_sms"])
    target["rows"] = [row for row in target["rows"] if not remeasured(row)] + [
        v.row(source) for v in verdicts if v.winner is not None
    ]
    return {**data, "sm_ranges": ranges}


def report(verdicts: Sequence[Verdict], xla: Mapping[Point, Arm] | None = None) -> str:
    """The verdicts as a markdown table; with `xla` (read_csvs), XLA's time over the time of
    the program the table runs after the tune (the winner, else the rule's pick) and in how
    many paired groups XLA ran faster: where XLA still wins, and by how much."""
    xla = xla or {}
    cols = ("op", "T", "d_in", "d_out", "rule's pick", "pick us", "fastest variant", "its us", "gain", "row")
    cols += ("XLA us", "XLA / table's program", "XLA faster in") if xla else ()
    lines = []
    for v in verdicts:
        p, base, w = v.point, v.pick, v.winner
        line = [
            p.op,
            str(p.tokens),
            str(p.d_in),
            str(p.d_out),
            base.name if base else "-",
            f"{base.us:.1f}" if base else "-",
            w.name if w else "-",
            f"{w.us:.1f}" if w else "-",
            f"{base.us / w.us - 1:+.1%}" if w else "-",
            "tile row" if w else v.why,
        ]
        if xla:
            x, run = xla.get(p), w or base
            if x is None or run is None:
                line += ["-", "-", "-"]
            else:
                paired = len(x.groups_us) == len(run.groups_us)
                faster = sum(a < b for a, b in zip(x.groups_us, run.groups_us))
                line += [f"{x.us:.1f}", f"{x.us / run.us:.3f}", f"{faster}/{len(x.groups_us)}" if paired else "-"]
        lines.append(line)
    return "\n".join(md.table(cols, lines)) + "\n"


def main(argv):
    del argv
    from jax_cake.planner import device as device_lib

    points, xla, header = read_csvs(FLAGS.csv)
    if not points:
        raise app.UsageError(f"--csv: no timed fwd/dgrad variants in {', '.join(FLAGS.csv)}")
    sms = int(header.get("sms") or FLAGS.sm_count)
    gpu = header.get("gpu") or FLAGS.gpu
    device = device_lib.DeviceInfo("cuda", f"NVIDIA {gpu}", FLAGS.arch, sms)
    path = Path(FLAGS.table or tables.TABLE_DIR / f"{FLAGS.arch}.json")
    data = json.loads(path.read_text()) if path.exists() else {"arch": FLAGS.arch, "source": "", "sm_ranges": []}
    rule_table = tables.parse(without_tile_rows(data))
    verdicts = [
        decide(p, arms, rule_pick(p, device, rule_table), FLAGS.min_gain)
        for p, arms in sorted(points.items(), key=lambda kv: dataclasses.astuple(kv[0]))
    ]
    measured = f"{header['date']} on NVIDIA {gpu}, jax {header['jax']}" if header.get("date") else FLAGS.measured
    if not measured:
        raise app.UsageError("--measured: the CSVs carry no date / jax columns; say when and where they were measured")
    source = f"benchmarks.tune_tiles from core {measured}"
    print(report(verdicts, xla))
    text = json.dumps(merge_rows(data, sms, verdicts, source), indent=1) + "\n"
    if FLAGS.write:
        path.write_text(text)
        print(f"wrote {path}", file=sys.stderr)
    else:
        print(text)


def define_flags() -> None:
    flags.DEFINE_list(
        "csv", None, "CSVs of the core family (bench --family=core --csv=...; one or more runs).", required=True
    )
    flags.DEFINE_float("min_gain", 0.005, "A tile row needs a median this much faster than the rule's pick.")
    flags.DEFINE_string("arch", "sm_90a", "The table's architecture.")
    flags.DEFINE_integer("sm_count", 132, "SMs of the measuring GPU where the CSVs have no sms column.")
    flags.DEFINE_string("gpu", "H200", "The measuring GPU where the CSVs have no gpu column.")
    flags.DEFINE_string("measured", "", "When and where (date, GPU, jax) where the CSVs have no such columns.")
    flags.DEFINE_string("table", None, "Table path (default jax_cake/planner/tables/<arch>.json).")
    flags.DEFINE_bool("write", False, "Write the table file; otherwise print it.")


if __name__ == "__main__":
    define_flags()
    app.run(main)
