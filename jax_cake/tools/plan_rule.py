"""The plan rule (docs/planner.md) as pure functions on timings (microseconds).

A point (arch, SM count, d_in, d_out, out dtype, T) keeps the split-K program only
if all three conditions hold; otherwise it runs the deterministic program:

(a) op: in every run of every mode (g = CUDA graphs, e = eager), the split program
    beat det over that run's paired groups: one-sided paired sign test p < 0.05 and
    median of the paired ratios split/det < 0.99. Both modes must have data.
(b) contention: next to a busy kernel holding 8, 16 and 32 SMs on another stream,
    in both launch orders, median(split) / median(det) <= 1.03 in every cell.
(c) steps: for bwd and 2fwd+bwd, in g and e, the ratio of medians over the runs
    (median over runs of each run's median) split/det <= 1.013.

A condition with no data fails: without evidence the deterministic program stays.

XLA's own dot (the XLA path) replaces jax_cake's program at a point and op (fwd, dgrad,
wgrad) by (a) alone (`decide_xla`): every paired run of both modes, p < 0.05 and median
ratio XLA/jax_cake < 0.99; PairedRun's `split` then holds XLA's times.

Sign-test ties: a pair with split == det is no evidence that split is faster, so it
counts as a non-win and stays in n (stricter than the textbook choice of dropping
ties, which would let 5 wins among 50 ties pass).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Mapping, Sequence

SIGN_TEST_P_MAX = 0.05  # strict: p < 0.05
OP_RATIO_MAX = 0.99  # strict: median paired ratio < 0.99
CONTENTION_RATIO_MAX = 1.03  # at most 3 % slower
STEP_RATIO_MAX = 1.013  # at most 1.3 % slower
MODES = ("g", "e")
BUSY_SMS = (8, 16, 32)
LAUNCH_ORDERS = ("busy_first", "op_first")
STEP_OPS = ("bwd", "2fwd+bwd")


@dataclasses.dataclass(frozen=True)
class PairedRun:
    """One run's paired groups: det[i] and split[i] were timed in the same group."""

    det: tuple[float, ...]
    split: tuple[float, ...]

    def __post_init__(self):
        if len(self.det) != len(self.split):
            raise ValueError(
                f"PairedRun needs one split time per det time, got {len(self.det)} det and {len(self.split)} split"
            )
        if not self.det:
            raise ValueError("PairedRun needs at least one paired group")
        if min(self.det + self.split) <= 0:
            raise ValueError("PairedRun times must be positive microseconds")


@dataclasses.dataclass(frozen=True)
class Check:
    """One cell of the rule: which condition, where, whether it held, the numbers."""

    condition: str  # "a", "b" or "c"
    cell: str  # e.g. "g run 2", "16 SMs busy_first", "bwd e"
    passed: bool
    detail: str  # the numbers, e.g. "p=0.0010 (10/10 wins) r=0.930 < 0.99"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The rule's decision for one point and the checks behind it."""

    keep_split: bool
    checks: tuple[Check, ...]

    @property
    def failed(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.passed)

    def explain(self) -> str:
        """Multi-line text for `jax_cake.explain` / tune: decision, then every check."""
        head = (
            "split-K kept: (a), (b) and (c) hold"
            if self.keep_split
            else "deterministic program: failed " + ", ".join(f"({c.condition}) {c.cell}" for c in self.failed)
        )
        lines = [head]
        for c in self.checks:
            lines.append(f"  ({c.condition}) {c.cell}: {'ok' if c.passed else 'FAIL'} {c.detail}")
        return "\n".join(lines)

    def evidence(self) -> str:
        """One line for a plan-table row: 'a: ...; b: ...; c: ...'."""
        parts = []
        for cond in ("a", "b", "c"):
            cells = [f"{c.cell} {c.detail}" + ("" if c.passed else " FAIL") for c in self.checks if c.condition == cond]
            if cells:  # decide_xla's verdicts hold (a) only
                parts.append(f"{cond}: " + ", ".join(cells))
        return "; ".join(parts)


def sign_test_p(wins: int, n: int) -> float:
    """One-sided exact binomial p: P(X >= wins) for X ~ Binomial(n, 1/2)."""
    if not 0 <= wins <= n:
        raise ValueError(f"wins must be in [0, n], got wins={wins}, n={n}")
    return sum(math.comb(n, i) for i in range(wins, n + 1)) / 2**n


