"""--family=core: every fwd / dgrad GEMM variant forced, against XLA's dot, at the
compute-bound Llama shapes.

    python -m benchmarks.bench --family=core --csv=$OUT/core.csv      # H200: about 3-4 minutes
    python -m benchmarks.bench --family=core --tokens=8192 --only=c2x1 --groups=6 --pairs=4096:6144,4096:14336

Needs a CUDA GPU and the built library (each forced arm's lowering must hold its kernel).
For each op (fwd: y = x w^T, K = d_in; dgrad: dx = dy w, K = d_out) and (d_in, d_out) of
`--pairs` at each T of `--tokens`, the arms are XLA (`jnp.dot`, jax.vjp for dgrad) and
every compiled bf16 variant of the op with tile_n >= 128 (cooperative and ping-pong, each
cluster; `--only` keeps those whose arm name matches a regex), each run under
`jax_cake.planner.force("det", tile=, schedule=, cluster=)`, and with `--rasters` once more
per named tile walk (force(raster=): bands of B cluster rows "m<B>", "m", "n"). One run in
one mode (graph, XLA's default, by default); `--groups` x `--steps` >= 15. Each arm's
result is compared once with XLA's (max |arm - xla| <= 2^-6 max |xla|: two bf16 roundings
of fp32 sums), and its lowered custom call is checked to name the forced tile / cluster /
schedule (so a missing library or an ignored force fails loudly instead of timing XLA
twice); a run where an arm misses XLA's result exits 1.

The CSV has one row per op, shape and arm, with the GPU, SM count, jax version, date and
every paired group's time; `python -m benchmarks.tune_tiles --csv=...` turns it into the
plan table's per-shape tile rows.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import sys
import time
from typing import Sequence

from absl import app, flags

from benchmarks import harness
from benchmarks import markdown as md
from benchmarks.families import dense

FLAGS = flags.FLAGS
DEFAULT_PAIRS = ("4096:14336", "14336:4096", "4096:4096", "4096:1024")
OPS = ("fwd", "dgrad")
COLUMNS = (
    "op",
    "T",
    "d_in",
    "d_out",
    "arm",
    "tile",
    "cluster",
    "schedule",
    "raster",
    "us",
    "tflops",
    "xla_over_arm",
    "max_err_rel",
    "ok",
    "groups_us",
    "gpu",
    "sms",
    "jax",
    "date",
    "mode",
)


@dataclasses.dataclass(frozen=True)
class CoreArm:
    """One arm: "xla", or a compiled variant forced by tile, cluster and schedule."""

    name: str
    tile: tuple[int, int, int] | None = None
    cluster: tuple[int, int] | None = None
    schedule: str | None = None
    raster: str | None = None  # a Plan.raster name; None: the planner's walk for the shape

    @property
    def bench_arm(self) -> str:
        """The arm in the harness's syntax (harness.parse_arm)."""
        if self.tile is None:
            return "xla"
        sched = {"pingpong": "pp", "tiles": "tiles"}[self.schedule]
        walk = f"/r{self.raster}" if self.raster else ""
        return f"det/t{'x'.join(map(str, self.tile))}/{sched}/c{self.cluster[0]}{walk}"


def variant_arms(op: str, rasters: Sequence[str] = (), only: str = "") -> list[CoreArm]:
    """XLA first, then every compiled dense bf16 plain-store variant of op with tile_n >= 128
    whose name matches the regex `only` (all when empty), each with the planner's tile
    walk and then once per Plan.raster name of `rasters` (name suffix _r<raster>)."""
    from jax_cake import contract
    from jax_cake.planner import variants

    for r in rasters:
        contract.raster_code(r)  # a bad name fails before anything runs
    arms = [CoreArm("xla")]
    for v in variants.VARIANTS:
        if v.program != op or v.store != "plain" or v.out_dtype != "bfloat16" or v.tile_n < 128 or v.grouping:
            continue
        sched = "pp" if v.schedule == "pingpong" else "coop"
        name = f"{v.tile_m}x{v.tile_n}_{sched}_c{v.cluster_m}x{v.cluster_n}"
        if only and not re.search(only, name):
            continue
        arms.append(CoreArm(name, v.tile, v.cluster, v.schedule))
        arms += [CoreArm(f"{name}_r{r}", v.tile, v.cluster, v.schedule, r) for r in rasters]
    return arms


