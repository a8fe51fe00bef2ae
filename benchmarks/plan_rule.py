"""The plan rule (docs/planner.md) as pure functions on timings (microseconds) and errors.

A point (arch, SM count, d_in, d_out, out dtype, T) keeps the split-K program only
if all four conditions hold; otherwise it runs the deterministic program:

(a) op: in every run of every mode (g = CUDA graphs, e = eager), the split program
    beat det over that run's paired groups: one-sided paired sign test p < 0.05 and
    median of the paired ratios split/det < 0.99. Both modes must have data.
(b) contention: next to a busy kernel holding 8, 16 and 32 SMs on another stream,
    in both launch orders, median(split) / median(det) <= 1.03 in every cell.
(c) steps: for bwd and 2fwd+bwd, in g and e, the ratio of medians over the runs
    (median over runs of each run's median) split/det <= 1.013.
(d) accuracy: the candidate's output, ||out - ref|| / ||ref|| against a float64
    reference of the same BF16 operands, in every run where it was measured, is under
    the op's contract (`rel_err_max`: FP32 dw 1e-5, BF16 outputs 1e-2).

A condition with no data fails: without evidence the deterministic program stays.

XLA's own dot (the XLA path) replaces jax_cake's program at a point and op (fwd, dgrad,
wgrad) by (a) and (d) (`decide_xla`): every paired run of both modes, p < 0.05 and median
ratio XLA/jax_cake < 0.99; PairedRun's `split` then holds XLA's times; and XLA's error
within the op's contract. Faster is not enough: XLA's FP32-output dot sums K in one
level, and at T = 16384, 4096 -> 4096 its FP32 dw was 1.86e-5 off (H200, 2026-12-02)
where jax_cake's two-level sum is 2-5e-6.

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

# The accuracy contract, (d): ||out - ref|| / ||ref|| against float64 from the same BF16
# operands must be under these, by the output's dtype. FP32 dw: the bound jax_cake's own
# FP32 wgrad meets (its two-level FP32 sum: 2-5e-6 on the H200 at T = 16384). BF16
# outputs: one rounding to BF16 is up to 2^-9 = 3.9e-3 per element, and 1e-2 leaves room
# for the FP32 sum order on top. The GPU tests' tolerances (tests/gpu/gpu_helpers.py) are
# these numbers.
FP32_REL_ERR_MAX = 1e-5
BF16_REL_ERR_MAX = 1e-2
ACCURACY_CONTRACT = {
    ("fwd", "bfloat16"): BF16_REL_ERR_MAX,
    ("dgrad", "bfloat16"): BF16_REL_ERR_MAX,
    ("wgrad", "bfloat16"): BF16_REL_ERR_MAX,
    ("wgrad", "float32"): FP32_REL_ERR_MAX,
}


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

    condition: str  # "a", "b", "c" or "d"
    cell: str  # e.g. "g run 2", "16 SMs busy_first", "bwd e", "wgrad float32"
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

    @property
    def dropped_for_accuracy(self) -> bool:
        """The candidate met every timing condition and only (d) failed: faster, but its
        error misses the op's contract (the tuner reports such an arm with its error)."""
        failed = self.failed
        return bool(failed) and all(c.condition == "d" for c in failed)

    def explain(self) -> str:
        """Multi-line text for `jax_cake.explain` / tune: decision, then every check."""
        head = (
            "split-K kept: (a), (b), (c) and (d) hold"
            if self.keep_split
            else "deterministic program: failed " + ", ".join(f"({c.condition}) {c.cell}" for c in self.failed)
        )
        lines = [head]
        for c in self.checks:
            lines.append(f"  ({c.condition}) {c.cell}: {'ok' if c.passed else 'FAIL'} {c.detail}")
        return "\n".join(lines)

    def evidence(self) -> str:
        """One line for a plan-table row: 'a: ...; b: ...; c: ...; d: ...'."""
        parts = []
        for cond in ("a", "b", "c", "d"):
            cells = [f"{c.cell} {c.detail}" + ("" if c.passed else " FAIL") for c in self.checks if c.condition == cond]
            if cells:  # decide_xla's verdicts hold (a) and (d) only
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


def rel_err_max(op: str, out: str) -> float:
    """The accuracy contract of one GEMM's output: `out` is the plan's out dtype (w's dtype
    for wgrad, bfloat16 for fwd and dgrad)."""
    try:
        return ACCURACY_CONTRACT[(op, out)]
    except KeyError:
        raise ValueError(f"no accuracy contract for {op} with {out} output: {sorted(ACCURACY_CONTRACT)}") from None


def check_accuracy(op: str, out: str, errors: Sequence[float | None]) -> Check:
    """Condition (d): every measured error (one per run; None = that run measured none) of
    the candidate's `op` output under rel_err_max(op, out). No error, a None or a NaN fails."""
    limit = rel_err_max(op, out)
    cell = f"{op} {out}"
    if not errors or any(e is None for e in errors):
        return Check("d", cell, False, f"no error measured (contract {limit:.0e})")
    worst = max(errors, key=lambda e: e if math.isfinite(e) else math.inf)
    passed = math.isfinite(worst) and worst < limit
    return Check("d", cell, passed, f"err={worst:.2e} {'<' if passed else '>='} {limit:.0e}")


def worst_error(errors: Sequence[float | None]) -> float | None:
    """The largest measured error (None without any; NaN counts as infinite)."""
    got = [math.inf if not math.isfinite(e) else e for e in errors if e is not None]
    return max(got) if got else None


def decide(
    op: Mapping[str, Sequence[PairedRun]],
    contention: Mapping[tuple[int, str], Sequence[PairedRun]],
    steps: Mapping[tuple[str, str], Sequence[PairedRun]],
    *,
    errors: Sequence[float | None],
    out: str,
) -> Verdict:
    """The whole rule for one wgrad point; see the module docstring for the inputs. errors:
    the split program's dw error in each measured run; out: dw's dtype."""
    checks = tuple(check_op(op) + check_contention(contention) + check_steps(steps))
    checks += (check_accuracy("wgrad", out, errors),)
    return Verdict(keep_split=all(c.passed for c in checks), checks=checks)


def decide_xla(
    op: Mapping[str, Sequence[PairedRun]], *, gemm: str, out: str, errors: Sequence[float | None]
) -> Verdict:
    """XLA's dot against jax_cake's program at one op (`gemm`: fwd, dgrad or wgrad; `out`:
    the plan's out dtype): (a) over {mode: [PairedRun(jax_cake times, XLA times), ...]}
    and (d) over XLA's errors. keep_split here means: XLA wins, within the contract."""
    checks = tuple(check_op(op)) + (check_accuracy(gemm, out, errors),)
    return Verdict(keep_split=all(c.passed for c in checks), checks=checks)


def worst_ratio(op: Mapping[str, Sequence[PairedRun]]) -> float | None:
    """The highest per-run median paired ratio candidate/baseline over every run of every
    mode (None without runs): the least favourable run, as a table row records it."""
    ratios = [statistics.median(s / d for d, s in zip(r.det, r.split)) for runs in op.values() for r in runs]
    return max(ratios) if ratios else None
