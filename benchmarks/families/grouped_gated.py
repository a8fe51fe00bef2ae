"""--family=grouped_gated: the MoE experts' gated forward (grouped_gated_projection's gate/up
projection): the activation in the grouped GEMM's epilogue against the grouped GEMM then
an XLA pass, and against XLA.

    python -m benchmarks.bench --family=grouped_gated          # Mixtral-8x7B: M 16384, G 8, 4096 -> 2 x 14336
    python -m benchmarks.bench --family=grouped_gated --tokens=65536 --d_in=2048 --d_out=1536 --gated_experts=128

One step: (h, gu) from x [M, d_in] bf16 (M = --tokens, the routed rows, split into
--gated_experts groups of equal size, the remainder on the first) and W [G, 2F, d_in]
bf16 (each group's gate and up rows interleaved in blocks of 16, as jax_cake stacks
them; --d_out is 2F): gu = x W[g]^T is the pre-activation a training step saves, h =
bf16(act(g) * u), act `--activation`. Arms:
  xla      = jax.lax.ragged_dot(x, W^T), then the activation (one XLA fusion);
  composed = the planner's grouped forward (jax_cake's grouped kernel), then the same XLA pass;
  fused    = the planner's gated grouped plan (planner.grouped.plan_grouped_gated: the
             gated epilogue on the grouped kernel's tile).
Each arm's h and gu are checked against the xla arm's once before timing. The table's
ratios are arm / fused: above 1, the fused arm is faster.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from absl import flags

from benchmarks import harness
from benchmarks.families import steps
from benchmarks.families.gated import check_results

FLAGS = flags.FLAGS
ARMS = ("fused", "composed", "xla")
OP = "grouped_gated"


def define_flags() -> None:
    flags.DEFINE_integer("gated_experts", 8, "grouped_gated: the number of experts (groups) G.")


def arm_plan(arm: str, rows: int, groups: int, d_in: int, d_out: int, activation: str = "silu"):
    """The Plan the arm's step runs (fused: op grouped_fwd_gated; composed: op grouped_fwd)."""
    from jax_cake import contract
    from jax_cake.planner import device as device_lib
    from jax_cake.planner.grouped import GATED_OP, plan_grouped_gated
    from jax_cake.primitives import grouped as grouped_lib

    base = grouped_lib.plan_for("grouped_fwd", (rows, d_in), (groups, d_out, d_in), groups, device_lib.current())
    plan = plan_grouped_gated(base, activation, contract.GATE_BLOCK, epilogue=arm == "fused")
    if plan.op != (GATED_OP if arm == "fused" else "grouped_fwd"):
        raise RuntimeError(f"{arm}: planned op {plan.op!r} ({plan.reason})")
    return plan


def step_fn(arm: str, point: harness.Point, groups: int, activation: str = "silu") -> Callable:
    """(x, (w, sizes)) -> (h, gu) for the arm."""
    import jax

    from jax_cake import contract, reference
    from jax_cake.primitives import grouped as grouped_lib

    if arm == "xla":

        def xla(x, ws):
            w, sizes = ws
            gu = jax.lax.ragged_dot(x, w.transpose(0, 2, 1), sizes)
            return reference.gate(*reference.deinterleave(gu, -1, contract.GATE_BLOCK), activation), gu

        return xla
    plan = arm_plan(arm, point.tokens, groups, point.d_in, point.d_out, activation)

    def kernel(x, ws):
        w, sizes = ws
        return grouped_lib.fwd_gated(x, w, sizes, plan, activation, contract.GATE_BLOCK)

    return kernel


def balanced_sizes(rows: int, groups: int):
    """[G] int32: equal group sizes, the remainder on the first groups."""
    import jax.numpy as jnp

    base, extra = divmod(rows, groups)
    return jnp.asarray([base + (g < extra) for g in range(groups)], jnp.int32)


def make_inputs(point: harness.Point, groups: int, flush_mb: int, seed: int = 0):
    """(flush buffer, x [M, d_in] bf16, (W [G, 2F, d_in] bf16, sizes [G] int32))."""
    import jax
    import jax.numpy as jnp

    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (point.tokens, point.d_in), jnp.bfloat16)
    w = (jax.random.normal(kw, (groups, point.d_out, point.d_in), jnp.float32) * 0.02).astype(jnp.bfloat16)
    return harness.flush_buffer(flush_mb), x, (w, balanced_sizes(point.tokens, groups))


def measure(point: harness.Point, arms: Sequence[str], timer_kind: str) -> dict[str, list[float]]:
    """{arm: per-group median step time in us}, the arms interleaved in paired groups."""
    groups = FLAGS.gated_experts
    buf, x, ws = make_inputs(point, groups, FLAGS.flush_mb)
    step_fns = {arm: step_fn(arm, point, groups, FLAGS.activation) for arm in dict.fromkeys(("xla", *arms))}
    check_results(step_fns, x, ws)
    programs = {arm: harness.steps_program(lambda x, ws, dy, s=step_fns[arm]: s(x, ws), FLAGS.steps) for arm in arms}
    return harness.measure_arms(programs, buf, (x, ws, None), timer_kind, FLAGS.steps, FLAGS.groups)


FAMILY = steps.family(
    "grouped_gated",
    "the MoE experts' gated forward: the activation in the grouped GEMM's epilogue against GEMM + pass and XLA",
    OP,
    ARMS,
    measure,
    lambda: (
        f" T is the routed rows M in {FLAGS.gated_experts} equal groups; d_out is 2F (gate and up);"
        f" fused = the planner's gated grouped plan (the {FLAGS.activation} epilogue)."
    ),
    defaults={"tokens": ["16384"], "d_in": ["4096"], "d_out": ["28672"]},
    reads=("activation", "gated_experts"),
    extra=lambda: (("G", FLAGS.gated_experts),),
)
