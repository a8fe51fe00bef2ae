"""--family=gated: the gated forward (the SwiGLU gate/up projection of training): the
activation in the GEMM's epilogue against the GEMM then an XLA pass, and against XLA.

    python -m benchmarks.bench --family=gated            # Llama-3-8B: T 8192, 4096 -> 2 x 14336
    python -m benchmarks.bench --family=gated --arms=xla,composed,fused
    python -m benchmarks.bench --family=gated --activation=gelu --arms=xla,composed,fused,fused_pp192c1

One step: (h, gu) from x [T, d_in] bf16 and W [2F, d_in] bf16 (gate and up rows
interleaved in blocks of 16, as jax_cake stacks them; --d_out is 2F): gu = x W^T is the
pre-activation a training step saves, h = bf16(act(g) * u), act `--activation` (silu; gelu
has no cooperative gated variant, so not the fused_coop256c2 arm). Arms:
  xla                = jnp.dot(x, W^T), then the activation (one XLA fusion);
  composed           = the planner's jax_cake forward, then the same XLA pass;
  composed_coop256c2 = the cooperative 128 x 256 cluster 2x1 forward forced, then the pass;
  fused              = the planner's gated plan (jax_cake.planner.gated: at the large
                       shapes the gated epilogue on the ping-pong 128 x 192 cluster 2x1 tile);
  fused_pp192c1      = the gated epilogue on the ping-pong 128 x 192 cluster 1x1 tile;
  fused_coop256c2    = the gated epilogue on the cooperative 128 x 256 cluster 2x1 tile.
Each arm's h and gu are checked against the xla arm's once before timing. The table's
ratios are arm / fused: above 1, the planner-tile fused arm is faster.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from absl import flags

from benchmarks import harness
from benchmarks.families import steps

FLAGS = flags.FLAGS
ARMS = ("fused", "fused_pp192c1", "fused_coop256c2", "composed", "composed_coop256c2", "xla")
OP = "gated"
# (tile, cluster, schedule) the ping-pong arms force.
FORCED = {
    "pp192c2": ((128, 192, 64), (2, 1), "pingpong"),
    "pp192c1": ((128, 192, 64), (1, 1), "pingpong"),
    "coop256c2": ((128, 256, 64), (2, 1), "tiles"),
}


def arm_plan(arm: str, tokens: int, d_in: int, d_out: int, activation: str = "silu"):
    """The Plan the arm's step runs (fused: op fwd_gated; composed: op fwd)."""
    from jax_cake import planner
    from jax_cake.planner.gated import plan_gated

    kind, _, forced = arm.partition("_")
    args = {"tokens": tokens, "d_in": d_in, "d_out": d_out, "activation": activation, "epilogue": kind == "fused"}
    if not forced:
        plan = plan_gated(**args)
    else:
        tile, cluster, schedule = FORCED[forced]
        with planner.force("det", tile=tile, cluster=cluster, schedule=schedule):
            plan = plan_gated(**args)
        if (plan.tile, plan.cluster, plan.schedule) != (tile, cluster, schedule):
            raise RuntimeError(f"{arm}: the forced plan ran {plan.tile} {plan.cluster} {plan.schedule}")
    if plan.op != ("fwd_gated" if kind == "fused" else "fwd"):
        raise RuntimeError(f"{arm}: planned op {plan.op!r} ({plan.reason})")
    return plan


def step_fn(arm: str, point: harness.Point, activation: str = "silu") -> Callable:
    """(x, w) -> (h, gu) for the arm."""
    import jax.numpy as jnp

    from jax_cake import contract, primitives, reference

    if arm == "xla":

        def xla(x, w):
            gu = jnp.dot(x, w.T)
            return reference.gate(*reference.deinterleave(gu, -1, contract.GATE_BLOCK), activation), gu

        return xla
    plan = arm_plan(arm, point.tokens, point.d_in, point.d_out, activation)

    def kernel(x, w):
        h, gu = primitives.fwd_gated(x[None], w[None], plan, activation, contract.GATE_BLOCK)
        return h[0], gu[0]

    return kernel


def check_results(step_fns: dict[str, Callable], *operands) -> None:
    """Every arm's (h, gu) on the operands within harness.XLA_MATCH_REL_TOL (relative to the
    largest entry) of the xla arm's (this family's and grouped_gated's)."""
    import jax
    import numpy as np

    ref = [np.asarray(v, np.float32) for v in jax.jit(step_fns["xla"])(*operands)]
    for arm, step in step_fns.items():
        got = [np.asarray(v, np.float32) for v in jax.jit(step)(*operands)]
        for name, a, b in zip(("h", "gu"), got, ref):
            err = float(np.max(np.abs(a - b))) / float(np.max(np.abs(b)))
            if not (np.all(np.isfinite(a)) and err <= harness.XLA_MATCH_REL_TOL):
                raise RuntimeError(f"{arm}: {name} is {err:.3g} (max-relative) off the xla arm's")


def measure(point: harness.Point, arms: Sequence[str], timer_kind: str) -> dict[str, list[float]]:
    """{arm: per-group median step time in us}, the arms interleaved in paired groups."""
    buf, x, w, dy = harness.make_inputs(point, FLAGS.flush_mb)
    del dy  # the forward only: its step programs get None
    step_fns = {arm: step_fn(arm, point, FLAGS.activation) for arm in dict.fromkeys(("xla", *arms))}
    check_results(step_fns, x, w)
    programs = {arm: harness.steps_program(lambda x, w, dy, s=step_fns[arm]: s(x, w), FLAGS.steps) for arm in arms}
    return harness.measure_arms(programs, buf, (x, w, None), timer_kind, FLAGS.steps, FLAGS.groups)


FAMILY = steps.family(
    "gated",
    "the gated (SwiGLU / GeGLU) forward: the activation in the GEMM epilogue against GEMM + pass and XLA",
    OP,
    ARMS,
    measure,
    lambda: f" d_out is 2F (gate and up); fused = the planner's gated plan (the {FLAGS.activation} epilogue).",
    defaults={"tokens": ["8192"], "d_in": ["4096"], "d_out": ["28672"]},
    reads=("activation",),
)
