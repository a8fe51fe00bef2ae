"""Times jax_cake ops under several builds of the native library, side by side in one process.

    python -m jax_cake.tools.compare_builds --build=before=/tmp/a/libjax_cake_ffi.so \\
        --build=after=build/lib/libjax_cake_ffi.so --family=router --points=16384:4096:256 \\
        --ops=fwd,fwd+bwd

For kernel work: build the candidate next to the current library (`python -m jax_cake.build
--out_dir=...`), then compare them in one GPU call. Each build is loaded beside the others
(`native.register_build`) with its FFI targets under its own name prefix, and its arm is
traced under `primitives.targets_from(prefix)`, so all builds run through the same planner
and Python code; only the native library differs (the planner must name variants every
build holds). Method as `jax_cake.tools.bench` (its steps program and device timer): CUPTI device
time, L2 flushed before every step, arms interleaved in paired groups, median of the group
medians. Each row also compares every build's outputs with the first build's: bitwise
equal, or the largest difference relative to the largest output.

Points are T:d_in:d_out (batched: B:T:d_in:d_out; router: T:d:E). Not the benchmark
protocol of docs/benchmarks.md (one run, one mode): a screen for changes, whose results then go
through `python -m jax_cake.tools.bench`.
"""

from __future__ import annotations

import statistics
from typing import Sequence

from absl import app, flags

from jax_cake.tools import markdown as md

FLAGS = flags.FLAGS


def parse_builds(specs: Sequence[str]) -> list[tuple[str, str]]:
    """["name=path", ...] -> [(name, path)]; names are identifiers, unique, at least two."""
    builds = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name.isidentifier() or not path:
            raise ValueError(f"--build: expected name=path with an identifier name, got {spec!r}")
        builds.append((name, path))
    names = [n for n, _ in builds]
    if len(set(names)) != len(names):
        raise ValueError(f"--build: names must be unique, got {names}")
    if len(builds) < 2:
        raise ValueError("--build: give at least two builds to compare")
    return builds


def parse_point(spec: str, family: str, out_dtype: str = "float32"):
    """A point spec -> bench.Point: T:d_in:d_out (batched B:T:d_in:d_out, router T:d:E);
    out_dtype is the dense family's w dtype (the wgrad output)."""
    from jax_cake.tools import bench

    parts = spec.split(":")
    want = 4 if family == "batched" else 3
    if len(parts) != want or not all(p.isdigit() and int(p) > 0 for p in parts):
        form = {"batched": "B:T:d_in:d_out", "router": "T:d:E"}.get(family, "T:d_in:d_out")
        raise ValueError(f"--points: expected {form} with positive integers for --family={family}, got {spec!r}")
    v = list(map(int, parts))
    if family == "batched":
        return bench.Point(v[1], v[2], v[3], "bfloat16", batch=v[0], family="batched")
    if family == "router":
        return bench.Point(v[0], v[1], v[2], "float32", family="router")
    return bench.Point(v[0], v[1], v[2], out_dtype, family="dense")


def _prefix(name: str) -> str:
    return f"{name}__"


def _compare_outputs(outs: dict) -> dict[str, str]:
    """Each arm's outputs against the first arm's (on the device): 'bitwise', or the largest
    difference relative to the largest magnitude of the first arm's output."""
    import jax
    import jax.numpy as jnp

    names = list(outs)
    first = jax.tree.leaves(outs[names[0]])
    notes = {}
    for n in names:
        pairs = list(zip(jax.tree.leaves(outs[n]), first))
        if all(bool(jnp.array_equal(a, b)) for a, b in pairs):
            notes[n] = "bitwise"
            continue
        rel = max(
            float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
            / max(float(jnp.max(jnp.abs(b.astype(jnp.float32)))), 1e-30)
            for a, b in pairs
        )
        notes[n] = f"max diff {rel:.1e}"
    return notes


def compare_row(point, op: str, builds: Sequence[tuple[str, str]], groups: int, steps: int, flush_mb: int) -> str:
    """One markdown row: each build's median step time, the first build's time over it, and
    whether its outputs equal the first build's."""
    from jax_cake import primitives
    from jax_cake.tools import bench

    buf, x, w, dy = bench.make_inputs(point, flush_mb)
    arm = bench.ArmSpec("new", "new")
    programs = {}
    for name, _ in builds:
        with primitives.targets_from(_prefix(name)):
            programs[name] = bench.compile_arm(arm, op, steps, (buf, x, w, dy), point.family)
    timer = bench.DeviceTimer(buf, steps)
    outs = {}
    for name, program in programs.items():  # warm-up, and the outputs to compare
        result = program(timer.buf, x, w, dy)
        timer.buf, outs[name] = result[0], result[1:]
    notes = _compare_outputs(outs)
    names = list(programs)
    medians = {n: [] for n in names}
    for g in range(groups):
        order = [names[(g + i) % len(names)] for i in range(len(names))]
        calls = [(lambda n: lambda b: programs[n](b, x, w, dy)[0])(n) for n in order]
        for n, times in zip(order, timer.time_calls(calls)):
            medians[n].append(statistics.median(times))
    us = {n: statistics.median(medians[n]) for n in names}
    cells = [f"{us[n]:.2f} ({us[names[0]] / us[n]:.3f}, {notes[n]})" for n in names]
    return md.row([point.label, op, *cells])


def main(argv):
    del argv
    import jax

    from jax_cake import native
    from jax_cake.tools import bench

    try:
        builds = parse_builds(FLAGS.build)
        points = [parse_point(p, FLAGS.family, FLAGS.out_dtype) for p in FLAGS.points]
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    ops = list(FLAGS.ops)
    bad = [op for op in ops if op not in bench.FAMILIES[FLAGS.family].ops]
    if bad:
        raise app.UsageError(f"--ops: {bad} not in {list(bench.FAMILIES[FLAGS.family].ops)} (--family={FLAGS.family})")
    if jax.devices()[0].platform != "gpu":
        raise app.UsageError("compare_builds needs a CUDA GPU: every build runs its own kernels")
    for name, path in builds:
        native.register_build(path, _prefix(name))
    h = bench.device_header("device")
    print(f"GPU {h['gpu']}, {h['sms']} SMs, driver {h['driver']}, jax {h['jax']}, {h['date']}; {h['timer']}")
    print("\n".join(md.table(["point", "op", *(f"{n} us (first/this, outputs)" for n, _ in builds)], [])))
    for point in points:
        for op in ops:
            print(compare_row(point, op, builds, FLAGS.groups, FLAGS.steps, FLAGS.flush_mb), flush=True)


def define_flags() -> None:
    flags.DEFINE_multi_string(
        "build", None, "name=path of a libjax_cake_ffi.so; at least two (the first is the baseline)."
    )
    flags.DEFINE_enum("family", "dense", ["dense", "router", "batched"], "Which op family the points are.")
    flags.DEFINE_list("points", None, "T:d_in:d_out (batched: B:T:d_in:d_out; router: T:d:E).")
    flags.DEFINE_list("ops", ["fwd"], "Ops of the family (as jax_cake.tools.bench).")
    flags.DEFINE_enum("out_dtype", "float32", ["float32", "bfloat16"], "dense: w's dtype (the wgrad output).")
    flags.DEFINE_integer("groups", 5, "Paired groups.")
    flags.DEFINE_integer("steps", 5, "Timed steps per arm and group.")
    flags.DEFINE_integer("flush_mb", 128, "L2 flush buffer, MiB.")
    flags.mark_flags_as_required(["build", "points"])


if __name__ == "__main__":
    define_flags()
    app.run(main)