def check_op_run(mode: str, index: int, run: PairedRun) -> Check:
    """Condition (a) for one run of one mode: sign test and median paired ratio."""
    wins = sum(s < d for d, s in zip(run.det, run.split))  # ties are non-wins
    n = len(run.det)
    p = sign_test_p(wins, n)
    ratio = statistics.median(s / d for d, s in zip(run.det, run.split))
    passed = p < SIGN_TEST_P_MAX and ratio < OP_RATIO_MAX
    return Check("a", f"{mode} run {index}", passed, f"p={p:.4f} ({wins}/{n} wins) r={ratio:.3f}")


def check_op(runs_by_mode: Mapping[str, Sequence[PairedRun]]) -> list[Check]:
    """Condition (a) over {mode: [PairedRun, ...]} of the op (e.g. wgrad) itself."""
    checks = []
    for mode in MODES:
        runs = runs_by_mode.get(mode, ())
        if not runs:
            checks.append(Check("a", f"{mode}", False, "no runs"))
        checks.extend(check_op_run(mode, i, run) for i, run in enumerate(runs))
    return checks


def ratio_of_medians(runs: Sequence[PairedRun]) -> float:
    """split/det of the medians over runs of each run's median group time."""
    det = statistics.median(statistics.median(r.det) for r in runs)
    split = statistics.median(statistics.median(r.split) for r in runs)
    return split / det


def _ratio_checks(condition: str, cells, runs_by_cell, limit: float, digits: int) -> list[Check]:
    """One Check per (key, label) cell: its ratio of medians over runs must be <= limit;
    a cell without runs fails."""
    checks = []
    for key, label in cells:
        runs = runs_by_cell.get(key, ())
        if not runs:
            checks.append(Check(condition, label, False, "no runs"))
            continue
        r = ratio_of_medians(runs)
        checks.append(Check(condition, label, r <= limit, f"r={r:.{digits}f}"))
    return checks


def check_contention(runs_by_cell: Mapping[tuple[int, str], Sequence[PairedRun]]) -> list[Check]:
    """Condition (b) over {(busy_sms, launch_order): [PairedRun, ...]}.

    Every (busy SMs, order) cell of BUSY_SMS x LAUNCH_ORDERS needs data; each cell's
    ratio of medians over its runs must be <= CONTENTION_RATIO_MAX.
    """
    cells = [((sms, order), f"{sms} SMs {order}") for sms in BUSY_SMS for order in LAUNCH_ORDERS]
    return _ratio_checks("b", cells, runs_by_cell, CONTENTION_RATIO_MAX, 3)


def check_steps(runs_by_cell: Mapping[tuple[str, str], Sequence[PairedRun]]) -> list[Check]:
    """Condition (c) over {(op, mode): [PairedRun, ...]}, op in STEP_OPS."""
    cells = [((op, mode), f"{op} {mode}") for op in STEP_OPS for mode in MODES]
    return _ratio_checks("c", cells, runs_by_cell, STEP_RATIO_MAX, 4)


def decide(
    op: Mapping[str, Sequence[PairedRun]],
    contention: Mapping[tuple[int, str], Sequence[PairedRun]],
    steps: Mapping[tuple[str, str], Sequence[PairedRun]],
) -> Verdict:
    """The whole rule for one point; see the module docstring for the inputs."""
    checks = tuple(check_op(op) + check_contention(contention) + check_steps(steps))
    return Verdict(keep_split=all(c.passed for c in checks), checks=checks)


def decide_xla(op: Mapping[str, Sequence[PairedRun]]) -> Verdict:
    """XLA's dot against jax_cake's program at one op: condition (a) alone, over {mode:
    [PairedRun(jax_cake times, XLA times), ...]}. keep_split here means: XLA wins."""
    checks = tuple(check_op(op))
    return Verdict(keep_split=all(c.passed for c in checks), checks=checks)


def worst_ratio(op: Mapping[str, Sequence[PairedRun]]) -> float | None:
    """The highest per-run median paired ratio candidate/baseline over every run of every
    mode (None without runs): the least favourable run, as a table row records it."""
    ratios = [statistics.median(s / d for d, s in zip(r.det, r.split)) for runs in op.values() for r in runs]
    return max(ratios) if ratios else None