def cases(tokens: Sequence[int], pairs: Sequence[tuple[int, int]], ops: Sequence[str] = OPS) -> list[tuple]:
    """(op, T, d_in, d_out) in run order."""
    return [(op, t, d_in, d_out) for t in tokens for d_in, d_out in pairs for op in ops]


def flops(tokens: int, d_in: int, d_out: int) -> float:
    return 2.0 * tokens * d_in * d_out


def check_lowering(arm: CoreArm, op: str, fn, args, platforms: tuple[str, ...] | None = None) -> None:
    """The forced arm's lowered program holds one jax_cake custom call with its tile,
    cluster and schedule (platforms: lower for these instead of the default backend)."""
    import jax

    from jax_cake import contract

    with harness.planning_for(harness.parse_arm(arm.bench_arm)):
        traced = jax.jit(fn).trace(*args)
        text = (traced.lower(lowering_platforms=platforms) if platforms else traced.lower()).as_text()
    calls = [l for l in text.splitlines() if re.search(rf"custom_call @\w*jax_cake_{op}\b", l)]
    if len(calls) != 1:
        raise RuntimeError(f"{op} {arm.name}: expected one jax_cake_{op} custom call, found {len(calls)}")

    def attr(name):
        return int(re.search(rf"\b{name} = (-?\d+) : i64", calls[0]).group(1))

    got = (attr("tile_m"), attr("tile_n"), attr("cluster_m"), attr("schedule"))
    want = (arm.tile[0], arm.tile[1], arm.cluster[0], contract.SCHEDULES[arm.schedule])
    if got != want:
        raise RuntimeError(f"{op} {arm.name}: the plan ran (tile_m, tile_n, cluster_m, schedule) {got}, not {want}")
    if arm.raster is not None and attr("raster") != contract.raster_code(arm.raster):
        raise RuntimeError(f"{op} {arm.name}: the plan walked raster code {attr('raster')}, not {arm.raster!r}")


