"""Measures split-K candidates and XLA's dot against the deterministic program and writes the plan table.

    python -m benchmarks.tune --tokens=16172,16231,16384 --d_in=4096 --d_out=48 --out_dtype=float32
    python -m benchmarks.tune ... --write   # into jax_cake/planner/tables/<arch>.json
    python -m benchmarks.tune --grid=all ...  # the default widths and the wide ones (bench --grid)

XLA's dot (`--xla`, default on): at every point, for fwd, dgrad and wgrad (`--xla_ops`;
fwd and dgrad once per (T, d_in, d_out), on the BF16 weight, as their plans are), the
`xla/path` arm (the op on jax_cake's own XLA path, what an xla row would run) is timed
against det in the same paired groups. The screen times it in graph mode with the split
candidates; the cells whose XLA passed (a) there get eager run 0, then both modes for
the other runs (`--runs`), in one child per (run, mode) over all such cells. A cell where
XLA passes (a) in every run of both modes and (d) (plan_rule.decide_xla), and at a wgrad point
that keeps split also against that split program (timed with it in the full
measurement), gets an xla row; where XLA beat det but not the kept split, the split row
comes first and the xla row serves deterministic=True.

Accuracy (plan_rule's condition (d)): beside its times every child measures each arm's
output error at the fwd, dgrad and wgrad cells, ||out - ref|| / ||ref|| of the warm-up
call's first step against a float64 reference of the same BF16 operands
(harness.output_error; on at most harness.ERROR_ROWS evenly spaced output rows). A row may
replace the kernel only where its arm's error, in every run, is under the op's contract
(plan_rule.rel_err_max: FP32 dw 1e-5, BF16 outputs 1e-2). An arm that wins on time but
misses it gets no row: the tuner prints it ("accuracy contract: ... dropped") and the
table's SM range lists it under "dropped" with its error (the planner does not read that
list). Every xla row records XLA's worst error (`rel_err`) and the contract (`rel_err_max`).

Per point (T, d_in, d_out, out dtype) and candidate split program (`split/tMxNxK` per
arrival-order wgrad tile of jax_cake.planner.variants, optionally `--splits` counts),
with the benchmark's protocol (benchmarks/harness.py: a child process per run and mode,
paired groups, L2 flushed, CUPTI device time):
- (a) wgrad alone, modes g and e: each run's paired groups, det vs candidate;
- (b) wgrad next to a busy kernel holding 8, 16 or 32 SMs on another stream;
- (c) bwd and 2fwd+bwd, modes g and e;
then benchmarks/plan_rule.py decides. With --screen (the default) a first pass times wgrad
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
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

from absl import app, flags

from benchmarks import cuda_driver, harness, plan_rule
from benchmarks.families import dense, projections
from jax_cake.planner import tables, variants

TUNE_OPS = ("wgrad",) + plan_rule.STEP_OPS
XLA_OPS = ("fwd", "dgrad", "wgrad")
XLA_ARM = "xla/path"  # the op on jax_cake's XLA path: what an xla row runs
FLAGS = flags.FLAGS


def candidate_arms(splits: Sequence[int] = ()) -> list[str]:
    """Split arms: the arrival-order wgrad tiles that are compiled, times split counts."""
    tiles = sorted({v.tile for v in variants.VARIANTS if v.program == "wgrad" and v.store == "add"})
    return [harness.split_arm_name(s, t) for t in tiles for s in (list(splits) or [None])] or ["split"]


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


def candidate_plans(points: Sequence[harness.Point], arms: Sequence[harness.ArmSpec]) -> dict[str, dict]:
    """{point label: {arm: the wgrad Plan fields it ran}} from the planner, in this process."""
    import jax_cake

    out = {}
    for p in points:
        out[p.label] = {}
        for arm in arms:
            with harness.planning_for(arm):
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


def xla_cells(points: Sequence[harness.Point], ops: Sequence[str] = XLA_OPS) -> list[tuple[str, harness.Point]]:
    """The (op, point) cells XLA's dot is timed at: wgrad at every point, fwd and dgrad
    once per (T, d_in, d_out) (their plans' out dtype is BF16 whatever w's is), on the
    BF16 point where the grid has one."""
    cells = []
    for op in ops:
        if op == "wgrad":
            cells += [(op, p) for p in points]
            continue
        seen = {}
        for p in points:
            key = (p.tokens, p.d_in, p.d_out)
            if key not in seen or p.out == "bfloat16" and seen[key].out != "bfloat16":
                seen[key] = p
        cells += [(op, p) for p in seen.values()]
    return cells


def write_cells(path: str, cells: Sequence[tuple[str, harness.Point]]) -> None:
    with open(path, "w") as f:
        json.dump([[op, p.tokens, p.d_in, p.d_out, p.out] for op, p in cells], f)


def read_cells(path: str) -> list[tuple[str, harness.Point]]:
    with open(path) as f:
        return [(op, harness.Point(t, i, o, dt)) for op, t, i, o, dt in json.load(f)]


def run_tune_child(
    points, arms, mode: str, run: int, out_path: str, ops: Sequence[str] = TUNE_OPS, cells=None
) -> None:
    """One (run, mode): every cell (op, point; default: points x ops) with the arms (split
    arms only on wgrad and the steps), then condition (b) on the points."""
    timer_kind = FLAGS.timer or harness.default_timer()
    common = dict(steps=FLAGS.steps, groups=FLAGS.groups, flush_mb=FLAGS.flush_mb, timer_kind=timer_kind)
    cells = cells if cells is not None else [(op, p) for p in points for op in ops]
    samples = []
    for op in dict.fromkeys(op for op, _ in cells):
        op_arms = arms if op in TUNE_OPS else [a for a in arms if a.kind != "split"]
        samples += harness.collect(
            [p for o, p in cells if o == op], [op], op_arms, dense.project, mode, run, **common, errors=True
        )
    if FLAGS.contention != "none" and timer_kind != "device":
        print("condition (b) skipped: it needs the GPU's device timeline", file=sys.stderr)
    elif FLAGS.contention != "none":
        busy = BusySms()
        for point in points:
            slowest = max(
                statistics.median(g for g in s["groups_us"] if g is not None)
                for s in samples
                if s["op"] == "wgrad" and s["arm"] == "det" and _point_of(s) == point
            )
            ns = int(2 * FLAGS.steps * (slowest + 100) * 1e3)  # covers a whole call: steps x (op + flush)
            for sms in map(int, FLAGS.busy_sms):
                for order in plan_rule.LAUNCH_ORDERS:
                    samples += harness.collect(
                        [point],
                        ["wgrad"],
                        arms,
                        dense.project,
                        mode,
                        run,
                        **common,
                        tags={"busy_sms": sms, "order": order},
                        around_call=lambda sms=sms, order=order: busy.around(sms, order, ns),
                        keep=keep_step(order),
                    )
    header = harness.device_header(timer_kind)
    header["plans"] = candidate_plans(points, arms)
    harness.write_child_output(out_path, header, samples)


# --- from samples to verdicts to a table --------------------------------------------------------


def _pair(det: Sequence, cand: Sequence) -> plan_rule.PairedRun | None:
    pairs = [(d, c) for d, c in zip(det, cand) if d is not None and c is not None]
    return plan_rule.PairedRun(tuple(d for d, _ in pairs), tuple(c for _, c in pairs)) if pairs else None


def _point_of(s: Mapping) -> harness.Point:
    return harness.Point(s["tokens"], s["d_in"], s["d_out"], s["out"])


def arm_errors(samples: Sequence[dict], op: str, point: harness.Point, arm: str) -> list[float | None]:
    """The arm's measured output errors at one (op, point), one per sample without a busy
    kernel (per run and mode); None where a sample carries none."""
    return [
        s.get("rel_err")
        for s in samples
        if s.get("busy_sms") is None and s["op"] == op and s["arm"] == arm and _point_of(s) == point
    ]


def verdicts(samples: Sequence[dict], candidate: str) -> dict[harness.Point, plan_rule.Verdict]:
    """The plan rule for `candidate` against det at every point the samples hold, (d) on
    the candidate's dw errors in its wgrad samples."""
    groups: dict[tuple, list] = {}
    for s in samples:
        key = (
            _point_of(s),
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
        errors = arm_errors(samples, "wgrad", point, candidate)
        out[point] = plan_rule.decide(op_runs, contention, steps, errors=errors, out=point.out)
    return out


def screen_survivors(
    samples: Sequence[dict], candidates: Sequence[str]
) -> tuple[dict[harness.Point, list[str]], dict[tuple[harness.Point, str], plan_rule.Check]]:
    """The screen's verdicts: ({point: candidates that passed (a) in its graph-mode run},
    {(point, candidate): the failed (a) check}). Only plain wgrad samples count. (d) waits
    for the full measurement, so an arm it drops is recorded with all its runs."""
    times = {}
    for s in samples:
        if s["op"] == "wgrad" and s["mode"] == "g" and s.get("busy_sms") is None:
            times[(_point_of(s), s["arm"])] = s["groups_us"]
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

    point: harness.Point
    arm: str | None  # the winning split arm, None = deterministic program
    plan: Mapping | None  # that arm's plan fields (program, tile, splits, reduction)
    evidence: str
    dropped: tuple[Dropped, ...] = ()  # candidates that met the timing conditions but not (d)


@dataclasses.dataclass(frozen=True)
class Dropped:
    """An arm that met the rule's timing conditions at one (op, point) but whose measured
    error misses the op's accuracy contract: no row for it; the table records it."""

    op: str
    point: harness.Point
    arm: str
    out: str  # the plan's out dtype (the row key's)
    rel_err: float | None  # the worst measured error
    ratio: float | None  # its worst per-run median paired time ratio against the baseline
    evidence: str

    @property
    def rel_err_max(self) -> float:
        return plan_rule.rel_err_max(self.op, self.out)

    def describe(self) -> str:
        err = "no error measured" if self.rel_err is None else f"error {self.rel_err:.3g}"
        ratio = "" if self.ratio is None else f" (time ratio {self.ratio:.3f})"
        return (
            f"{self.op} {self.point.label}: {self.arm} dropped: faster{ratio} but its {err} misses the "
            f"accuracy contract {self.rel_err_max:.0e}"
        )

    def record(self, date: str) -> dict:
        """The table's note of it (a range's "dropped" list; the planner does not read it)."""
        return {
            "op": self.op,
            "d_in": self.point.d_in,
            "d_out": self.point.d_out,
            "out": self.out,
            "tokens": self.point.tokens,
            "program": "xla" if self.arm == XLA_ARM else "split",
            "arm": self.arm,
            "rel_err": None if self.rel_err is None else float(f"{self.rel_err:.3g}"),
            "rel_err_max": self.rel_err_max,
            "ratio": None if self.ratio is None else round(self.ratio, 4),
            "source": f"benchmarks.tune {date}",
            "evidence": self.evidence,
        }


def _split_ratio(samples: Sequence[dict], point: harness.Point, cand: str) -> float | None:
    return plan_rule.worst_ratio(paired_op_runs(samples, "wgrad", point, "det", cand))


def choose(
    samples: Sequence[dict],
    plans: Mapping[str, Mapping],
    candidates: Sequence[str],
    screened: Mapping[tuple[harness.Point, str], plan_rule.Check] | None = None,
) -> list[Choice]:
    """Per point, the candidate with the lowest graph-mode wgrad median among those passing.
    `screened` holds the (a) check of each (point, candidate) the screen rejected."""
    screened = screened or {}
    medians = harness.run_medians([s for s in samples if s.get("busy_sms") is None])
    by_candidate = {c: verdicts(samples, c) for c in candidates}
    points = {p for v in by_candidate.values() for p in v} | {p for p, _ in screened}
    choices = []
    for point in sorted(points, key=lambda p: dataclasses.astuple(p)):
        dropped = tuple(
            Dropped(
                "wgrad",
                point,
                c,
                point.out,
                plan_rule.worst_error(arm_errors(samples, "wgrad", point, c)),
                _split_ratio(samples, point, c),
                by_candidate[c][point].evidence(),
            )
            for c in candidates
            if by_candidate[c].get(point) and by_candidate[c][point].dropped_for_accuracy
        )
        passing = [c for c in candidates if by_candidate[c].get(point) and by_candidate[c][point].keep_split]
        if not passing:
            why = []
            for c in candidates:
                if v := by_candidate[c].get(point):
                    why.append(f"{c} failed " + ", ".join(f"({f.condition}) {f.cell} {f.detail}" for f in v.failed))
                elif check := screened.get((point, c)):
                    why.append(f"{c} failed the screen ({check.condition}) {check.cell} {check.detail}")
            choices.append(Choice(point, None, None, "; ".join(why), dropped))
            continue
        best = min(passing, key=lambda c: medians.get((point, "wgrad", "g", c), float("inf")))
        plan = plans.get(point.label, {}).get(best)
        choices.append(Choice(point, best, plan, by_candidate[best][point].evidence(), dropped))
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
                    "source": "benchmarks.tune",
                    "evidence": " | ".join(
                        f"T={c.point.tokens} {'split' if c in span else 'det'}: {c.evidence}"
                        for c in mine
                        if lo <= c.point.tokens <= hi
                    ),
                }
            )
    return rows


