"""Every fwd / dgrad GEMM variant forced, against XLA's dot, at the compute-bound Llama shapes.

    python -m jax_cake.tools.core_bench --out=$OUT            # H200: about 3-4 minutes

Needs a CUDA GPU and the built library (each forced arm's lowering must hold its kernel).

For each op (fwd: y = x w^T, K = d_in; dgrad: dx = dy w, K = d_out) and (d_in, d_out) of
`--pairs` at T = `--tokens`, the arms are XLA (`jnp.dot`, jax.vjp for dgrad) and every
compiled bf16 variant of the op with tile_n >= 128 (cooperative and ping-pong, each
cluster; `--only` keeps those whose arm name matches a regex), each run under
`jax_cake.planner.force("det", tile=, schedule=, cluster=)`, and with `--rasters` once
more per named tile walk (force(raster=): bands of B cluster rows "m<B>", "m", "n").
Timing is jax_cake.tools.bench's `measure_point`: one process, command buffers on (XLA's
default, profiled as graphs), `--steps` unrolled steps per call each followed by an L2
flush (`--flush_mb`), arms interleaved in `--groups` paired groups (order rotated per
group), CUPTI device time per step; an arm's time is the median over groups of each
group's median step (groups x steps >= 15 reps). Each arm's result is compared once with
XLA's (max |arm - xla| <= 2^-6 max |xla|: two bf16 roundings of fp32 sums), and its
lowered custom call is checked to name the forced tile / cluster / schedule (so a missing
library or an ignored force fails loudly instead of timing XLA twice).

Writes <out>/core_bench.csv (one row per op, shape and arm, with the GPU, SM count, jax
version and date) and prints a table. `python -m jax_cake.tools.tune_tiles` turns the CSV
into the plan table's per-shape tile rows.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import re
import statistics
import sys
import time
from typing import Sequence

from absl import app, flags

from jax_cake.tools import markdown as md

FLAGS = flags.FLAGS
DEFAULT_PAIRS = ("4096:14336", "14336:4096", "4096:4096", "4096:1024")
OPS = ("fwd", "dgrad")
CSV_NAME = "core_bench.csv"
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
)
# Environment of a profiled run (bench's mode g): command buffers stay on while profiling,
# and CUPTI does not serialize kernels.
_ENV = {
    "XLA_FLAGS": "--xla_enable_command_buffers_during_profiling=true",
    "TF_GPU_CUPTI_FORCE_CONCURRENT_KERNEL": "1",
}


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
        """The arm in jax_cake.tools.bench's syntax (bench.parse_arm)."""
        if self.tile is None:
            return "xla"
        sched = {"pingpong": "pp", "tiles": "tiles"}[self.schedule]
        walk = f"/r{self.raster}" if self.raster else ""
        return f"det/t{'x'.join(map(str, self.tile))}/{sched}/c{self.cluster[0]}{walk}"


def variant_arms(op: str, rasters: Sequence[str] = (), only: str = "") -> list[CoreArm]:
    """XLA first, then every compiled bf16 plain-store variant of op with tile_n >= 128
    whose name matches the regex `only` (all when empty), each with the planner's tile
    walk and then once per Plan.raster name of `rasters` (name suffix _r<raster>)."""
    from jax_cake import contract
    from jax_cake.planner import variants

    for r in rasters:
        contract.raster_code(r)  # a bad name fails before anything runs
    arms = [CoreArm("xla")]
    for v in variants.VARIANTS:
        if v.program != op or v.store != "plain" or v.out_dtype != "bfloat16" or v.tile_n < 128:
            continue
        sched = "pp" if v.schedule == "pingpong" else "coop"
        name = f"{v.tile_m}x{v.tile_n}_{sched}_c{v.cluster_m}x{v.cluster_n}"
        if only and not re.search(only, name):
            continue
        arms.append(CoreArm(name, v.tile, v.cluster, v.schedule))
        arms += [CoreArm(f"{name}_r{r}", v.tile, v.cluster, v.schedule, r) for r in rasters]
    return arms


def parse_pairs(pairs: Sequence[str]) -> list[tuple[int, int]]:
    out = []
    for p in pairs:
        d_in, sep, d_out = p.partition(":")
        if not sep or not d_in.isdigit() or not d_out.isdigit():
            raise ValueError(f"--pairs: {p!r} is not d_in:d_out")
        out.append((int(d_in), int(d_out)))
    return out


def cases(tokens: int, pairs: Sequence[tuple[int, int]], ops: Sequence[str] = OPS) -> list[tuple[str, int, int, int]]:
    """(op, T, d_in, d_out) in run order."""
    return [(op, tokens, d_in, d_out) for d_in, d_out in pairs for op in ops]


def flops(tokens: int, d_in: int, d_out: int) -> float:
    return 2.0 * tokens * d_in * d_out


def check_lowering(arm: CoreArm, op: str, fn, args, platforms: tuple[str, ...] | None = None) -> None:
    """The forced arm's lowered program holds one jax_cake custom call with its tile,
    cluster and schedule (platforms: lower for these instead of the default backend)."""
    import jax

    from jax_cake import contract
    from jax_cake.tools import bench

    with bench.planning_for(bench.parse_arm(arm.bench_arm)):
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

    from jax_cake.tools import bench

    out = {}
    ref = None
    for arm in arms:
        spec = bench.parse_arm(arm.bench_arm)
        fn = bench.op_fn(op, bench.jax_projection(spec))
        if arm.tile is not None:
            check_lowering(arm, op, fn, (x, w, dy))
        with bench.planning_for(spec):
            got = jax.jit(fn).lower(x, w, dy).compile()(x, w, dy)[0]
        got = np.asarray(jnp.asarray(got, jnp.float32))
        if ref is None:
            ref = got
            scale = float(np.max(np.abs(ref))) or 1.0
        out[arm.name] = float(np.max(np.abs(got - ref))) / scale if np.all(np.isfinite(got)) else float("inf")
    return out


