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
    return bench.flush_buffer(flush_mb), x, w, h


def measure(point: bench.Point, arms: Sequence[str], timer_kind: str) -> dict[str, list[float]]:
    """{arm: per-group median step time in us}, the arms interleaved in paired groups."""
    buf, *args = make_inputs(point, FLAGS.flush_mb)
    programs = {arm: steps_program(step_fn(arm), FLAGS.steps) for arm in arms}
    return bench.measure_arms(programs, buf, args, timer_kind)


def main(argv):
    del argv
    note = " Here new = fused (the residual added in the forward kernel)."
    bench.plain_arm_bench_main("jax_cake.tools.residual_bench", ARMS, OP, measure, note)


if __name__ == "__main__":
    bench.define_arm_bench_flags(ARMS, tokens=["8192"], d_in=["14336"], d_out=["4096"])
    app.run(main)