def paired_op_runs(
    samples: Sequence[dict], op: str, point: harness.Point, base: str, cand: str
) -> dict[str, list[plan_rule.PairedRun]]:
    """{mode: [PairedRun(base times, cand times) per run]} of one op at one point, from
    the samples without a busy kernel."""
    times = {}
    for s in samples:
        if s.get("busy_sms") is None and s["op"] == op and s["arm"] in (base, cand):
            if _point_of(s) == point:
                times[(s["mode"], s["run"], s["arm"])] = s["groups_us"]
    runs = {}
    for (mode, run, arm), groups in sorted(times.items()):
        if arm == base and (mode, run, cand) in times:
            paired = _pair(groups, times[(mode, run, cand)])
            if paired is not None:
                runs.setdefault(mode, []).append(paired)
    return runs


def _screen_passed(samples: Sequence[dict], op: str, point: harness.Point) -> bool:
    """Whether XLA passed (a) against det in the screen's graph-mode run at one cell."""
    runs = paired_op_runs(samples, op, point, "det", XLA_ARM).get("g", [])
    return bool(runs) and plan_rule.check_op_run("g", 0, runs[0]).passed


def _runs_so_far(samples: Sequence[dict], op: str, point: harness.Point) -> list[plan_rule.Check]:
    """(a) for XLA against det in every run measured so far (a missing mode is no failure yet)."""
    runs = paired_op_runs(samples, op, point, "det", XLA_ARM)
    return [plan_rule.check_op_run(mode, i, r) for mode, rs in runs.items() for i, r in enumerate(rs)]