def check_results(op: str, arms: Sequence[CoreArm], x, w, dy) -> dict[str, float]:
    """{arm: max |arm - xla| / max |xla|} of one un-timed call each (lowering checked)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    out = {}
    ref = None
    for arm in arms:
        spec = harness.parse_arm(arm.bench_arm)
        fn = harness.op_fn(op, dense.project(spec))
        if arm.tile is not None:
            check_lowering(arm, op, fn, (x, w, dy))
        with harness.planning_for(spec):
            got = jax.jit(fn).lower(x, w, dy).compile()(x, w, dy)[0]
        got = np.asarray(jnp.asarray(got, jnp.float32))
        if ref is None:
            ref = got
            scale = float(np.max(np.abs(ref))) or 1.0
        out[arm.name] = float(np.max(np.abs(got - ref))) / scale if np.all(np.isfinite(got)) else float("inf")
    return out


def check() -> None:
    if len(FLAGS.modes) != 1:
        raise app.UsageError("--family=core measures one mode (--modes=g or e); pool runs in tune_tiles")
    if FLAGS.groups * FLAGS.steps < 15 and FLAGS.timer != "wall" and not FLAGS.allow_few_reps:
        raise app.UsageError("--groups x --steps must be >= 15 (or pass --allow_few_reps)")
    harness.selected("ops", OPS)
    harness.parse_pairs(FLAGS.pairs)


def child(mode: str, run: int, timer_kind: str) -> list[dict]:
    """Times every case's arms in this process: one sample per (case, arm)."""
    import jax

    samples = []
    for op, t, d_in, d_out in cases(list(map(int, FLAGS.tokens)), harness.parse_pairs(FLAGS.pairs), FLAGS.ops):
        t0 = time.time()
        arms = variant_arms(op, FLAGS.rasters, FLAGS.only)
        point = harness.Point(t, d_in, d_out, "bfloat16")
        _, x, w, dy = harness.make_inputs(point, 1)
        errs = check_results(op, arms, x, w, dy)
        del x, w, dy
        specs = [harness.parse_arm(a.bench_arm) for a in arms]
        groups_us = harness.measure_point(
            point, op, specs, dense.project, timer_kind, FLAGS.steps, FLAGS.groups, FLAGS.flush_mb
        )
        jax.clear_caches()
        harness.clear_compiled()  # one point's executables at a time (device memory)
        for a in arms:
            samples.append(
                {
                    "op": op,
                    "T": t,
                    "d_in": d_in,
                    "d_out": d_out,
                    "arm": a.name,
                    "tile": "x".join(map(str, a.tile)) if a.tile else "",
                    "cluster": "x".join(map(str, a.cluster)) if a.cluster else "",
                    "schedule": a.schedule or "xla",
                    "raster": a.raster or "",
                    "max_err_rel": errs[a.name],
                    "mode": mode,
                    "run": run,
                    "groups_us": [g for g in groups_us[a.bench_arm] if g is not None],
                }
            )
        print(f"{op} T={t} {d_in}->{d_out}: {len(arms)} arms in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return samples


def rows(header: dict, samples: Sequence[dict]) -> list[dict]:
    """One row per (op, T, d_in, d_out, arm): the median over runs of each run's median
    group, every group run after run, and the run's gpu / sms / jax / date."""
    key = lambda s: (s["op"], s["T"], s["d_in"], s["d_out"], s["arm"])
    by_arm: dict[tuple, list[dict]] = {}
    for s in sorted(samples, key=lambda s: s["run"]):
        by_arm.setdefault(key(s), []).append(s)
    us = {k: statistics.median(statistics.median(s["groups_us"]) for s in v) for k, v in by_arm.items()}
    out = []
    for k, runs in by_arm.items():
        first, err = runs[0], max(s["max_err_rel"] for s in runs)
        op, t, d_in, d_out, _ = k
        out.append(
            {
                **{c: first[c] for c in ("op", "T", "d_in", "d_out", "arm", "tile", "cluster", "schedule", "raster")},
                "us": round(us[k], 2),
                "tflops": round(flops(t, d_in, d_out) / us[k] / 1e6, 1),
                "xla_over_arm": round(us[(op, t, d_in, d_out, "xla")] / us[k], 4),
                "max_err_rel": f"{err:.3g}",
                "ok": err <= harness.XLA_MATCH_REL_TOL,
                "groups_us": " ".join(f"{g:.2f}" for s in runs for g in s["groups_us"]),
                **{c: header[c] for c in ("gpu", "sms", "jax", "date")},
                "mode": first["mode"],
            }
        )
    return out


def report(header: dict, samples: Sequence[dict]) -> harness.Report:
    table = rows(header, samples)
    cols = ("op", "T", "d_in", "d_out", "arm", "us", "tflops", "xla_over_arm", "max_err_rel", "ok")
    title = (
        f"core: {header['gpu']}, {header['sms']} SMs, driver {header['driver']}, jax {header['jax']}, "
        f"{header['date']}, {header['timer']}, mode {FLAGS.modes[0]}, {FLAGS.runs} run(s) x {FLAGS.groups} groups x "
        f"{FLAGS.steps} steps, L2 flush {FLAGS.flush_mb} MiB; xla_over_arm above 1: the arm is faster than XLA"
    )
    text = "\n".join([title, "", *md.table(cols, ([str(r[c]) for c in cols] for r in table))]) + "\n"
    bad = [f"{r['op']} T={r['T']} {r['d_in']}->{r['d_out']} {r['arm']}" for r in table if not r["ok"]]
    failed = ("results off XLA's beyond bf16 tolerance: " + ", ".join(bad)) if bad else ""
    return harness.Report(text, COLUMNS, table, failed)


FAMILY = harness.Family(
    "core",
    "every fwd/dgrad variant forced against XLA's dot at the Llama shapes (plan-table tile rows)",
    ("tokens", "pairs", "ops", "only", "rasters", "allow_few_reps"),
    {"tokens": ["8192"], "pairs": list(DEFAULT_PAIRS), "ops": list(OPS)}
    | {"runs": 1, "modes": ["g"], "groups": 6, "steps": 5},
    child,
    report,
    check,
)
