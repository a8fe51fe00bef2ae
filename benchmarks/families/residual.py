"""--family=residual: a forward projection with a residual add, h = h + x w^T.

    python -m benchmarks.bench --family=residual                # the down projection: T 8192, 14336 -> 4096
    python -m benchmarks.bench --family=residual --d_in=4096 --d_out=4096   # the o projection

x bf16 [T, d_in], w bf16 [d_out, d_in], the residual h bf16 [T, d_out]; each step adds
into the previous step's h, as a residual stream does (so every arm may write in place).
Forward only. Arms:
  fused    = dense_projection(x, w, residual=h): the add in the forward kernel
             (jax_cake_fwd_residual, a TMA reduce-add of each bf16 tile into h);
  separate = h + dense_projection(x, w): the forward, then XLA's elementwise add;
  xla      = h + jnp.dot(x, w.T): XLA (its GEMM takes h as C with beta = 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from absl import flags

from benchmarks import harness
from benchmarks.families import steps

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


def steps_program(step: Callable, n: int) -> Callable:
    """(buf, x, w, h) -> (buf, h after n x (step, flush)), harness.steps_program's order
    (the step first, barriers around each step, the flush after it), with h carried."""
    import jax

    harness.require_steps_kept()

    def program(buf, x, w, h):
        for _ in range(n):
            buf, x, w, h = jax.lax.optimization_barrier((buf, x, w, h))
            buf, h = jax.lax.optimization_barrier((buf, step(x, w, h)))
            buf = harness.flush(buf)
        return buf, h

    return program


def make_inputs(point: harness.Point, flush_mb: int, seed: int = 0):
    import jax
    import jax.numpy as jnp

    kx, kw, kh = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (point.tokens, point.d_in), jnp.bfloat16)
    w = (jax.random.normal(kw, (point.d_out, point.d_in), jnp.float32) * 0.02).astype(jnp.bfloat16)
    h = jax.random.normal(kh, (point.tokens, point.d_out), jnp.bfloat16)
    return harness.flush_buffer(flush_mb), x, w, h


def measure(point: harness.Point, arms: Sequence[str], timer_kind: str) -> dict[str, list[float]]:
    buf, *args = make_inputs(point, FLAGS.flush_mb)
    programs = {arm: steps_program(step_fn(arm), FLAGS.steps) for arm in arms}
    return harness.measure_arms(programs, buf, args, timer_kind, FLAGS.steps, FLAGS.groups)


FAMILY = steps.family(
    "residual",
    "y = r + x w^T: the add in the forward kernel against a separate add and XLA",
    OP,
    ARMS,
    measure,
    lambda: " Here new = fused (the residual added in the forward kernel).",
    defaults={"tokens": ["8192"], "d_in": ["14336"], "d_out": ["4096"]},
)