@dataclasses.dataclass(frozen=True)
class XlaChoice:
    """XLA's dot against jax_cake at one (op, point): the verdict against det and, at a
    wgrad point that keeps split, against that split arm."""

    op: str
    point: harness.Point
    verdict: plan_rule.Verdict  # XLA vs det, (a) and (d)
    ratio: float | None  # XLA/det, the highest per-run median paired ratio
    split_arm: str | None = None
    split_verdict: plan_rule.Verdict | None = None  # XLA vs split_arm
    rel_err: float | None = None  # XLA's worst measured output error

    @property
    def beats_det(self) -> bool:
        return self.verdict.keep_split

    @property
    def beats_split(self) -> bool:
        return self.split_arm is not None and self.split_verdict is not None and self.split_verdict.keep_split

    @property
    def row_out(self) -> str:
        """The plan's out dtype the row is keyed by: w's for wgrad, BF16 for fwd/dgrad."""
        return self.point.out if self.op == "wgrad" else "bfloat16"

    @property
    def rel_err_max(self) -> float:
        return plan_rule.rel_err_max(self.op, self.row_out)

    @property
    def dropped(self) -> Dropped | None:
        """XLA beat det on time in every run but missed the accuracy contract."""
        if not self.verdict.dropped_for_accuracy:
            return None
        return Dropped(self.op, self.point, XLA_ARM, self.row_out, self.rel_err, self.ratio, self.evidence())

    def evidence(self) -> str:
        text = f"vs det {self.verdict.evidence()}"
        if self.split_arm is not None:
            versus = self.split_verdict.evidence() if self.split_verdict else "no paired runs"
            text += f"; vs {self.split_arm} {versus}"
        return text


