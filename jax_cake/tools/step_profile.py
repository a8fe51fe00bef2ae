"""Where a training step's device time goes: the kernels of one model_bench step, per arm.

    python -m jax_cake.tools.step_profile --case=mlp --md=out/mlp_profile.md
    python -m jax_cake.tools.step_profile --case=block --arms=xla,jax_cake --steps=5
    python -m jax_cake.tools.step_profile --case=mlp --timeline --gate_grad_epilogue
    python -m jax_cake.tools.step_profile --case=mlp --timeline \
        --pin=dgrad:8192:14336:4096=det/t128x192x64/pp/c2 --pin=fwd:8192:28672:4096=xla

Each arm's step (jax_cake.tools.model_bench's case, the same inputs and arms) is jitted
and warmed up, then `--steps` steps run under one CUPTI trace (the public jax.profiler
API). Every kernel's time is its median over the steps of its summed duration in a step
(a kernel name with XLA's numeric suffix dropped, e.g. loop_fusion_3 -> loop_fusion,
counts once per launch; jax_cake's CuTe DSL kernels share one truncated name, so they are
one row). The table lists, per arm, the kernels by time, the share of
the step, and the step's total kernel time (the sum, not the wall span: kernels on one
stream run one after another); `--timeline` adds one step's launches in launch order,
where the position tells jax_cake's kernels apart. `--pin` adds arms that run one GEMM of
the step on a chosen variant, or on XLA's path (`=xla`), through `planner.force(gemm=...)`:
a variant judged in the step's own conditions, which an isolated GEMM benchmark does not
reproduce (the step's memory-bound passes leave the GPU below its power cap, so its GEMMs
run at higher clocks than back-to-back calls: docs/benchmarks.md). Command buffers stay
on while profiling (XLA's default graph mode). Needs a GPU: a CPU has no device timeline.
"""

from __future__ import annotations

import collections
import os
import statistics
from typing import Sequence

from absl import app, flags

from jax_cake import planner
from jax_cake.planner import gated as gated_planner
from jax_cake.tools import bench, model_bench
from jax_cake.tools import markdown as md

FLAGS = flags.FLAGS
_ENV = {"XLA_FLAGS": "--xla_enable_command_buffers_during_profiling=true"}


# The CuTe DSL names every exported kernel after its Python object and cuts the name at the
# same length, so all of jax_cake's GEMM variants carry one name in the trace.
_DSL_PREFIX = "kernel_cutlass_kernel_jax_cake"
DSL_KERNELS = "jax_cake GEMMs (every CuTe DSL variant)"


def display_name(name: str) -> str:
    """The row a kernel is counted under: its base name, or DSL_KERNELS for jax_cake's."""
    return DSL_KERNELS if name.startswith(_DSL_PREFIX) else bench.base_kernel_name(name)


def _steps(events: Sequence[tuple[int, int, str]], steps: int) -> list[Sequence[tuple[int, int, str]]]:
    """The events of `steps` identical steps, in time order, split evenly into the steps
    (each step launches the same kernels)."""
    if steps < 1 or len(events) % steps:
        raise ValueError(f"{len(events)} kernel events do not split into {steps} identical steps")
    per = len(events) // steps
    return [events[s * per : (s + 1) * per] for s in range(steps)]


def kernel_times(events: Sequence[tuple[int, int, str]], steps: int) -> dict[str, float]:
    """{kernel base name: median over steps of its summed us per step} from the trace's
    (start_ns, end_ns, name) events of `steps` identical steps, in time order. The events
    split into steps evenly (each step launches the same kernels)."""
    totals = []
    for launches in _steps(events, steps):
        step = collections.Counter()
        for start, end, name in launches:
            step[display_name(name)] += (end - start) / 1e3
        totals.append(step)
    names = sorted(set().union(*totals))
    return {n: statistics.median(t.get(n, 0.0) for t in totals) for n in names}


def kernel_timeline(events: Sequence[tuple[int, int, str]], steps: int) -> list[tuple[str, float]]:
    """[(kernel row name, median us over steps)] of one step's launches in launch order,
    from the trace's events of `steps` identical steps: the order tells apart the CuTe DSL
    kernels that share one name."""
    per_step = _steps(events, steps)
    return [
        (display_name(name), statistics.median((step[i][1] - step[i][0]) / 1e3 for step in per_step))
        for i, (_, _, name) in enumerate(per_step[0])
    ]


