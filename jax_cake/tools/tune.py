"""Measures split-K candidates against the deterministic program and writes the plan table.

    python -m jax_cake.tools.tune --tokens=16172,16231,16384 --d_in=4096 --d_out=48 --out_dtype=float32
    python -m jax_cake.tools.tune ... --write   # into jax_cake/planner/tables/<arch>.json

Per point (T, d_in, d_out, out dtype) and candidate split program (`split/tMxNxK` per
arrival-order wgrad tile of jax_cake.planner.variants, optionally `--splits` counts),
with the timing machinery of jax_cake.tools.bench (child process per run and mode, paired
groups, L2 flushed, CUPTI device time):
- (a) wgrad alone, modes g and e: each run's paired groups, det vs candidate;
- (b) wgrad next to a busy kernel holding 8, 16 or 32 SMs on another stream;
- (c) bwd and 2fwd+bwd, modes g and e;
then jax_cake.tools.plan_rule decides. With --screen (the default) a first pass times wgrad
alone in graph mode (one run of paired groups) at every point; a candidate that fails (a)
there fails the rule (it needs every run of both modes), so only the survivors get the
full measurement above, point by point; that keeps a whole-grid run to minutes. A point
keeps the fastest candidate (wgrad, graph mode) that passes; the table rows follow the
planner's reading (jax_cake/planner/tables.py): a row covers min_tokens..max_tokens minus
exclude_tokens.

Condition (b) and what is measured. JAX gives no handle on XLA's stream, so the busy
kernel (a CUDA kernel compiled here with nvcc, one CTA per SM through the opt-in
maximum of dynamic shared memory, spinning on %globaltimer) runs on its own driver-API
stream of the same primary context. busy_first: it is enqueued before the jax call,
and only steps whose whole span lies inside a busy kernel count. op_first: it is
enqueued right after the call is dispatched (a call starts with the op, not a flush),
and only steps during which a busy kernel started count: the op's kernels held the
GPU when it arrived. Cells are measured in the g and the e children and pooled. A
cell with no such steps has no data, and then (b) fails: the point keeps the
deterministic program. `--contention=none` skips (b), which also leaves every point
deterministic; so does a run without a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Mapping, Sequence

from absl import app, flags

from jax_cake.tools import bench
from jax_cake.tools import cuda_driver
from jax_cake.tools import plan_rule

TUNE_OPS = ("wgrad",) + plan_rule.STEP_OPS
TABLE_DIR = Path(__file__).resolve().parent.parent / "planner" / "tables"
FLAGS = flags.FLAGS


def candidate_arms(splits: Sequence[int] = ()) -> list[str]:
    """Split arms: the arrival-order wgrad tiles that are compiled, times split counts.

    Without jax_cake.planner.variants, one arm: the planner's own split program.
    """
    try:
        from jax_cake.planner import variants
    except ImportError:
        return ["split"]
    tiles = sorted({v.tile for v in variants.VARIANTS if v.program == "wgrad" and v.store == "add"})
    return [bench.split_arm_name(s, t) for t in tiles for s in (list(splits) or [None])] or ["split"]


# --- the busy kernel for condition (b) --------------------------------------------------------

_BUSY_SOURCE = r"""
extern "C" __global__ void jax_cake_busy_sms(unsigned long long ns) {
  // One CTA per SM (it asks for all opt-in shared memory); spins for ns nanoseconds.
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
}
"""


class BusySms:
    """Launches jax_cake_busy_sms on a side stream of the primary context (device 0)."""

    def __init__(self):
        self._driver = cuda_driver.Driver(_BUSY_SOURCE, ["jax_cake_busy_sms"])
        self.smem = self._driver.use_all_shared_memory("jax_cake_busy_sms")

    def launch(self, sms: int, ns: int) -> None:
        self._driver.launch("jax_cake_busy_sms", sms, 32, [ctypes.c_ulonglong(ns)], smem=self.smem)

    def wait(self) -> None:
        self._driver.synchronize()

    @contextlib.contextmanager
    def around(self, sms: int, order: str, ns: int):
        """Wraps one jax call: the busy kernel before it or right after its dispatch."""
        if order == "busy_first":
            self.launch(sms, ns)
        yield
        if order == "op_first":
            self.launch(sms, ns)
        self.wait()


def keep_step(order: str):
    """The step filter of a launch order (see the module docstring)."""
    if order == "busy_first":
        return lambda span, busy: any(b <= span[0] and span[1] <= e for b, e in busy)
    return lambda span, busy: any(span[0] <= b < span[1] for b, _ in busy)


# --- the child: one (run, mode) ----------------------------------------------------------------


def candidate_plans(points: Sequence[bench.Point], arms: Sequence[bench.ArmSpec]) -> dict[str, dict]:
    """{point label: {arm: the wgrad Plan fields it ran}} from the planner, in this process."""
    import jax_cake

    out = {}
    for p in points:
        out[p.label] = {}
        for arm in arms:
            with bench.planning_for(arm):
                plan = jax_cake.plan(
                    "wgrad",
                    tokens=p.tokens,
                    d_in=p.d_in,
                    d_out=p.d_out,
                    out_dtype=p.out,
                    deterministic=arm.kind == "det",
                )
            out[p.label][arm.name] = {
                "program": plan.algorithm,  # the plan table's name for det / split
                "tile": list(plan.tile),
                "splits": plan.splits,
                "reduction": plan.reduction,
            }
    return out


def run_tune_child(points, arms, mode: str, run: int, out_path: str, ops: Sequence[str] = TUNE_OPS) -> None:
    timer_kind = FLAGS.timer or bench.default_timer()
    common = dict(steps=FLAGS.steps, groups=FLAGS.groups, flush_mb=FLAGS.flush_mb, timer_kind=timer_kind)
    samples = bench.collect(points, ops, arms, mode, run, **common)
    if FLAGS.contention != "none" and timer_kind != "device":
        print("condition (b) skipped: it needs the GPU's device timeline", file=sys.stderr)
    elif FLAGS.contention != "none":
        busy = BusySms()
        for point in points:
            slowest = max(
                statistics.median(g for g in s["groups_us"] if g is not None)
                for s in samples
                if s["op"] == "wgrad" and bench.Point(s["tokens"], s["d_in"], s["d_out"], s["out"]) == point
            )
            ns = int(2 * FLAGS.steps * (slowest + 100) * 1e3)  # covers a whole call: steps x (op + flush)
            for sms in map(int, FLAGS.busy_sms):
                for order in plan_rule.LAUNCH_ORDERS:
                    samples += bench.collect(
                        [point],
                        ["wgrad"],
                        arms,
                        mode,
                        run,
                        **common,
                        tags={"busy_sms": sms, "order": order},
                        around_call=lambda sms=sms, order=order: busy.around(sms, order, ns),
                        keep=keep_step(order),
                    )
    header = bench.device_header(timer_kind)
    header["plans"] = candidate_plans(points, arms)
    bench.write_child_output(out_path, header, samples)


# --- from samples to verdicts to a table --------------------------------------------------------


def _pair(det: Sequence, cand: Sequence) -> plan_rule.PairedRun | None:
    pairs = [(d, c) for d, c in zip(det, cand) if d is not None and c is not None]
    return plan_rule.PairedRun(tuple(d for d, _ in pairs), tuple(c for _, c in pairs)) if pairs else None


def verdicts(samples: Sequence[dict], candidate: str) -> dict[bench.Point, plan_rule.Verdict]:
    """The plan rule for `candidate` against det at every point the samples hold."""
    groups: dict[tuple, list] = {}
    for s in samples:
        key = (
            bench.Point(s["tokens"], s["d_in"], s["d_out"], s["out"]),
            s["op"],
            s["mode"],
            s["run"],
            s.get("busy_sms"),
            s.get("order"),
            s["arm"],
        )
        groups[key] = s["groups_us"]
    out = {}
    for point in {k[0] for k in groups}:
        op_runs, contention, steps = {}, {}, {}
        for (p, op, mode, run, sms, order, arm), det in groups.items():
            if p != point or arm != "det" or (p, op, mode, run, sms, order, candidate) not in groups:
                continue
            paired = _pair(det, groups[(p, op, mode, run, sms, order, candidate)])
            if paired is None:
                continue
            if sms is not None:
                contention.setdefault((sms, order), []).append(paired)
            elif op == "wgrad":
                op_runs.setdefault(mode, []).append(paired)
            else:
                steps.setdefault((op, mode), []).append(paired)
        out[point] = plan_rule.decide(op_runs, contention, steps)
    return out


def screen_survivors(
    samples: Sequence[dict], candidates: Sequence[str]
) -> tuple[dict[bench.Point, list[str]], dict[tuple[bench.Point, str], plan_rule.Check]]:
    """The screen's verdicts: ({point: candidates that passed (a) in its graph-mode run},
    {(point, candidate): the failed (a) check}). Only plain wgrad samples count."""
    times = {}
    for s in samples:
        if s["op"] == "wgrad" and s["mode"] == "g" and s.get("busy_sms") is None:
            times[(bench.Point(s["tokens"], s["d_in"], s["d_out"], s["out"]), s["arm"])] = s["groups_us"]
    survivors, screened = {}, {}
    for (point, arm), det in sorted(times.items(), key=lambda kv: dataclasses.astuple(kv[0][0])):
        if arm != "det":
            continue
        survivors[point] = []
        for cand in candidates:
            paired = _pair(det, times[(point, cand)]) if (point, cand) in times else None
            check = (
                plan_rule.check_op_run("g", 0, paired)
                if paired
                else plan_rule.Check("a", "g run 0", False, "no paired groups")
            )
            if check.passed:
                survivors[point].append(cand)
            else:
                screened[(point, cand)] = check
    return survivors, screened


@dataclasses.dataclass(frozen=True)
class Choice:
    """What a point runs under deterministic=False, with the rule's evidence."""

    point: bench.Point
    arm: str | None  # the winning split arm, None = deterministic program
    plan: Mapping | None  # that arm's plan fields (program, tile, splits, reduction)
    evidence: str