def choose_xla(
    xla_samples: Sequence[dict],
    cells: Sequence[tuple[str, harness.Point]],
    choices: Sequence[Choice] = (),
    split_samples: Sequence[dict] = (),
) -> list[XlaChoice]:
    """Per cell, plan_rule.decide_xla of XLA against det (xla_samples: the screen's and the
    follow-up runs) and, where `choices` keep a split arm at a wgrad point, against it
    (split_samples: the full measurement, which times XLA with the split arms); (d) in
    both on XLA's output errors in every sample of the cell."""
    split_of = {c.point: c.arm for c in choices if c.arm is not None}
    out = []
    for op, point in cells:
        row_out = point.out if op == "wgrad" else "bfloat16"
        errors = arm_errors(xla_samples, op, point, XLA_ARM) + arm_errors(split_samples, op, point, XLA_ARM)
        decide = lambda runs: plan_rule.decide_xla(runs, gemm=op, out=row_out, errors=errors)
        runs = paired_op_runs(xla_samples, op, point, "det", XLA_ARM)
        arm = split_of.get(point) if op == "wgrad" else None
        split_verdict = None
        if arm is not None:
            split_verdict = decide(paired_op_runs(split_samples, "wgrad", point, arm, XLA_ARM))
        out.append(
            XlaChoice(
                op,
                point,
                decide(runs),
                plan_rule.worst_ratio(runs),
                arm,
                split_verdict,
                plan_rule.worst_error(errors),
            )
        )
    return out