def run(
    out_dir: str,
    tokens: int,
    pairs,
    groups: int,
    steps: int,
    flush_mb: int,
    timer_kind: str,
    header: dict,
    rasters: Sequence[str] = (),
    only: str = "",
) -> list[dict]:
    """Times every case's arms; each CSV row carries header's gpu / sms / jax / date
    (bench.device_header of the run)."""
    import jax

    from jax_cake.tools import bench

    rows = []
    for op, t, d_in, d_out in cases(tokens, pairs):
        t0 = time.time()
        arms = variant_arms(op, rasters, only)
        point = bench.Point(t, d_in, d_out, "bfloat16")
        _, x, w, dy = bench.make_inputs(point, 1)
        errs = check_results(op, arms, x, w, dy)
        del x, w, dy
        groups_us = bench.measure_point(
            point, op, [bench.parse_arm(a.bench_arm) for a in arms], timer_kind, steps, groups, flush_mb
        )
        jax.clear_caches()
        bench.clear_compiled()  # one point's executables at a time (device memory)
        us = {a.name: statistics.median([g for g in groups_us[a.bench_arm] if g is not None]) for a in arms}
        for a in arms:
            rows.append(
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
                    "us": round(us[a.name], 2),
                    "tflops": round(flops(t, d_in, d_out) / us[a.name] / 1e6, 1),
                    "xla_over_arm": round(us["xla"] / us[a.name], 4),
                    "max_err_rel": f"{errs[a.name]:.3g}",
                    "ok": errs[a.name] <= bench.XLA_MATCH_REL_TOL,
                    "groups_us": " ".join(f"{g:.2f}" for g in groups_us[a.bench_arm] if g is not None),
                    **{key: header[key] for key in ("gpu", "sms", "jax", "date")},
                }
            )
        print(f"{op} T={t} {d_in}->{d_out}: {len(arms)} arms in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        write_csv(out_dir, rows)  # after every point: a cut-short run keeps what it measured
    return rows


def write_csv(out_dir: str, rows: Sequence[dict]) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, CSV_NAME)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    return path


def table(rows: Sequence[dict], header: str = "") -> str:
    cols = ("op", "d_in", "d_out", "arm", "us", "tflops", "xla_over_arm", "max_err_rel", "ok")
    lines = [header, ""] if header else []
    lines += md.table(cols, ([str(r[c]) for c in cols] for r in rows))
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    for k, v in _ENV.items():  # before the backend starts (the first jax.devices())
        if k == "XLA_FLAGS":
            os.environ[k] = (os.environ.get(k, "") + " " + v).strip()
        else:
            os.environ.setdefault(k, v)
    from jax_cake.tools import bench

    pairs = parse_pairs(FLAGS.pairs)
    if FLAGS.groups * FLAGS.steps < 15 and FLAGS.timer != "wall" and not FLAGS.allow_few_reps:
        raise app.UsageError("--groups x --steps must be >= 15 (or pass --allow_few_reps)")
    timer_kind = FLAGS.timer or bench.default_timer()
    h = bench.device_header(timer_kind)
    t0 = time.time()
    rows = run(
        FLAGS.out, FLAGS.tokens, pairs, FLAGS.groups, FLAGS.steps, FLAGS.flush_mb, timer_kind, h, FLAGS.rasters, FLAGS.only
    )
    header = (
        f"core_bench: {h['gpu']}, {h['sms']} SMs, driver {h['driver']}, jax {h['jax']}, {h['date']}, {h['timer']}, "
        f"{FLAGS.groups} groups x {FLAGS.steps} steps, L2 flush {FLAGS.flush_mb} MiB, {time.time() - t0:.0f} s"
    )
    text = table(rows, header)
    print(text)
    with open(os.path.join(FLAGS.out, "core_bench.md"), "w") as f:
        f.write(text)
    bad = [f"{r['op']} {r['d_in']}->{r['d_out']} {r['arm']}" for r in rows if not r["ok"]]
    if bad:
        print("results off XLA's beyond bf16 tolerance: " + ", ".join(bad), file=sys.stderr)
        sys.exit(1)


def define_flags() -> None:
    flags.DEFINE_string("out", None, "Directory for core_bench.csv and core_bench.md.", required=True)
    flags.DEFINE_integer("tokens", 8192, "T.")
    flags.DEFINE_list("pairs", list(DEFAULT_PAIRS), "d_in:d_out pairs.")
    flags.DEFINE_integer("groups", 6, "Paired groups per point (the arms interleaved, order rotated).")
    flags.DEFINE_integer("steps", 5, "Steps per call (each followed by an L2 flush); a group's time is their median.")
    flags.DEFINE_integer("flush_mb", 128, "L2 flush buffer (MiB), >= 2x the H200's L2.")
    flags.DEFINE_enum("timer", None, ["device", "wall"], "device (CUPTI) on a GPU, wall elsewhere (default).")
    flags.DEFINE_bool("allow_few_reps", False, "Allow groups x steps < 15.")
    flags.DEFINE_list(
        "rasters", [], "Also time each variant with these tile walks (Plan.raster names: m, n, m<B>), beside the planner's."
    )
    flags.DEFINE_string("only", "", "Time only the variants whose arm name matches this regex (e.g. 'pp_c2').")


if __name__ == "__main__":
    define_flags()
    app.run(main)