def choose(
    samples: Sequence[dict],
    plans: Mapping[str, Mapping],
    candidates: Sequence[str],
    screened: Mapping[tuple[bench.Point, str], plan_rule.Check] | None = None,
) -> list[Choice]:
    """Per point, the candidate with the lowest graph-mode wgrad median among those passing.
    `screened` holds the (a) check of each (point, candidate) the screen rejected."""
    screened = screened or {}
    medians = bench.run_medians([s for s in samples if s.get("busy_sms") is None])
    by_candidate = {c: verdicts(samples, c) for c in candidates}
    points = {p for v in by_candidate.values() for p in v} | {p for p, _ in screened}
    choices = []
    for point in sorted(points, key=lambda p: dataclasses.astuple(p)):
        passing = [c for c in candidates if by_candidate[c].get(point) and by_candidate[c][point].keep_split]
        if not passing:
            why = []
            for c in candidates:
                if v := by_candidate[c].get(point):
                    why.append(f"{c} failed " + ", ".join(f"({f.condition}) {f.cell} {f.detail}" for f in v.failed))
                elif check := screened.get((point, c)):
                    why.append(f"{c} failed the screen ({check.condition}) {check.cell} {check.detail}")
            choices.append(Choice(point, None, None, "; ".join(why)))
            continue
        best = min(passing, key=lambda c: medians.get((point, "wgrad", "g", c), float("inf")))
        choices.append(Choice(point, best, plans.get(point.label, {}).get(best), by_candidate[best][point].evidence()))
    return choices