def yield_to_xla(choices: Sequence[Choice], xla: Sequence[XlaChoice]) -> list[Choice]:
    """The split choices with the points where XLA beat the kept split arm too turned
    deterministic (their T is then excluded from the split row; the xla row covers it)."""
    beaten = {x.point for x in xla if x.op == "wgrad" and x.beats_det and x.beats_split}
    return [
        dataclasses.replace(c, arm=None, plan=None, evidence=f"XLA beat {c.arm}: {c.evidence}")
        if c.point in beaten
        else c
        for c in choices
    ]


def xla_table_rows(xla: Sequence[XlaChoice], date: str) -> list[dict]:
    """Plan-table xla rows, one per (op, d_in, d_out, out, T) where XLA beat det: each
    covers only its measured token count. XLA's own speed depends on T's alignment (its
    FP32 wgrad at 4096 -> 48 takes 3x longer at T = 16172 than at 16384), so a win at two
    token counts says nothing about the ones between. They go after the split rows (a
    split row first serves deterministic=False). Each records XLA's worst measured error
    (`rel_err`) and the contract it met (`rel_err_max`)."""
    rows = []
    winners = sorted(
        (x for x in xla if x.beats_det),
        key=lambda x: (XLA_OPS.index(x.op), x.point.d_in, x.point.d_out, x.row_out, x.point.tokens),
    )
    for x in winners:
        rows.append(
            {
                "op": x.op,
                "d_in": x.point.d_in,
                "d_out": x.point.d_out,
                "out": x.row_out,
                "min_tokens": x.point.tokens,
                "max_tokens": x.point.tokens,
                "program": "xla",
                "exclude_tokens": [],
                "ratio": round(x.ratio, 4),
                "rel_err": float(f"{x.rel_err:.3g}"),
                "rel_err_max": x.rel_err_max,
                "source": f"benchmarks.tune {date}",
                "evidence": f"T={x.point.tokens} xla: {x.evidence()}",
            }
        )
    return rows


