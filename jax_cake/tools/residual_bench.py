"""Paired GPU timings of a forward projection with a residual add: the add in the forward
kernel against jax_cake plus a separate add, and against XLA's idiomatic `r + dot`.

    python -m jax_cake.tools.residual_bench            # the down projection: T = 8192, 14336 -> 4096
    python -m jax_cake.tools.residual_bench --d_in=4096 --d_out=4096 --md=out/residual.md   # the o projection

One step: h = h + x w^T (x bf16 [T, d_in], w bf16 [d_out, d_in], the residual h bf16
[T, d_out]), each step adding into the previous step's h, as a residual stream does (so
every arm may write in place: no step keeps its input h alive). Forward only. Arms:
  fused    = dense_projection(x, w, residual=h): the add in the forward kernel
             (jax_cake_fwd_residual, a TMA reduce-add of each bf16 tile into h);
  separate = h + dense_projection(x, w): the forward, then XLA's elementwise add;
  xla      = h + jnp.dot(x, w.T): XLA (its GEMM takes h as C with beta = 1).
Protocol and timing are jax_cake.tools.bench's (its machinery is reused, not copied): one
child process per (run, mode), mode g = command buffers on and e = off; inside a child the
arms run in paired, interleaved groups (the arm order rotated per group), each call
`--steps` x (step, L2 flush); device time from the CUPTI timeline (`--timer=device`, host
wall time without a GPU). Report: median over runs of each run's median group time, and
the ratios separate/fused and xla/fused (above 1: the fused step is faster).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence

from absl import app, flags

from jax_cake.tools import bench

FLAGS = flags.FLAGS
ARMS = ("fused", "separate", "xla")
OP = "residual"


def step_fn(arm: str) -> Callable:
    """(x, w, h) -> h + x w^T in bf16."""
    import jax.numpy as jnp

    import jax_cake

    if arm == "fused":
        return lambda x, w, h: jax_cake.dense_projection(x, w, residual=h)
    if arm == "separate":
        return lambda x, w, h: h + jax_cake.dense_projection(x, w)
    if arm == "xla":
        return lambda x, w, h: h + jnp.dot(x, w.T)
    raise ValueError(f"arm {arm!r}: expected one of {ARMS}")


def steps_program(step: Callable, steps: int) -> Callable:
    """(buf, x, w, h) -> (buf, h after `steps` x (step, flush)), bench.steps_program's
    order (op first, barriers around each step, the flush after it), with h carried."""
    import jax

    def program(buf, x, w, h):
        for _ in range(steps):
            buf, x, w, h = jax.lax.optimization_barrier((buf, x, w, h))
            buf, h = jax.lax.optimization_barrier((buf, step(x, w, h)))
            buf = bench.flush(buf)
        return buf, h

    return program


def make_inputs(point: bench.Point, flush_mb: int, seed: int = 0):
    import jax
    import jax.numpy as jnp

    kx, kw, kh = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (point.tokens, point.d_in), jnp.bfloat16)
    w = (jax.random.normal(kw, (point.d_out, point.d_in), jnp.float32) * 0.02).astype(jnp.bfloat16)
    h = jax.random.normal(kh, (point.tokens, point.d_out), jnp.bfloat16)
    buf = jnp.zeros((flush_mb * 2**20 // 4,), jnp.uint32)
    return buf, x, w, h


def measure(point: bench.Point, arms: Sequence[str], timer_kind: str) -> dict[str, list[float]]:
    """{arm: per-group median step time in us}, the arms interleaved in paired groups."""
    import jax

    buf, x, w, h = make_inputs(point, FLAGS.flush_mb)
    compiled = {
        arm: jax.jit(steps_program(step_fn(arm), FLAGS.steps), donate_argnums=0).lower(buf, x, w, h).compile()
        for arm in arms
    }
    timer = bench.make_timer(timer_kind, buf, FLAGS.steps)
    for arm in arms:  # warm-up
        timer.buf = compiled[arm](timer.buf, x, w, h)[0]
    jax.block_until_ready(timer.buf)

    def call(arm):
        return lambda b: compiled[arm](b, x, w, h)[0]

    return bench.paired_groups(timer, {arm: call(arm) for arm in arms}, FLAGS.groups)


def points() -> list[bench.Point]:
    return [
        bench.Point(int(t), int(i), int(o), "bfloat16") for i in FLAGS.d_in for o in FLAGS.d_out for t in FLAGS.tokens
    ]


def child(arms: Sequence[str]) -> None:
    timer_kind = FLAGS.timer or bench.default_timer()
    mode, samples = FLAGS.modes[0], []
    for point in points():
        print(f"[{mode} run {FLAGS.run_index}] {point.label}", file=sys.stderr, flush=True)
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
    cols = ["d_in -> d_out", "T", "mode"] + [f"{a} us" for a in arms]
    if "fused" in arms:
        cols += [f"{a}/fused" for a in baselines]
    lines = [
        bench.header_line(header) + " Here new = fused (the residual added in the forward kernel).",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    keys = sorted({(k[0], k[2]) for k in medians}, key=lambda k: (bench.MODES.index(k[1]), k[0].d_in, -k[0].d_out))
    for point, mode in keys:
        us = {a: medians.get((point, OP, mode, a)) for a in arms}
        row = [f"{point.d_in} -> {point.d_out}", str(point.tokens), mode]
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
    names = ("tokens", "d_in", "d_out", "arms", "groups", "steps", "flush_mb", "timer")
    header, samples = bench.run_children(
        "jax_cake.tools.residual_bench", bench.child_argv(names), bench.selected("modes", bench.MODES), FLAGS.runs
    )
    text = markdown(header, samples, arms)
    print(text)
    if FLAGS.md:
        with open(FLAGS.md, "w") as f:
            f.write(text)


if __name__ == "__main__":
    bench.define_flags(arms_default=ARMS, with_ops=False)
    FLAGS.set_default("tokens", ["8192"])
    FLAGS.set_default("d_in", ["14336"])
    FLAGS.set_default("d_out", ["4096"])
    flags.DEFINE_string("md", None, "Write the markdown table here.")
    app.run(main)
