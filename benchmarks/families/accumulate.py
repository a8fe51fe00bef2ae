"""--family=accumulate: a gradient-accumulation step, the FP32 sum of --micro_batches
micro-batches' weight gradients.

    python -m benchmarks.bench --family=accumulate                 # 4096 -> 4096 and 4096 -> 48, T 8192
    python -m benchmarks.bench --family=accumulate --d_out=4096 --micro_batches=8

x bf16 [T, d_in], dy bf16 [T, d_out], w float32 [d_out, d_in]; a `lax.scan` whose carry
starts at zeros, as an accumulating training step does. Only the weight gradient is taken
(jax.vjp against w or the sum), so the step is the wgrad GEMMs and the summation. Arms:
  fused    = dense_projection(x, w, grad_accumulator=sum): the VJP's sum cotangent, added
             in the wgrad kernel in place (jax_cake_wgrad_accumulate);
  separate = dense_projection(x, w): the FP32 dw, then `sum + dw` (XLA's elementwise add);
  xla      = jnp.dot(x, w.astype(bf16).T): XLA's dw, then `sum + dw`.
"""

from __future__ import annotations

from typing import Callable, Sequence

from absl import flags

from benchmarks import harness
from benchmarks.families import steps

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
    """(xs, w, dys) -> the FP32 sum of the micro-batches' weight gradients (the harness's
    step signature (x, w, dy): xs [n, T, d_in], dys [n, T, d_out])."""
    import jax
    import jax.numpy as jnp

    micro = project_fn(arm)

    def step(xs, w, dys):
        def body(acc, batch):
            return micro(batch[0], w, acc, batch[1]), None

        return jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), (xs, dys))[0]

    return step


def make_inputs(point: harness.Point, micro_batches: int, flush_mb: int, seed: int = 0):
    import jax
    import jax.numpy as jnp

    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    xs = jax.random.normal(kx, (micro_batches, point.tokens, point.d_in), jnp.bfloat16)
    w = jax.random.normal(kw, (point.d_out, point.d_in), jnp.float32) * 0.02
    dys = jax.random.normal(kd, (micro_batches, point.tokens, point.d_out), jnp.bfloat16)
    return harness.flush_buffer(flush_mb), xs, w, dys


def measure(point: harness.Point, arms: Sequence[str], timer_kind: str) -> dict[str, list[float]]:
    buf, *args = make_inputs(point, FLAGS.micro_batches, FLAGS.flush_mb)
    programs = {arm: harness.steps_program(step_fn(arm), FLAGS.steps) for arm in arms}
    return harness.measure_arms(programs, buf, args, timer_kind, FLAGS.steps, FLAGS.groups)


FAMILY = steps.family(
    "accumulate",
    "micro-batch gradient accumulation: the sum in the wgrad kernel against a separate add and XLA",
    OP,
    ARMS,
    measure,
    lambda: " Here new = fused (the sum added in the wgrad kernel).",
    defaults={"tokens": ["8192"], "d_in": ["4096"], "d_out": ["4096", "48"]},
    out_dtype="float32",
    reads=("micro_batches",),
    extra=lambda: [("micro-batches", FLAGS.micro_batches)],
)