def dropped_arms(choices: Sequence[Choice], xla: Sequence[XlaChoice]) -> list[Dropped]:
    """Every arm the accuracy contract dropped: split candidates, then XLA's cells."""
    return [d for c in choices for d in c.dropped] + [x.dropped for x in xla if x.dropped is not None]


def row_key(row: Mapping) -> tuple:
    """What a row is about: (op, d_in, d_out, out, batch)."""
    return (row.get("op", "wgrad"), row["d_in"], row["d_out"], row["out"], row.get("batch", 1))


def _remeasured(entry: Mapping, measured: set) -> bool:
    """Whether this run measured what a table entry says: its key at a token count it
    covers (a row's [min_tokens, max_tokens], a dropped note's tokens; an entry without
    token counts covers every T). `measured` holds (row_key, T) pairs."""
    key = row_key(entry)
    lo = entry.get("min_tokens", entry.get("tokens"))
    hi = entry.get("max_tokens", entry.get("tokens"))
    return any(k == key and (lo is None or lo <= t) and (hi is None or t <= hi) for k, t in measured)


def build_table(
    arch: str,
    sms: int,
    source: str,
    rows: Sequence[dict],
    existing: Mapping | None = None,
    measured: set | None = None,
    dropped: Sequence[dict] = (),
) -> dict:
    """The table JSON: `existing` with its range for exactly `sms` SMs replaced by `rows`
    (its tile rows, which tune_tiles writes, kept after them); with `measured` ((row_key,
    T) pairs), that range's rows this run did not measure (other keys, or token counts the
    run did not time) stay, first. `dropped` (Dropped.record of
    the arms the accuracy contract dropped) goes into the range's "dropped" list, a note the
    planner does not read; with `measured`, earlier notes this run did not measure stay too."""
    ranges = [r for r in (existing or {}).get("sm_ranges", []) if not tables.is_range_for(r, sms)]
    kept, kept_dropped, tile_rows = [], [], []
    for r in (existing or {}).get("sm_ranges", []):
        if tables.is_range_for(r, sms):
            # tune_tiles's rows: this tuner never measures tiles; they stay, after its own
            # rows (an xla row of the same point comes first and wins).
            tile_rows = [row for row in r["rows"] if tables.is_tile_row(row)]
            if measured is not None:
                kept = [row for row in r["rows"] if not tables.is_tile_row(row) and not _remeasured(row, measured)]
                kept_dropped = [d for d in r.get("dropped", []) if not _remeasured(d, measured)]
    rng = {"min_sms": sms, "max_sms": sms, "rows": kept + list(rows) + tile_rows}
    if kept_dropped or dropped:
        rng["dropped"] = kept_dropped + list(dropped)
    ranges.append(rng)
    ranges.sort(key=lambda r: r["min_sms"])
    return {"arch": arch, "source": source, "sm_ranges": ranges}


# --- entry point ---------------------------------------------------------------------------------


