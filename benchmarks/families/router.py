"""--family=router: `router_logits(x f32 [T, d], w f32 [E, d])`, the FP32 router by BF16x3.

    python -m benchmarks.bench --family=router                    # T 16384, d 4096 and 7168, E 256
    python -m benchmarks.bench --family=router --grid=wide --ops=fwd+bwd   # E 8 .. 384

Grid: --tokens (16384) x --d_in (d: 4096, 7168) x --experts (E; --grid=wide: the MoE
router widths 8, 16, 64, 128, 256, 384). Ops fwd, dgrad, wgrad, bwd, fwd+bwd (the value,
dx and dw). Arms: new = router_logits (deterministic=False); xla_x3 = `jnp.dot(x, w.T,
precision=DotAlgorithmPreset.BF16_BF16_F32_X3)`, the same accuracy; xla_highest = the same
with `Precision.HIGHEST`.
"""

from __future__ import annotations

from typing import Callable

from absl import flags

from benchmarks import harness
from benchmarks.families import projections

FLAGS = flags.FLAGS
OPS = ("fwd", "dgrad", "wgrad", "bwd", "fwd+bwd")
ARMS = ("new", "xla_x3", "xla_highest")
TABLE = projections.OpTable(OPS, ARMS, ("d -> E", "T"), lambda p: (f"{p.d_in} -> {p.d_out}", p.tokens))


def project(arm: harness.ArmSpec) -> Callable:
    import jax
    import jax.numpy as jnp

    import jax_cake

    if arm.kind == "new":
        return lambda x, w: jax_cake.router_logits(x, w, deterministic=False)
    precision = {"xla_x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3, "xla_highest": jax.lax.Precision.HIGHEST}
    return lambda x, w: jnp.dot(x, w.T, precision=precision[arm.kind])


def points() -> list[harness.Point]:
    tokens, d, experts = (map(int, v) for v in (FLAGS.tokens, FLAGS.d_in, FLAGS.experts))
    return harness.grid_points(tokens, d, experts, ["float32"], "router")


FAMILY = projections.family(
    "router",
    "router_logits (BF16x3) against XLA's BF16_BF16_F32_X3 and HIGHEST dots",
    TABLE,
    project,
    points,
    reads=("d_in", "experts", "grid"),
    defaults={"tokens": ["16384"], "d_in": ["4096", "7168"]},
    grid="experts",
)
