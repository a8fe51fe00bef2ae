"""The benchmark protocol: what `python -m benchmarks.bench` and `python -m benchmarks.tune` share.

Every family of the benchmark (benchmarks/families/) and the tuner measure this way:

- Processes. XLA reads XLA_FLAGS once, when the backend starts, so the parent never
  starts a backend: it runs one child process per (run, mode) (`run_children`), mode g =
  command buffers on (XLA's default; a training step runs as one CUDA graph) and mode e =
  `--xla_gpu_enable_command_buffer=` (eager launches); the mode order alternates between
  runs. A run is a fresh process, so process-level effects (allocation, clocks) vary
  between runs and not between the arms compared inside one.
- Arms. Inside a child the arms of a point are interleaved in paired groups
  (`paired_groups`): group g runs every arm once, the arm order rotated by g, so group g of
  one arm pairs with group g of every other. A group's time is the median of its `--steps`
  step times.
- L2 flush. One arm call is one executable holding `--steps` unrolled steps, each the step
  and then an L2 flush (XOR over a `--flush_mb` buffer, 128 MiB >= 2x the H200's 60 MB
  L2: `steps_program`), so every step, the first included, starts cold.
  optimization_barrier orders step -> flush -> step and keeps XLA from merging or hoisting
  the repeated step; in mode g the whole call is one CUDA graph.
- Timing (GPU): the CUPTI device timeline of jax's profiler (`DeviceTimer`), one profiler
  session per paired group. The flush kernels are markers: a flush-only executable is
  profiled first to learn their names and count; a step's time is first-begin to last-end
  of the device events before its flush (every kernel, memset and copy of the step and the
  gaps between them). Mode g sets `--xla_enable_command_buffers_during_profiling=true`
  (otherwise XLA runs graphs op by op while a profiler runs); children get
  TF_GPU_CUPTI_FORCE_CONCURRENT_KERNEL=1 so CUPTI does not serialize kernels. A timeline
  that does not split into the expected flushes raises, naming the kernels seen. cuBLAS
  steps (torch) are timed with CUDA events on torch's stream.
- Timing (no GPU, `--timer=wall`): host wall time per step of the whole call, flush
  included, labelled "host wall time (no GPU)": only for smoke tests of the tooling.
- Report: median over runs of each run's median group time (`run_medians`); ratio =
  baseline us / jax_cake us (above 1: jax_cake is faster).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import datetime
import functools
import glob
import gzip
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterable, Mapping, Sequence

from absl import app, flags

from benchmarks import plan_rule
from jax_cake import contract

GRID_TOKENS = (16172, 16231, 16384)
GRID_D_IN = (4096, 5120)
GRID_D_OUT = (32, 48, 64, 512, 1024, 4096)
# Where jax_cake lost most to XLA's dot, and MLA's 576 and 1536.
GRID_D_OUT_WIDE = (96, 128, 192, 224, 256, 320, 384, 576, 1536)
GRID_EXPERTS = (256,)
GRID_EXPERTS_WIDE = (8, 16, 64, 128, 256, 384)  # MoE router widths, at d = 4096 and 7168
GRIDS = {
    "default": (GRID_D_OUT, GRID_EXPERTS),
    "wide": (GRID_D_OUT_WIDE, GRID_EXPERTS_WIDE),
    "all": (tuple(sorted(GRID_D_OUT + GRID_D_OUT_WIDE)), GRID_EXPERTS_WIDE),
}
OUT_DTYPES = ("float32", "bfloat16")
# Arm kinds of the projection families: det = deterministic=True, split = the split-K
# program forced, new = the planner's pick (deterministic=False), xla = XLA's dot, cublas =
# torch.mm; the router's XLA dots at BF16_BF16_F32_X3 and HIGHEST.
ARM_KINDS = ("det", "split", "new", "xla", "cublas", "xla_x3", "xla_highest")
MODE_XLA_FLAGS = {
    "g": "--xla_enable_command_buffers_during_profiling=true",
    "e": "--xla_gpu_enable_command_buffer=",
}
WALL_LABEL = "host wall time (no GPU)"
DEVICE_LABEL = "CUPTI device time (jax profiler)"

FLAGS = flags.FLAGS
# The checkout this module lies in: child processes (child_env) import its benchmarks and jax_cake.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def define_protocol_flags() -> None:
    """The flags of the protocol (above), shared by the benchmark and the tuner."""
    flags.DEFINE_list("modes", list(plan_rule.MODES), "g = command buffers on, e = off.")
    flags.DEFINE_integer("runs", 3, "Runs (one fresh process per run and mode).")
    flags.DEFINE_integer("groups", 10, "Paired groups per run.")
    flags.DEFINE_integer("steps", 10, "Timed steps per arm and group.")
    flags.DEFINE_integer("flush_mb", 128, "L2 flush buffer, MiB (>= 2x L2).")
    flags.DEFINE_enum("timer", None, ["device", "wall"], "Default: device on a GPU, wall otherwise.")
    flags.DEFINE_string("child_out", None, "Internal: run one (run, mode) child and write its samples here.")
    flags.DEFINE_integer("run_index", 0, "Internal: the run a child measures.")


def define_grid_flags(arms_default: Sequence[str] = ()) -> None:
    """The projection grid and arm flags, shared by the benchmark and the tuner."""
    flags.DEFINE_list("tokens", [str(t) for t in GRID_TOKENS], "Token counts T.")
    flags.DEFINE_list("d_in", [str(d) for d in GRID_D_IN], "Input widths d_in.")
    flags.DEFINE_list("d_out", [str(d) for d in GRID_D_OUT], "Output widths d_out (default: --grid's).")
    flags.DEFINE_enum(
        "grid",
        "default",
        list(GRIDS),
        "Named widths where --d_out (router: --experts) is not given: default, wide (d_out 96..384, 576, "
        "1536; E 8..384), all.",
    )
    flags.DEFINE_list("out_dtype", list(OUT_DTYPES), "Weight / wgrad output dtypes.")
    flags.DEFINE_list(
        "arms",
        list(arms_default),
        "Arms: det[/tMxNxK][/pp|/tiles][/c1|/c2][/rR], split[/sN][/tMxNxK][/pp|/tiles][/c1|/c2][/rR], new, "
        "xla[/path], cublas (projection families; each family names its own).",
    )


# --- what is measured ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Point:
    tokens: int
    d_in: int
    d_out: int
    out: str  # w's dtype = the wgrad output dtype
    batch: int = 1  # B of the batched family
    family: str = "dense"  # d_in = d and d_out = E for the router

    @property
    def label(self) -> str:
        family = {"dense": "", "router": "router ", "batched": f"batched B={self.batch} "}[self.family]
        return f"{family}T={self.tokens} {self.d_in}->{self.d_out} {self.out}"


def grid_points(
    tokens: Iterable[int], d_in: Iterable[int], d_out: Iterable[int], out: Iterable[str], family: str = "dense"
) -> list[Point]:
    tokens, d_out, out = list(tokens), list(d_out), list(out)  # iterated once per outer value
    return [Point(t, i, o, dt, family=family) for i in d_in for o in d_out for dt in out for t in tokens]


def parse_pairs(pairs: Iterable[str]) -> list[tuple[int, int]]:
    """d_in:d_out strings -> (d_in, d_out) pairs (--pairs)."""
    out = []
    for p in pairs:
        d_in, sep, d_out = p.partition(":")
        if not sep or not d_in.isdigit() or not d_out.isdigit():
            raise ValueError(f"--pairs: {p!r} is not d_in:d_out")
        out.append((int(d_in), int(d_out)))
    return out


@dataclasses.dataclass(frozen=True)
class Report:
    """A family's table: the markdown (its header line first) and the CSV's columns and rows;
    `failed` names what failed a check (the command then exits 1)."""

    text: str
    columns: Sequence[str]
    rows: Sequence[dict]
    failed: str = ""


@dataclasses.dataclass(frozen=True)
class Family:
    """One `--family` of `python -m benchmarks.bench` (benchmarks/families/)."""

    name: str
    about: str  # one line: what it measures
    reads: tuple[str, ...]  # the flags it reads beyond the protocol's
    defaults: Mapping[str, object]  # its values of flags not given on the command line
    child: Callable[[str, int, str], list[dict]]  # (mode, run, timer kind) -> this process's samples
    report: Callable[[dict, Sequence[dict]], Report]  # (header, every child's samples) -> the table
    check: Callable[[], None] = lambda: None  # validates the flags (app.UsageError)
    parent: Callable[[Sequence[str], Sequence[str]], tuple[dict, list[dict]]] | None = None  # (argv, modes)
    merge: Callable[[Sequence[str]], Report] | None = None  # one table over earlier runs' CSVs


@dataclasses.dataclass(frozen=True)
class ArmSpec:
    """An arm name parsed: one of ARM_KINDS, options only on
    'split[/sN][/tMxNxK][/pp|/tiles][/c1|/c2][/rR]' and 'det[/tMxNxK][/pp|/tiles][/c1|/c2][/rR]'
    (tMxNxK: the wgrad tile; pp / tiles: fwd and dgrad forced onto the ping-pong variants,
    or onto the cooperative tiles where the planner would pick ping-pong; c1 / c2: fwd and
    dgrad CTA clusters (1, 1) / (2, 1) where the library holds them; rR: the tile walk R,
    m, n or m<B>, Plan.raster)."""

    name: str
    kind: str
    splits: int | None = None
    tile: tuple[int, int, int] | None = None
    schedule: str | None = None
    cluster: tuple[int, int] | None = None
    raster: str | None = None
    path: bool = False  # xla/path: jax_cake's own XLA path (the op under planner.force("xla"))


def parse_arm(name: str) -> ArmSpec:
    kind, *opts = name.split("/")
    if kind == "xla" and opts == ["path"]:
        return ArmSpec(name, kind, path=True)
    if kind not in ARM_KINDS or (opts and kind not in ("split", "det")):
        raise ValueError(f"arm {name!r}: expected one of {ARM_KINDS}, options only on split and det (and xla/path)")
    splits = tile = schedule = cluster = raster = None
    for opt in opts:
        if opt in ("pp", "tiles"):
            schedule = {"pp": "pingpong", "tiles": "tiles"}[opt]
        elif opt in ("c1", "c2"):
            cluster = (int(opt[1]), 1)
        elif kind == "split" and re.fullmatch(r"s\d+", opt):
            splits = int(opt[1:])
        elif re.fullmatch(r"t\d+x\d+x\d+", opt):
            tile = tuple(int(v) for v in opt[1:].split("x"))
        elif re.fullmatch(r"r(m|n|m[1-9]\d*)", opt):
            raster = opt[1:]
            contract.raster_code(raster)
        else:
            raise ValueError(
                f"arm {name!r}: option {opt!r} is none of sN (splits; split only), tMxNxK (wgrad tile), "
                "pp, tiles, c1, c2, rm, rn, rm<B>"
            )
    return ArmSpec(name, kind, splits, tile, schedule, cluster, raster)


def split_arm_name(splits: int | None, tile: Sequence[int] | None) -> str:
    return "split" + (f"/s{splits}" if splits else "") + (f"/t{'x'.join(map(str, tile))}" if tile else "")


# --- one step of each op, per arm ----------------------------------------------------------


# The ops op_fn times, in the order the projection families report them.
ALL_OPS = ("fwd", "dgrad", "wgrad", "bwd", "fwd+bwd", "2fwd+bwd")


def op_fn(op: str, project: Callable) -> Callable:
    """(x, w, dy) -> the op's outputs, built from a projection y = project(x, w).

    jax.vjp against only the differentiated inputs lets XLA drop the unused gradient's
    GEMM and the unused forward. fwd+bwd is the value and both gradients. 2fwd+bwd is
    the checkpointed step written out: the step's forward, and the backward's
    recomputed forward (kept apart from the first by a barrier, as a remat recompute
    is) next to dgrad and wgrad.
    """
    import jax

    if op == "fwd":
        return lambda x, w, dy: (project(x, w),)
    if op == "dgrad":
        return lambda x, w, dy: jax.vjp(lambda x_: project(x_, w), x)[1](dy)
    if op == "wgrad":
        return lambda x, w, dy: jax.vjp(lambda w_: project(x, w_), w)[1](dy)
    if op == "bwd":
        return lambda x, w, dy: jax.vjp(project, x, w)[1](dy)
    if op == "fwd+bwd":

        def value_and_grads(x, w, dy):
            y, vjp = jax.vjp(project, x, w)
            return (y,) + vjp(dy)

        return value_and_grads
    if op == "2fwd+bwd":

        def step(x, w, dy):
            y = project(x, w)
            x2, w2, _ = jax.lax.optimization_barrier((x, w, y))
            return (y, project(x2, w2)) + jax.vjp(project, x2, w2)[1](dy)

        return step
    raise ValueError(f"op {op!r}: expected one of {ALL_OPS}")



@contextlib.contextmanager
def planning_for(arm: ArmSpec):
    """The planner state an arm is traced under (det and split force their wgrad program,
    so a plan table's xla rows never replace the kernels they time; pp / tiles the
    fwd/dgrad schedule, c1 / c2 their CTA pairing; xla/path the XLA path)."""
    if arm.kind not in ("det", "split") and not arm.path:
        yield
        return
    from jax_cake import planner

    if arm.path:
        with planner.force("xla"):
            yield
        return
    with planner.force(
        arm.kind, splits=arm.splits, tile=arm.tile, schedule=arm.schedule, cluster=arm.cluster, raster=arm.raster
    ):
        yield


def flush_buffer(flush_mb: int):
    """The L2-flush buffer that flush() rewrites: `flush_mb` MiB of uint32 zeros."""
    import jax.numpy as jnp

    return jnp.zeros((flush_mb * 2**20 // 4,), jnp.uint32)


def flush(buf):
    """Rewrites the whole L2-flush buffer (read + write, so L2 holds none of x, w, dy)."""
    import jax.numpy as jnp

    return buf ^ jnp.uint32(0x9E3779B9)


# The oldest jax whose XLA keeps repeated identical steps apart across optimization
# barriers: jaxlib 0.10.2's compiler merged three identical dots between barriers into one
# (seen on CPU, 2026-12-06), so a steps program there would time fewer steps than it names.
STEPS_KEPT_SINCE = (0, 11)


def require_steps_kept() -> None:
    """Refuses to time on a GPU with a jax older than STEPS_KEPT_SINCE (CPU runs, the
    tests' smoke runs, go on: nothing is timed there)."""
    import jax

    if jax.__version_info__ < STEPS_KEPT_SINCE and jax.default_backend() == "gpu":
        raise RuntimeError(
            f"the benchmarks need jax >= {'.'.join(map(str, STEPS_KEPT_SINCE))} to time on a GPU "
            f"(this is {jax.__version__}, whose XLA merges the repeated steps of a timed program)"
        )


def steps_program(step: Callable | None, steps: int) -> Callable:
    """(buf, x, w, dy) -> (buf, every step's outputs): `steps` x (step, flush).

    The op comes first: the flush that ends the previous call (or the warm-up) left L2
    cold, and a busy kernel enqueued right after dispatch meets the op, not a flush
    (tune's op_first). step=None gives the flush-only program (marker calibration).
    The barriers order flush -> step -> flush (XLA keeps the order as control
    dependencies) and give every step its own operands, so XLA cannot CSE the repeated
    steps. Every step's outputs are returned: XLA drops unused barrier results, and
    with them the step.
    """
    import jax

    require_steps_kept()

    def program(buf, x, w, dy):
        outs = []
        for _ in range(steps):
            buf, x, w, dy = jax.lax.optimization_barrier((buf, x, w, dy))
            if step is not None:
                buf, out = jax.lax.optimization_barrier((buf, step(x, w, dy)))
                outs.append(out)
            buf = flush(buf)
        return buf, outs

    return program


def compile_arm(arm: ArmSpec, op: str, steps: int, args, project: Callable) -> Callable:
    """AOT-compiles the arm's steps program (jit's cache would ignore planner.force);
    project(arm) -> (x, w) -> y is the family's forward."""
    import jax

    with planning_for(arm):
        program = steps_program(op_fn(op, project(arm)), steps)
        return jax.jit(program, donate_argnums=0).lower(*args).compile()


def make_inputs(point: Point, flush_mb: int, seed: int = 0):
    import jax
    import jax.numpy as jnp

    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    lead = (point.batch,) if point.family == "batched" else ()
    act = jnp.float32 if point.family == "router" else jnp.bfloat16  # x and dy
    x = jax.random.normal(kx, lead + (point.tokens, point.d_in), act)
    w = (jax.random.normal(kw, lead + (point.d_out, point.d_in), jnp.float32) * 0.02).astype(point.out)
    dy = jax.random.normal(kd, lead + (point.tokens, point.d_out), act)
    return flush_buffer(flush_mb), x, w, dy


# --- output error ---------------------------------------------------------------------------

ERROR_OPS = ("fwd", "dgrad", "wgrad")  # the single-GEMM ops whose output error tune measures
ERROR_ROWS = 4096  # at most this many output rows, evenly spaced, enter the error
# A jax_cake arm's BF16 output against the xla arm's, max |arm - xla| / max |xla| (the core and
# gated families): both are BF16 roundings of FP32 sums over K.
XLA_MATCH_REL_TOL = 2.0**-6


def error_stride(rows: int) -> int:
    """The stride of the output rows the error is measured on: every row up to ERROR_ROWS,
    else evenly spaced ones (fwd / dgrad at T = 16384: every 4th token; wgrad: d_out rows)."""
    return max(1, math.ceil(rows / ERROR_ROWS))


def _rel_err64(op: str, stride: int, x, w, dy, out):
    import jax
    import jax.numpy as jnp

    f64, hi = jnp.float64, jax.lax.Precision.HIGHEST
    wb = w.astype(jnp.bfloat16).astype(f64)  # fwd and dgrad run on w rounded to BF16
    if op == "fwd":
        ref = jnp.matmul(x[::stride].astype(f64), wb.T, precision=hi)
    elif op == "dgrad":
        ref = jnp.matmul(dy[::stride].astype(f64), wb, precision=hi)
    else:
        ref = jnp.matmul(dy[:, ::stride].astype(f64).T, x.astype(f64), precision=hi)
    o = out[::stride].astype(f64)
    err = jnp.linalg.norm((o - ref).ravel()) / jnp.maximum(jnp.linalg.norm(ref.ravel()), 1e-300)
    return jnp.where(jnp.all(jnp.isfinite(o)), err, jnp.inf)


@functools.cache
def _rel_err64_jit():
    import jax

    return jax.jit(_rel_err64, static_argnums=(0, 1))


def output_error(op: str, x, w, dy, out) -> float:
    """||out - ref|| / ||ref|| of one dense op's output (fwd: y [T, d_out]; dgrad: dx
    [T, d_in]; wgrad: dw [d_out, d_in]) against float64 from the same BF16 operands (x and
    dy; w rounded to BF16 for fwd and dgrad, as the op rounds it), on the output rows of
    `error_stride`; inf where out holds a NaN or Inf. The tuner's condition (d)."""
    import jax

    if op not in ERROR_OPS:
        raise ValueError(f"output_error: op {op!r} is not one of {ERROR_OPS}")
    with jax.enable_x64(True):
        return float(_rel_err64_jit()(op, error_stride(out.shape[0]), x, w, dy, out))


# --- timers ---------------------------------------------------------------------------------

BUSY_KERNEL_TAG = "jax_cake_busy"  # tune's SM-holding kernel: not part of any step


def base_kernel_name(name: str) -> str:
    """Kernel name without XLA's numeric suffixes (loop_xor_fusion_1 -> loop_xor_fusion)."""
    return re.sub(r"([._]\d+)+$", "", name)


def device_events(xspace: bytes) -> tuple[list, list]:
    """(start_ns, end_ns, name) of the GPU stream events in a profile, by start time:
    (everything else, tune's busy kernels)."""
    from jax.profiler import ProfileData

    events = []
    for plane in ProfileData.from_serialized_xspace(xspace).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "Stream" not in line.name:  # skip derived lines (XLA Ops, Modules) that repeat kernels
                continue
            events += [(e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events]
    events.sort()
    return ([e for e in events if BUSY_KERNEL_TAG not in e[2]], [e for e in events if BUSY_KERNEL_TAG in e[2]])


def step_spans(
    events, markers: set[str], calls: int, steps: int, kernels_per_flush: int = 1
) -> list[list[tuple[int, int]]]:
    """Per call, each step's (first begin, last end) in ns: the events up to its flush.

    The profile starts on an idle GPU with the first call's first step; every
    `kernels_per_flush` marker events make one flush, and each call brings `steps`.
    """
    spans, current, pending = [], None, 0
    for start, end, name in events:
        if base_kernel_name(name) in markers:
            pending += 1
            if pending == kernels_per_flush:
                spans.append(current)
                current, pending = None, 0
        else:
            current = (start, end) if current is None else (min(current[0], start), max(current[1], end))
    if len(spans) != calls * steps:
        names = sorted({base_kernel_name(n) for _, _, n in events})
        raise RuntimeError(
            f"device timer: found {len(spans)} flushes, expected {calls * steps} "
            f"({calls} calls x {steps} steps); markers {sorted(markers)}, kernels seen {names}"
        )
    if None in spans:
        raise RuntimeError("device timer: a step with no device events before its flush (was the op dropped?)")
    return [spans[c * steps : (c + 1) * steps] for c in range(calls)]


def kernel_breakdown(events, markers: set[str], steps: int) -> list[dict]:
    """What the GPU ran in `steps` steps, per kernel name without XLA's numeric suffixes:
    launches and device time per step (`us`), most time first; the flush kernels (`markers`)
    are left out. Kernels that overlap count in full, so the sum can exceed a step's span."""
    totals: dict[str, list[int]] = {}
    for start, end, name in events:
        base = base_kernel_name(name)
        if base not in markers:
            launches_ns = totals.setdefault(base, [0, 0])
            launches_ns[0] += 1
            launches_ns[1] += end - start
    rows = [{"kernel": k, "launches": n / steps, "us": ns / 1e3 / steps} for k, (n, ns) in totals.items()]
    return sorted(rows, key=lambda r: (-r["us"], r["kernel"]))


def top_kernels(rows: Sequence[dict], n: int) -> list[dict]:
    """The first n rows of a kernel_breakdown, then one "(the other k kernels)" row summing the rest."""
    rest = rows[n:]
    if not rest:
        return list(rows)
    other = {"kernel": f"(the other {len(rest)} kernels)", "launches": sum(r["launches"] for r in rest)}
    return [*rows[:n], dict(other, us=sum(r["us"] for r in rest))]


_markers_cache: dict[tuple[int, int], tuple[set[str], int]] = {}  # (names, kernels per flush)


class ProfileSession:
    """A CUPTI trace through the public `jax.profiler` API: start_trace into a private
    directory, stop_trace, then the serialized XSpace it wrote (for `device_events`)."""

    def __init__(self):
        import jax

        self._dir = tempfile.mkdtemp(prefix="jax_cake_profile_")
        jax.profiler.start_trace(self._dir)

    def stop(self) -> bytes:
        import jax

        jax.profiler.stop_trace()
        try:
            (path,) = glob.glob(os.path.join(self._dir, "**", "*.xplane.pb"), recursive=True)
            with open(path, "rb") as f:
                return f.read()
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)


class DeviceTimer:
    """Times jax calls from the CUPTI timeline: profile a batch of calls, then split it."""

    def __init__(self, buf, steps: int):
        import jax

        self.buf, self.steps = buf, steps
        key = (buf.size, steps)
        if key not in _markers_cache:  # learn the flush kernels from a flush-only call
            flush_only = jax.jit(steps_program(None, steps), donate_argnums=0).lower(buf, None, None, None).compile()
            self.buf = flush_only(self.buf, None, None, None)[0].block_until_ready()
            session = ProfileSession()
            self.buf = flush_only(self.buf, None, None, None)[0].block_until_ready()
            events = device_events(session.stop())[0]
            if not events or len(events) % steps:
                raise RuntimeError(
                    f"device timer: {len(events)} GPU events for {steps} flushes "
                    "(none: is another CUPTI client such as nsys attached?)"
                )
            _markers_cache[key] = ({base_kernel_name(n) for _, _, n in events}, len(events) // steps)
        self.markers, self.kernels_per_flush = _markers_cache[key]

    def time_calls(self, calls: Sequence[Callable], keep: Callable | None = None) -> list[list[float]]:
        """Runs each call(buf) -> buf in order; returns each call's step times in us.

        keep(step_span, busy_spans) -> bool drops the steps it rejects (tune's contention).
        """
        session = ProfileSession()
        for call in calls:
            self.buf = call(self.buf)
            self.buf.block_until_ready()
        events, busy = device_events(session.stop())
        busy_spans = [(b, e) for b, e, _ in busy]
        return [
            [(e - b) / 1e3 for b, e in call if keep is None or keep((b, e), busy_spans)]
            for call in step_spans(events, self.markers, len(calls), self.steps, self.kernels_per_flush)
        ]

    def kernels(self, call: Callable) -> list[dict]:
        """The kernel_breakdown of one call(buf) -> buf (its `steps` steps)."""
        session = ProfileSession()
        self.buf = call(self.buf)
        self.buf.block_until_ready()
        return kernel_breakdown(device_events(session.stop())[0], self.markers, self.steps)


class WallTimer:
    """Host wall time per step of each call, flush included: for runs without a GPU."""

    def __init__(self, buf, steps: int):
        self.buf, self.steps = buf, steps

    def time_calls(self, calls: Sequence[Callable], keep: Callable | None = None) -> list[list[float]]:
        if keep is not None:
            raise ValueError("step filters need the device timeline (--timer=device)")
        out = []
        for call in calls:
            t0 = time.perf_counter()
            self.buf = call(self.buf)
            self.buf.block_until_ready()
            out.append([(time.perf_counter() - t0) * 1e6 / self.steps] * self.steps)
        return out

    def kernels(self, call: Callable) -> None:
        """No kernel breakdown without the device timeline."""
        return None


def cublas_group_times(op: str, point: Point, steps: int, groups: int, flush_mb: int) -> list[float] | None:
    """Median step time per group of torch.mm (torch.bmm for the batched family) with
    CUDA events, L2 flushed per step; None without a CUDA torch."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    g = torch.Generator(device="cuda").manual_seed(0)
    lead, mm = ((point.batch,), torch.bmm) if point.family == "batched" else ((), torch.mm)
    x, w, dy = (
        torch.randn(*lead, *shape, device="cuda", dtype=torch.bfloat16, generator=g)
        for shape in ((point.tokens, point.d_in), (point.d_out, point.d_in), (point.tokens, point.d_out))
    )
    buf = torch.zeros(flush_mb * 2**20 // 4, device="cuda", dtype=torch.int32)

    def wgrad():
        if point.out == "float32":  # fp32 out from the fp32 accumulator, no bf16 rounding
            return mm(dy.mT, x, out_dtype=torch.float32)
        return mm(dy.mT, x)

    try:
        wgrad()
    except (TypeError, RuntimeError) as e:  # a torch without mm(out_dtype=): no fp32 cuBLAS baseline
        print(f"cuBLAS arm skipped: {e}", file=sys.stderr)
        return None

    parts = {"fwd": [lambda: mm(x, w.mT)], "dgrad": [lambda: mm(dy, w)], "wgrad": [wgrad]}
    parts["bwd"] = parts["dgrad"] + parts["wgrad"]
    parts["2fwd+bwd"] = parts["fwd"] * 2 + parts["bwd"]
    out = []
    for _ in range(groups + 1):  # the first group warms up cuBLAS
        times = []
        for _ in range(steps):
            buf.bitwise_xor_(0x1E3779B9)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for part in parts[op]:
                part()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        out.append(statistics.median(times))
    return out[1:]


# --- a child: one (run, mode) -----------------------------------------------------------------


_compiled: dict[tuple, Callable] = {}


def clear_compiled() -> None:
    """Drops the executables measure_point kept (a caller that moves on to other points
    frees their device memory)."""
    _compiled.clear()


def measure_point(
    point: Point,
    op: str,
    arms: Sequence[ArmSpec],
    project: Callable,
    timer_kind: str,
    steps: int,
    groups: int,
    flush_mb: int,
    around_call: Callable = contextlib.nullcontext,
    keep: Callable | None = None,
    errors: dict | None = None,
) -> dict[str, list[float | None]]:
    """{arm name: per-group median step time in us} for one point and op; project(arm) ->
    (x, w) -> y is the family's forward (families/dense.py's `projection`, ...).

    around_call(): a context manager entered around each arm call; keep: a step filter
    (both for tune's busy kernel). A group none of whose steps was kept is None. errors:
    a dict to fill with {jax arm: output_error of the warm-up call's first step} (dense
    fwd, dgrad and wgrad; the timed steps run the same program on the same inputs).
    """
    import jax

    buf, x, w, dy = make_inputs(point, flush_mb)
    jax_arms = [a for a in arms if a.kind != "cublas"]
    compiled = {}
    for a in jax_arms:  # tune measures a point again per contention cell: compile once
        key = (a, op, steps, point, flush_mb, project)
        if key not in _compiled:
            _compiled[key] = compile_arm(a, op, steps, (buf, x, w, dy), project)
        compiled[a.name] = _compiled[key]
    timer = make_timer(timer_kind, buf, steps)
    for a in jax_arms:  # warm-up: graph instantiation, autotuning, lazy loading
        timer.buf, outs = compiled[a.name](timer.buf, x, w, dy)
        if errors is not None and op in ERROR_OPS and point.family == "dense":
            errors[a.name] = output_error(op, x, w, dy, outs[0][0])
        del outs
    jax.block_until_ready(timer.buf)

    def call(name):
        def run(buf):
            with around_call():
                return compiled[name](buf, x, w, dy)[0]

        return run

    groups_out = paired_groups(timer, {a.name: call(a.name) for a in jax_arms}, groups, keep)
    if any(a.kind == "cublas" for a in arms):
        times = cublas_group_times(op, point, steps, groups, flush_mb)
        if times is not None:
            groups_out["cublas"] = times
    return groups_out


def first_line(e: BaseException) -> str:
    """An exception as a table's status cell: its type and its message's first line."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def make_timer(timer_kind: str, buf, steps: int):
    """The timer of --timer: the CUPTI device timeline ("device") or host wall time."""
    return DeviceTimer(buf, steps) if timer_kind == "device" else WallTimer(buf, steps)


def paired_groups(timer, calls: dict[str, Callable], groups: int, keep: Callable | None = None) -> dict:
    """{name: per-group median step time in us} of calls[name](buf) -> buf (warmed up).

    Group g runs every call once, the order rotated by g, in one timer batch, so group g
    of one call pairs with group g of every other. A group none of whose steps was kept
    is None.
    """
    names = list(calls)
    out = {name: [] for name in names}
    for g in range(groups):
        order = [names[(g + i) % len(names)] for i in range(len(names))]
        for name, times in zip(order, timer.time_calls([calls[n] for n in order], keep)):
            out[name].append(statistics.median(times) if times else None)
    return out


def geomean_lines(rows: Sequence[dict], ops: Sequence[str], ratio_columns: Callable) -> list[str]:
    """Markdown lines "- op mode (n rows): column geomean (min to max); ..." per op and timing
    mode, over the ratio columns `ratio_columns(picked rows)` names (rows without a value
    are left out)."""
    lines = []
    for op in ops:
        for mode in plan_rule.MODES:
            picked = [r for r in rows if r["op"] == op and r["mode"] == mode]
            parts = []
            for column in ratio_columns(picked):
                vals = [r[column] for r in picked if r.get(column)]
                if vals:
                    gm = math.exp(sum(math.log(v) for v in vals) / len(vals))
                    parts.append(f"{column} {gm:.3f} ({min(vals):.3f} to {max(vals):.3f})")
            if parts:
                lines.append(f"- {op} {mode} ({len(picked)} rows): " + "; ".join(parts))
    return lines


def measure_arms(
    programs: dict[str, Callable], buf, args: Sequence, timer_kind: str, steps: int, groups: int
) -> dict[str, list[float]]:
    """{arm: per-group median step time in us} of programs[arm](buf, *args) -> (buf, ...),
    each compiled with buf donated and warmed up, the arms interleaved in paired groups
    (the families whose arms are whole step programs: residual, accumulate, gated)."""
    import jax

    compiled = {arm: jax.jit(p, donate_argnums=0).lower(buf, *args).compile() for arm, p in programs.items()}
    timer = make_timer(timer_kind, buf, steps)
    for program in compiled.values():  # warm-up
        timer.buf = program(timer.buf, *args)[0]
    jax.block_until_ready(timer.buf)

    def call(program):
        return lambda b: program(b, *args)[0]

    return paired_groups(timer, {arm: call(p) for arm, p in compiled.items()}, groups)

def device_header(timer_kind: str) -> dict:
    import jax

    dev = jax.devices()[0]
    driver = "n/a"
    if dev.platform == "gpu":
        try:
            driver = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                .stdout.split("\n")[0]
                .strip()
                or "unknown"
            )
        except (OSError, subprocess.SubprocessError):
            driver = "unknown"
    return {
        "gpu": dev.device_kind.replace("NVIDIA ", "") if dev.platform == "gpu" else f"none ({dev.platform})",
        "sms": getattr(dev, "core_count", None),
        "compute_capability": getattr(dev, "compute_capability", None),
        "driver": driver,
        "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "timer": DEVICE_LABEL if timer_kind == "device" else WALL_LABEL,
    }


def default_timer() -> str:
    import jax

    return "device" if jax.devices()[0].platform == "gpu" else "wall"


def collect(
    points: Sequence[Point],
    ops: Sequence[str],
    arms: Sequence[ArmSpec],
    project: Callable,
    mode: str,
    run: int,
    *,
    steps: int,
    groups: int,
    flush_mb: int,
    timer_kind: str,
    tags: dict | None = None,
    around_call: Callable = contextlib.nullcontext,
    keep: Callable | None = None,
    errors: bool = False,
) -> list[dict]:
    """Samples for every point x op in this process: one dict per arm with its groups.

    project: as measure_point's. tags are copied into every sample (tune's contention cell: busy SMs, launch order).
    errors: each sample of a dense fwd, dgrad or wgrad also gets "rel_err", its arm's
    output_error (None for an arm without one, e.g. cuBLAS).
    """
    samples, total, t0 = [], len(points) * len(ops), time.time()
    for i, (point, op) in enumerate((p, o) for p in points for o in ops):
        print(
            f"[{mode} run {run}] {i + 1}/{total} {point.label} {op} {tags or ''} {time.time() - t0:.0f}s",
            file=sys.stderr,
            flush=True,
        )
        errs = {} if errors and op in ERROR_OPS and point.family == "dense" else None
        for arm, groups_us in measure_point(
            point, op, arms, project, timer_kind, steps, groups, flush_mb, around_call, keep, errs
        ).items():
            samples.append(
                {
                    **dataclasses.asdict(point),
                    **(tags or {}),
                    "op": op,
                    "mode": mode,
                    "run": run,
                    "arm": arm,
                    "groups_us": groups_us,
                    **({"rel_err": errs.get(arm)} if errs is not None else {}),
                }
            )
    return samples


def write_child_output(path: str, header: dict, samples: Sequence[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"header": header, "samples": list(samples)}, f)


def child_env(**overrides: str) -> dict[str, str]:
    """This process's environment plus `overrides`, with REPO_ROOT first on PYTHONPATH: a
    child `python -m benchmarks...` imports this checkout's benchmarks and jax_cake, not an
    installed jax_cake."""
    env = dict(os.environ, **overrides)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    return env


def run_children(module: str, argv_flags: Sequence[str], modes: Sequence[str], runs: int) -> tuple[dict, list[dict]]:
    """Runs `python -m module --child_out=...` per (run, mode); returns header and samples."""
    header, samples = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(runs):
            for mode in modes if run % 2 == 0 else list(reversed(modes)):
                out = os.path.join(tmp, f"{mode}_{run}.json")
                env = child_env()
                env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {MODE_XLA_FLAGS[mode]}".strip()
                # CUPTI's serial KERNEL activity kind (some XLA versions' default) would serialize
                # kernels of different streams: tune's busy kernel could never overlap the op.
                env["TF_GPU_CUPTI_FORCE_CONCURRENT_KERNEL"] = "1"
                cmd = [
                    sys.executable,
                    "-m",
                    module,
                    *argv_flags,
                    f"--modes={mode}",
                    f"--run_index={run}",
                    f"--child_out={out}",
                ]
                subprocess.run(cmd, env=env, check=True)
                with open(out) as f:
                    data = json.load(f)
                header = data["header"]
                samples.extend(data["samples"])
    return header, samples


# --- report -------------------------------------------------------------------------------------


def run_medians(samples: Sequence[dict]) -> dict[tuple, float]:
    """{(point, op, mode, arm): median over runs of each run's median group time}."""
    per_run: dict[tuple, list[float]] = {}
    names = [f.name for f in dataclasses.fields(Point)]
    for s in samples:
        key = (Point(**{n: s[n] for n in names if n in s}), s["op"], s["mode"], s["arm"])
        per_run.setdefault(key, []).append(statistics.median(g for g in s["groups_us"] if g is not None))
    return {k: statistics.median(v) for k, v in per_run.items()}


def header_line(header: dict) -> str:
    """The first line of a table: the device, the software, the date and how it was timed."""
    return (
        f"GPU {header['gpu']}, {header['sms'] or 'n/a'} SMs, driver {header['driver']}, jax {header['jax']}, "
        f"{header['date']}; latencies: {header['timer']}, us, median over runs of per-run median group times; "
        "ratios = baseline us / new us (above 1: new is faster)"
    )


def parse_csv_value(v: str):
    """A CSV cell as write_csv wrote it: "" -> None, else an int, a float or the string."""
    if v == "":
        return None
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def read_csv_rows(paths: Sequence[str]) -> list[dict]:
    """The rows of CSV files written by --csv, in file order, numbers parsed back (`.gz`
    files are decompressed)."""
    rows = []
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", newline="") as f:
            rows += [{k: parse_csv_value(v) for k, v in r.items()} for r in csv.DictReader(f)]
    return rows


def write_csv(path: str, columns: Sequence[str], rows: Sequence[dict]) -> None:
    """The rows under `columns`, None as an empty cell."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({c: "" if r.get(c) is None else r[c] for c in columns})


def selected(argv_name: str, allowed: Sequence[str]) -> list[str]:
    values = list(getattr(FLAGS, argv_name))
    bad = [v for v in values if v not in allowed]
    if bad:
        raise app.UsageError(f"--{argv_name}: {bad} not in {list(allowed)}")
    return values


def child_argv(names: Iterable[str]) -> list[str]:
    """The parent's flag values for a child, as --name=value."""
    out = []
    for name in names:
        value = getattr(FLAGS, name)
        if value is not None:
            out.append(f"--{name}={','.join(map(str, value)) if isinstance(value, list) else value}")
    return out