def main(argv):
    del argv
    projections.apply_grid("d_out")
    points = harness.grid_points(
        map(int, FLAGS.tokens),
        map(int, FLAGS.d_in),
        map(int, FLAGS.d_out),
        harness.selected("out_dtype", harness.OUT_DTYPES),
    )
    arm_names = FLAGS.arms or candidate_arms(list(map(int, FLAGS.splits)))
    arms = [harness.parse_arm(a) for a in ["det", *arm_names]]
    if any(a.kind != "split" and a.name != XLA_ARM for a in arms[1:]):
        raise app.UsageError(
            f"--arms: tune compares split candidates (split[/sN][/tMxNxK]) and {XLA_ARM} against det"
        )
    candidates = [a.name for a in arms[1:] if a.kind == "split"]
    modes = harness.selected("modes", plan_rule.MODES)
    if FLAGS.child_out:
        cells = read_cells(FLAGS.child_cells) if FLAGS.child_cells else None
        run_tune_child(points, arms, modes[0], FLAGS.run_index, FLAGS.child_out, FLAGS.child_ops, cells)
        return
    xla_ops = [op for op in FLAGS.xla_ops if op in XLA_OPS] if FLAGS.xla else []
    cells = xla_cells(points, xla_ops)
    xla = [XLA_ARM] if cells else []
    timing = harness.child_argv(("groups", "steps", "flush_mb", "timer"))
    grid = harness.child_argv(("tokens", "d_in", "d_out", "out_dtype"))
    full = harness.child_argv(("busy_sms", "contention"))
    with tempfile.TemporaryDirectory() as tmp:
        cells_file = str(Path(tmp) / "cells.json")
        if FLAGS.screen:
            # wgrad at every point with det, the split candidates and XLA; fwd/dgrad cells with det and XLA
            write_cells(cells_file, [("wgrad", p) for p in points] + [c for c in cells if c[0] != "wgrad"])
            screen_argv = grid + timing + [
                f"--arms={','.join(candidates + xla)}",
                "--contention=none",
                f"--child_cells={cells_file}",
            ]
            header, screen_samples = harness.run_children("benchmarks.tune", screen_argv, ["g"], 1)
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
                    argv = one_point + timing + full + [f"--arms={','.join(cands + xla)}"]
                    _, got = harness.run_children("benchmarks.tune", argv, modes, FLAGS.runs)
                    samples += got
            xla_samples = list(screen_samples)
            alive = [c for c in cells if _screen_passed(screen_samples, *c)]
            print(
                f"screen: XLA passed (a) in graph mode at {len(alive)} of {len(cells)} (op, point) cells",
                file=sys.stderr,
            )
            follow = [(["e"], 1, 0)] + ([(modes, FLAGS.runs - 1, 1)] if FLAGS.runs > 1 else [])
            if "e" not in modes:
                follow = [(modes, FLAGS.runs - 1, 1)] if FLAGS.runs > 1 else []
        else:
            argv = grid + timing + full + [f"--arms={','.join(candidates + xla)}"]
            header, samples = harness.run_children("benchmarks.tune", argv, modes, FLAGS.runs)
            screened, xla_samples, alive, follow = {}, [], list(cells), [(modes, FLAGS.runs, 0)]
        for follow_modes, runs, first_run in follow:  # XLA's cells: the remaining runs of the rule
            if not alive or runs < 1:
                break
            write_cells(cells_file, alive)
            argv = grid + timing + [f"--arms={XLA_ARM}", "--contention=none", f"--child_cells={cells_file}"]
            h, got = harness.run_children("benchmarks.tune", argv, follow_modes, runs)
            header = header or h
            for s in got:
                s["run"] += first_run
            xla_samples += got
            alive = [c for c in alive if all(ch.passed for ch in _runs_so_far(xla_samples, *c))]
    choices = choose(samples, header["plans"], candidates, screened)
    xla_choices = choose_xla(xla_samples, cells, choices, samples)
    choices = yield_to_xla(choices, xla_choices)
    for c in choices:
        print(f"{c.point.label}: {c.arm or 'det'}\n  {c.evidence}", file=sys.stderr)
    for x in xla_choices:
        won = "XLA" if x.beats_det and (x.split_arm is None or x.beats_split) else "jax_cake"
        ratio = "n/a" if x.ratio is None else f"{x.ratio:.3f}"
        err = "n/a" if x.rel_err is None else f"{x.rel_err:.3g}"
        print(
            f"{x.op} {x.point.label}: {won} (XLA/det worst run r={ratio}, XLA error {err}, "
            f"contract {x.rel_err_max:.0e})\n  {x.evidence()}",
            file=sys.stderr,
        )
    dropped = dropped_arms(choices, xla_choices)
    for d in dropped:
        print(f"accuracy contract: {d.describe()}", file=sys.stderr)
    if not header["sms"]:
        if FLAGS.write:
            raise app.UsageError("--write needs a GPU measurement (the children saw no SM count)")
        print("no GPU: the verdicts above, but no plan table (its rows are per SM count)", file=sys.stderr)
        return
    cc = header.get("compute_capability") or "9.0"
    arch = FLAGS.arch or {"9.0": "sm_90a"}.get(cc, f"sm_{cc.replace('.', '')}")
    source = (
        f"benchmarks.tune {header['date']} on NVIDIA {header['gpu']} ({header['sms']} SMs), jax {header['jax']}, "
        f"{header['timer']}, {FLAGS.runs} runs x {FLAGS.groups} groups x {FLAGS.steps} steps, {len(points)} points"
        + (" (screened: wgrad and XLA's cells in graph mode first, one run)" if FLAGS.screen else "")
        + (f", XLA's dot at {len(cells)} (op, point) cells" if cells else "")
    )
    path = Path(FLAGS.table or tables.TABLE_DIR / f"{arch}.json")
    existing = json.loads(path.read_text()) if path.exists() else None
    rows = table_rows(choices) + xla_table_rows(xla_choices, header["date"])
    measured = None
    if FLAGS.keep_rows:  # the keys this run measured: split rows of every point, xla rows of every cell
        measured = {(("wgrad", p.d_in, p.d_out, p.out, 1), p.tokens) for p in points}
        measured |= {((op, p.d_in, p.d_out, p.out if op == "wgrad" else "bfloat16", 1), p.tokens) for op, p in cells}
        if existing is not None and existing.get("source") and existing["source"] != source:
            source = f"{source}; rows of other shapes kept from: {existing['source']}"
    notes = [d.record(header["date"]) for d in dropped]
    table = build_table(arch, header["sms"], source, rows, existing, measured, notes)
    text = json.dumps(table, indent=1) + "\n"
    if FLAGS.write:
        path.write_text(text)
        print(f"wrote {path}", file=sys.stderr)
    else:
        print(text)


