"""Paired GPU timings of a gradient-accumulation step: the sum in the wgrad kernel
against jax_cake plus a separate add, and against XLA's idiomatic step.

    python -m jax_cake.tools.accumulate_bench                       # 4096 -> 4096 and 4096 -> 48, T = 8192
    python -m jax_cake.tools.accumulate_bench --d_out=4096 --micro_batches=8 --md=out/acc.md

One step: the FP32 weight-gradient sums of `--micro_batches` micro-batches of T tokens
each (x bf16 [T, d_in], dy bf16 [T, d_out], w float32 [d_out, d_in]), a `lax.scan` whose
carry starts at zeros, as an accumulating training step does. Only the weight gradient is
taken (jax.vjp against w or the sum), so the step is the wgrad GEMMs and the summation.
Arms:
  fused    = dense_projection(x, w, grad_accumulator=sum): the VJP's sum cotangent, added
             in the wgrad kernel in place (jax_cake_wgrad_accumulate);
  separate = dense_projection(x, w): the FP32 dw, then `sum + dw` (XLA's elementwise add);
  xla      = jnp.dot(x, w.astype(bf16).T): XLA's dw, then `sum + dw`.
Protocol and timing are jax_cake.tools.bench's (its machinery is reused, not copied):
one child process per (run, mode), mode g = command buffers on and e = off; inside a child
the arms run in paired, interleaved groups (the arm order rotated per group), each call
`--steps` x (step, L2 flush); device time from the CUPTI timeline (`--timer=device`, host
wall time without a GPU). Report: median over runs of each run's median group time, and
the ratios separate/fused and xla/fused (above 1: the fused step is faster).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from typing import Callable, Sequence

from absl import app, flags

from jax_cake.tools import bench

FLAGS = flags.FLAGS
ARMS = ("fused", "separate", "xla")
OP = "accumulate"


def project_fn(arm: str) -> Callable:
    """(x, w, sum, dy) -> the new sum, for one micro-batch."""
    import jax
    import jax.numpy as jnp

    import jax_cake

    if arm == "fused":

        def fused(x, w, acc, dy):
            return jax.vjp(lambda a: jax_cake.dense_projection(x, w, grad_accumulator=a), acc)[1](dy)[0]

        return fused
    if arm == "separate":
        project = lambda x, w: jax_cake.dense_projection(x, w)  # noqa: E731
    elif arm == "xla":
        project = lambda x, w: jnp.dot(x, w.astype(jnp.bfloat16).T)  # noqa: E731
    else:
        raise ValueError(f"arm {arm!r}: expected one of {ARMS}")

    def separate(x, w, acc, dy):
        return acc + jax.vjp(lambda w_: project(x, w_), w)[1](dy)[0].astype(jnp.float32)

    return separate


def step_fn(arm: str) -> Callable:
    """(xs, w, dys) -> the FP32 sum of the micro-batches' weight gradients (bench's step
    signature (x, w, dy): xs [n, T, d_in], dys [n, T, d_out])."""
    import jax
    import jax.numpy as jnp

    micro = project_fn(arm)

    def step(xs, w, dys):
        def body(acc, batch):
            return micro(batch[0], w, acc, batch[1]), None

        return jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), (xs, dys))[0]

    return step


def make_inputs(point: bench.Point, micro_batches: int, flush_mb: int, seed: int = 0):
    import jax
    import jax.numpy as jnp

    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    xs = jax.random.normal(kx, (micro_batches, point.tokens, point.d_in), jnp.bfloat16)
    w = jax.random.normal(kw, (point.d_out, point.d_in), jnp.float32) * 0.02
    dys = jax.random.normal(kd, (micro_batches, point.tokens, point.d_out), jnp.bfloat16)
    buf = jnp.zeros((flush_mb * 2**20 // 4,), jnp.uint32)
    return buf, xs, w, dys


def measure(point: bench.Point, arms: Sequence[str], timer_kind: str) -> dict[str, list[float]]:
    """{arm: per-group median step time in us}, the arms interleaved in paired groups."""
    import jax

    buf, xs, w, dys = make_inputs(point, FLAGS.micro_batches, FLAGS.flush_mb)
    compiled = {
        arm: jax.jit(bench.steps_program(step_fn(arm), FLAGS.steps), donate_argnums=0)
        .lower(buf, xs, w, dys)
        .compile()
        for arm in arms
    }
    timer = bench.DeviceTimer(buf, FLAGS.steps) if timer_kind == "device" else bench.WallTimer(buf, FLAGS.steps)
    for arm in arms:  # warm-up
        timer.buf = compiled[arm](timer.buf, xs, w, dys)[0]
    jax.block_until_ready(timer.buf)

    def call(arm):
        return lambda b: compiled[arm](b, xs, w, dys)[0]

    out = {arm: [] for arm in arms}
    for g in range(FLAGS.groups):
        order = [arms[(g + i) % len(arms)] for i in range(len(arms))]
        for arm, times in zip(order, timer.time_calls([call(a) for a in order])):
            out[arm].append(statistics.median(times))
    return out


def points() -> list[bench.Point]:
    return [
        bench.Point(int(t), int(i), int(o), "float32") for i in FLAGS.d_in for o in FLAGS.d_out for t in FLAGS.tokens
    ]


def child(arms: Sequence[str]) -> None:
    timer_kind = FLAGS.timer or bench.default_timer()
    mode, samples = FLAGS.modes[0], []
    for point in points():
        print(f"[{mode} run {FLAGS.run_index}] {point.label} x{FLAGS.micro_batches}", file=sys.stderr, flush=True)
        for arm, groups_us in measure(point, arms, timer_kind).items():
            samples.append(
                {
                    **dataclasses.asdict(point),
                    "op": OP,
                    "mode": mode,
                    "run": FLAGS.run_index,
                    "arm": arm,
                    "groups_us": groups_us,
                }
            )
    bench.write_child_output(FLAGS.child_out, bench.device_header(timer_kind), samples)


def markdown(header: dict, samples: Sequence[dict], arms: Sequence[str]) -> str:
    medians = bench.run_medians(samples)
    baselines = [a for a in arms if a != "fused"]
    cols = ["d_in -> d_out", "T", "micro-batches", "mode"] + [f"{a} us" for a in arms]
    if "fused" in arms:
        cols += [f"{a}/fused" for a in baselines]
    lines = [
        bench.header_line(header) + " Here new = fused (the sum added in the wgrad kernel).",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    keys = sorted({(k[0], k[2]) for k in medians}, key=lambda k: (bench.MODES.index(k[1]), k[0].d_in, -k[0].d_out))
    for point, mode in keys:
        us = {a: medians.get((point, OP, mode, a)) for a in arms}
        row = [f"{point.d_in} -> {point.d_out}", str(point.tokens), str(FLAGS.micro_batches), mode]
        row += [f"{us[a]:.1f}" if us[a] is not None else "n/a" for a in arms]
        if "fused" in arms:
            row += [f"{us[a] / us['fused']:.3f}" if us[a] and us["fused"] else "n/a" for a in baselines]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    arms = list(FLAGS.arms)
    if not arms or any(a not in ARMS for a in arms):
        raise app.UsageError(f"--arms: {arms} must be a non-empty subset of {list(ARMS)}")
    if FLAGS.child_out:
        child(arms)
        return
    names = ("tokens", "d_in", "d_out", "arms", "groups", "steps", "flush_mb", "timer", "micro_batches")
    header, samples = bench.run_children(
        "jax_cake.tools.accumulate_bench", bench.child_argv(names), bench.selected("modes", bench.MODES), FLAGS.runs
    )
    text = markdown(header, samples, arms)
    print(text)
    if FLAGS.md:
        with open(FLAGS.md, "w") as f:
            f.write(text)


if __name__ == "__main__":
    bench.define_flags(arms_default=ARMS, with_ops=False)
    FLAGS.set_default("tokens", ["8192"])
    FLAGS.set_default("d_in", ["4096"])
    FLAGS.set_default("d_out", ["4096", "48"])
    flags.DEFINE_integer("micro_batches", 4, "Micro-batches per step (the scan length).")
    flags.DEFINE_string("md", None, "Write the markdown table here.")
    app.run(main)