def table_rows(choices: Sequence[Choice]) -> list[dict]:
    """Plan-table rows for one SM count, in the planner's format.

    Per (d_in, d_out, out): if every winning token count runs the same program, one row
    from the lowest to the highest winning T, excluding the measured T in between where
    the deterministic program (or another program) won; otherwise one row per winning T.
    """
    rows = []
    shapes = sorted({(c.point.d_in, c.point.d_out, c.point.out) for c in choices})
    for d_in, d_out, out in shapes:
        mine = [c for c in choices if (c.point.d_in, c.point.d_out, c.point.out) == (d_in, d_out, out)]
        winners = [c for c in mine if c.arm is not None]
        programs = {json.dumps(c.plan, sort_keys=True) for c in winners}
        spans = [winners] if len(programs) == 1 else [[c] for c in winners]
        for span in spans:
            tokens = [c.point.tokens for c in span]
            lo, hi = min(tokens), max(tokens)
            plan = span[0].plan or {}
            rows.append(
                {
                    "d_in": d_in,
                    "d_out": d_out,
                    "out": out,
                    "min_tokens": lo,
                    "max_tokens": hi,
                    "program": "split",
                    "exclude_tokens": sorted(
                        c.point.tokens for c in mine if lo <= c.point.tokens <= hi and c not in span
                    ),
                    "tile": plan.get("tile"),
                    "splits": plan.get("splits"),
                    "reduction": plan.get("reduction"),
                    "source": "jax_cake.tools.tune",
                    "evidence": " | ".join(
                        f"T={c.point.tokens} {'split' if c in span else 'det'}: {c.evidence}"
                        for c in mine
                        if lo <= c.point.tokens <= hi
                    ),
                }
            )
    return rows


def build_table(arch: str, sms: int, source: str, rows: Sequence[dict], existing: Mapping | None = None) -> dict:
    """The table JSON: `existing` with its range for exactly `sms` SMs replaced by `rows`."""
    ranges = [r for r in (existing or {}).get("sm_ranges", []) if (r["min_sms"], r.get("max_sms")) != (sms, sms)]
    ranges.append({"min_sms": sms, "max_sms": sms, "rows": list(rows)})
    ranges.sort(key=lambda r: r["min_sms"])
    return {"arch": arch, "source": source, "sm_ranges": ranges}


# --- entry point ---------------------------------------------------------------------------------