def timeline_table(timelines: dict[str, list[tuple[str, float]]], min_us: float) -> str:
    """Per arm, one step's launches of at least min_us in launch order (the rest summed)."""
    lines = []
    for arm, launches in timelines.items():
        rows = [[str(i), f"`{name}`", f"{us:.1f}"] for i, (name, us) in enumerate(launches) if us >= min_us]
        small = [us for _, us in launches if us < min_us]
        if small:
            rows.append(["", f"({len(small)} launches under {min_us:g} us)", f"{sum(small):.1f}"])
        lines += [f"**{arm}**, launch order:", "", *md.table(["#", "kernel", "us"], rows), ""]
    return "\n".join(lines)


def table(profiles: dict[str, dict[str, float]], top: int) -> str:
    lines = []
    for arm, times in profiles.items():
        total = sum(times.values())
        ranked = sorted(times.items(), key=lambda kv: -kv[1])
        rows = [[f"`{name}`", f"{us:.1f}", f"{us / total:.1%}"] for name, us in ranked[:top]]
        if len(ranked) > top:
            rest = sum(us for _, us in ranked[top:])
            rows.append([f"({len(ranked) - top} others)", f"{rest:.1f}", f"{rest / total:.1%}"])
        lines += [f"**{arm}**: {total / 1e3:.3f} ms of kernel time per step", ""]
        lines += [*md.table(["kernel", "us", "share"], rows), ""]
    return "\n".join(lines)


def profile_arm(case, arm: str, steps: int) -> list[tuple[int, int, str]]:
    """The trace events of `steps` steps of the arm (jitted and warmed up first)."""
    import jax

    x, params, opt = case.inputs()
    step = jax.jit(model_bench.train_step(case.loss(arm)))
    jax.block_until_ready(step(x, params, opt))  # compile and warm up
    session = bench.ProfileSession()
    for _ in range(steps):
        out = step(x, params, opt)
    jax.block_until_ready(out)
    events, _ = bench.device_events(session.stop())
    return events


GRAD_EPILOGUE_ARM = "jax_cake, gradient epilogue"
INTERLEAVED_DX_ARM = "jax_cake, dx over the interleaved cotangent"


def parse_pin(text: str):
    """((op, m, n, k), bench.ArmSpec) of a --pin "OP:M:N:K=ARM": the GEMM as Plan.op, m, n,
    k, and either a det arm of jax_cake.tools.bench (det/tMxNxK/pp|tiles/c1|c2) or "xla"
    (that GEMM on the XLA path: XLA's dot, and for a gated GEMM its XLA pass)."""
    gemm, sep, arm_name = text.partition("=")
    op, *dims = gemm.split(":")
    if not sep or len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
        raise ValueError(f"--pin {text!r}: expected OP:M:N:K=ARM, e.g. dgrad:8192:14336:4096=det/t128x192x64/pp/c2")
    arm = bench.parse_arm(arm_name)
    if arm.kind not in ("det", "xla") or (arm.kind == "xla" and arm_name != "xla"):
        raise ValueError(f"--pin {text!r}: the arm must be det[/tMxNxK][/pp|/tiles][/c1|/c2] or xla, got {arm_name!r}")
    return (op, *(int(d) for d in dims)), arm


def profile_pinned(case, pin: str, steps: int) -> list[tuple[int, int, str]]:
    """profile_arm of the jax_cake arm traced with one GEMM of the step pinned to a
    variant or to the XLA path (parse_pin; planner.force(gemm=...)), every other GEMM as
    planned."""
    gemm, arm = parse_pin(pin)
    pins = {} if arm.kind == "xla" else dict(tile=arm.tile, schedule=arm.schedule, cluster=arm.cluster)
    with planner.force(arm.kind, gemm=gemm, **pins):
        return profile_arm(case, "jax_cake", steps)  # traced (and planned) inside


