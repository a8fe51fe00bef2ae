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
        project = lambda x, w: jax_cake.dense_projection(x, w)
    elif arm == "xla":
        project = lambda x, w: jnp.dot(x, w.astype(jnp.bfloat16).T)
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
    return bench.flush_buffer(flush_mb), xs, w, dys


def measure(point: bench.Point, arms: Sequence[str], timer_kind: str) -> dict[str, list[float]]:
    """{arm: per-group median step time in us}, the arms interleaved in paired groups."""
    buf, *args = make_inputs(point, FLAGS.micro_batches, FLAGS.flush_mb)
    programs = {arm: bench.steps_program(step_fn(arm), FLAGS.steps) for arm in arms}
    return bench.measure_arms(programs, buf, args, timer_kind)


def points() -> list[bench.Point]:
    return bench.arm_bench_points("float32")


def child(arms: Sequence[str]) -> None:
    bench.arm_bench_child(
        OP, points(), lambda point, timer_kind: measure(point, arms, timer_kind), f" x{FLAGS.micro_batches}"
    )


def markdown(header: dict, samples: Sequence[dict], arms: Sequence[str]) -> str:
    note = " Here new = fused (the sum added in the wgrad kernel)."
    return bench.arm_bench_markdown(header, samples, arms, OP, note, [("micro-batches", FLAGS.micro_batches)])


def main(argv):
    del argv
    bench.arm_bench_main("jax_cake.tools.accumulate_bench", ARMS, child, markdown, ["micro_batches"])


if __name__ == "__main__":
    bench.define_arm_bench_flags(ARMS, tokens=["8192"], d_in=["4096"], d_out=["4096", "48"])
    flags.DEFINE_integer("micro_batches", 4, "Micro-batches per step (the scan length).")
    app.run(main)