if __name__ == "__main__":
    harness.define_protocol_flags()
    harness.define_grid_flags(arms_default=())
    flags.DEFINE_list("splits", [], "Split counts to try per tile (empty: the planner's count).")
    flags.DEFINE_list("busy_sms", [str(s) for s in plan_rule.BUSY_SMS], "SMs the busy kernel holds, condition (b).")
    flags.DEFINE_enum("contention", "cuda", ["cuda", "none"], "none: skip (b) (every point stays deterministic).")
    flags.DEFINE_string("arch", None, "Table architecture (default: from the GPU, sm_90a on an H200).")
    flags.DEFINE_string("table", None, "Table path (default jax_cake/planner/tables/<arch>.json).")
    flags.DEFINE_bool("write", False, "Write the table file; otherwise print it.")
    flags.DEFINE_bool(
        "keep_rows",
        False,
        "Keep the table's rows (of this SM count) for shapes this run did not measure: a grid tuned in parts.",
    )
    flags.DEFINE_bool(
        "screen",
        True,
        "First time wgrad alone in graph mode at every point; only candidates passing (a) there get "
        "the full measurement (a candidate failing it fails the rule).",
    )
    flags.DEFINE_list("child_ops", list(TUNE_OPS), "Internal: the ops a child times.")
    flags.DEFINE_string("child_cells", None, "Internal: a JSON list of (op, T, d_in, d_out, out) cells a child times.")
    flags.DEFINE_bool("xla", True, f"Time XLA's dot ({XLA_ARM}) against det too and write xla rows where it wins.")
    flags.DEFINE_list("xla_ops", list(XLA_OPS), "The ops XLA's dot is timed at (fwd, dgrad, wgrad).")
    app.run(main)