def profile_with_switch(case, steps: int, switch: str, value: bool) -> list[tuple[int, int, str]]:
    """profile_arm of the jax_cake arm traced with the planner.gated switch `switch` set
    to value (GATE_GRAD_EPILOGUE_ENABLED: the MLP backward's gradient epilogue, held back
    by default; GATE_UP_DGRAD_ENABLED: dx from the cotangent's halves)."""
    before = getattr(gated_planner, switch)
    setattr(gated_planner, switch, value)
    try:
        return profile_arm(case, "jax_cake", steps)  # traced (and planned) inside
    finally:
        setattr(gated_planner, switch, before)


def main(argv):
    del argv
    for k, v in _ENV.items():  # before the backend starts
        os.environ[k] = (os.environ.get(k, "") + " " + v).strip()
    sizes = model_bench.Sizes()
    case = model_bench.make_case(FLAGS.case, sizes, deterministic=True)
    arms = FLAGS.arms or list(case.arms)
    if any(a not in case.arms for a in arms):
        raise app.UsageError(f"--arms: {arms} must be a subset of {list(case.arms)}")
    h = bench.device_header("device")
    header = f"step_profile: {case.label}; {h['gpu']}, jax {h['jax']}, {h['date']}, {FLAGS.steps} steps per arm"
    if FLAGS.pin and "jax_cake" not in case.arms:
        raise app.UsageError(f"--pin: case {FLAGS.case!r} has no jax_cake arm to pin a GEMM of")
    for pin in FLAGS.pin or ():
        parse_pin(pin)  # a bad pin fails before anything runs
    events = {arm: profile_arm(case, arm, FLAGS.steps) for arm in arms}
    for pin in FLAGS.pin or ():
        events[f"jax_cake, {pin}"] = profile_pinned(case, pin, FLAGS.steps)
    if FLAGS.gate_grad_epilogue and "jax_cake" in case.arms:
        events[GRAD_EPILOGUE_ARM] = profile_with_switch(case, FLAGS.steps, "GATE_GRAD_EPILOGUE_ENABLED", True)
    if FLAGS.interleaved_dx and "jax_cake" in case.arms:
        events[INTERLEAVED_DX_ARM] = profile_with_switch(case, FLAGS.steps, "GATE_UP_DGRAD_ENABLED", False)
    text = header + "\n\n" + table({arm: kernel_times(e, FLAGS.steps) for arm, e in events.items()}, FLAGS.top)
    if FLAGS.timeline:
        timelines = {arm: kernel_timeline(e, FLAGS.steps) for arm, e in events.items()}
        text += "\n" + timeline_table(timelines, FLAGS.timeline_min_us)
    print(text)
    if FLAGS.md:
        with open(FLAGS.md, "w") as f:
            f.write(text)


if __name__ == "__main__":
    flags.DEFINE_enum("case", "mlp", ["skinny", "block", "block_remat", "mlp", "router"], "model_bench's case.")
    flags.DEFINE_list("arms", None, "Arms (default: the case's).")
    flags.DEFINE_integer("steps", 5, "Profiled steps per arm.")
    flags.DEFINE_integer("top", 14, "Kernels listed per arm.")
    flags.DEFINE_string("md", None, "Write the table here.")
    flags.DEFINE_multi_string(
        "pin",
        None,
        "OP:M:N:K=ARM: one more arm, the jax_cake arm with that GEMM (Plan.op, m, n, k) pinned to a det "
        "arm of jax_cake.tools.bench (e.g. dgrad:8192:14336:4096=det/t128x192x64/pp/c2) or to the XLA path "
        "(ARM xla); repeatable.",
    )
    flags.DEFINE_bool("timeline", False, "Also list one step's launches in launch order, per arm.")
    flags.DEFINE_float("timeline_min_us", 20.0, "--timeline: launches shorter than this are summed in one row.")
    flags.DEFINE_bool(
        "gate_grad_epilogue",
        False,
        f"Also profile the jax_cake arm with the MLP backward's gradient epilogue kernel planned "
        f"(held back by default: jax_cake.planner.gated.GATE_GRAD_EPILOGUE_ENABLED), as arm {GRAD_EPILOGUE_ARM!r}.",
    )
    flags.DEFINE_bool(
        "interleaved_dx",
        False,
        "Also profile the jax_cake arm with the gated projection's dx over its cotangent interleaved by an XLA "
        f"pass (jax_cake.planner.gated.GATE_UP_DGRAD_ENABLED off), as arm {INTERLEAVED_DX_ARM!r}.",
    )
    app.run(main)