def main(argv):
    del argv
    points = bench.grid_points(
        map(int, FLAGS.tokens),
        map(int, FLAGS.d_in),
        map(int, FLAGS.d_out),
        bench.selected("out_dtype", bench.OUT_DTYPES),
    )
    candidates = FLAGS.arms or candidate_arms(list(map(int, FLAGS.splits)))
    arms = [bench.parse_arm(a) for a in ["det", *candidates]]
    if any(a.kind != "split" for a in arms[1:]):
        raise app.UsageError("--arms: tune compares split candidates (split[/sN][/tMxNxK]) against det")
    modes = bench.selected("modes", bench.MODES)
    if FLAGS.child_out:
        run_tune_child(points, arms, modes[0], FLAGS.run_index, FLAGS.child_out, FLAGS.child_ops)
        return
    timing = bench.child_argv(("groups", "steps", "flush_mb", "timer"))
    grid = bench.child_argv(("tokens", "d_in", "d_out", "out_dtype"))
    full = bench.child_argv(("busy_sms", "contention"))
    if FLAGS.screen:
        screen_argv = grid + timing + [f"--arms={','.join(candidates)}", "--contention=none", "--child_ops=wgrad"]
        header, screen_samples = bench.run_children("jax_cake.tools.tune", screen_argv, ["g"], 1)
        survivors, screened = screen_survivors(screen_samples, candidates)
        print(
            f"screen: {sum(map(len, survivors.values()))} of {len(survivors) * len(candidates)} "
            "(point, candidate) pairs passed (a) in graph mode",
            file=sys.stderr,
        )
        samples = []
        for point, cands in survivors.items():
            if cands:
                one_point = [
                    f"--tokens={point.tokens}",
                    f"--d_in={point.d_in}",
                    f"--d_out={point.d_out}",
                    f"--out_dtype={point.out}",
                ]
                _, got = bench.run_children(
                    "jax_cake.tools.tune", one_point + timing + full + [f"--arms={','.join(cands)}"], modes, FLAGS.runs
                )
                samples += got
    else:
        header, samples = bench.run_children(
            "jax_cake.tools.tune", grid + timing + full + [f"--arms={','.join(candidates)}"], modes, FLAGS.runs
        )
        screened = {}
    choices = choose(samples, header["plans"], candidates, screened)
    for c in choices:
        print(f"{c.point.label}: {c.arm or 'det'}\n  {c.evidence}", file=sys.stderr)
    if not header["sms"]:
        if FLAGS.write:
            raise app.UsageError("--write needs a GPU measurement (the children saw no SM count)")
        print("no GPU: the verdicts above, but no plan table (its rows are per SM count)", file=sys.stderr)
        return
    cc = header.get("compute_capability") or "9.0"
    arch = FLAGS.arch or {"9.0": "sm_90a"}.get(cc, f"sm_{cc.replace('.', '')}")
    source = (
        f"jax_cake.tools.tune {header['date']} on NVIDIA {header['gpu']} ({header['sms']} SMs), jax {header['jax']}, "
        f"{header['timer']}, {FLAGS.runs} runs x {FLAGS.groups} groups x {FLAGS.steps} steps, {len(points)} points"
        + (" (screened: wgrad in graph mode first, one run)" if FLAGS.screen else "")
    )
    path = Path(FLAGS.table or TABLE_DIR / f"{arch}.json")
    existing = json.loads(path.read_text()) if path.exists() else None
    table = build_table(arch, header["sms"], source, table_rows(choices), existing)
    text = json.dumps(table, indent=1) + "\n"
    if FLAGS.write:
        path.write_text(text)
        print(f"wrote {path}", file=sys.stderr)
    else:
        print(text)


if __name__ == "__main__":
    bench.define_flags(arms_default=(), with_ops=False)
    flags.DEFINE_list("splits", [], "Split counts to try per tile (empty: the planner's count).")
    flags.DEFINE_list("busy_sms", [str(s) for s in plan_rule.BUSY_SMS], "SMs the busy kernel holds, condition (b).")
    flags.DEFINE_enum("contention", "cuda", ["cuda", "none"], "none: skip (b) (every point stays deterministic).")
    flags.DEFINE_string("arch", None, "Table architecture (default: from the GPU, sm_90a on an H200).")
    flags.DEFINE_string("table", None, "Table path (default jax_cake/planner/tables/<arch>.json).")
    flags.DEFINE_bool("write", False, "Write the table file; otherwise print it.")
    flags.DEFINE_bool(
        "screen",
        True,
        "First time wgrad alone in graph mode at every point; only candidates passing (a) there get "
        "the full measurement (a candidate failing it fails the rule).",
    )
    flags.DEFINE_list("child_ops", list(TUNE_OPS), "Internal: the ops a child times.")
    app.run(main)
