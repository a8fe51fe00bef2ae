"""--family=batched: `batched_projection(x bf16 [B, T, d_in], w bf16 [B, d_out, d_in])`.

    python -m benchmarks.bench --family=batched --ops=fwd,bwd

Grid: --batch (16, 128) x --pairs (d_in:d_out, 128:512 and 512:128) x --tokens (4096).
Ops fwd, bwd, 2fwd+bwd. Arms: det = the deterministic program; new = deterministic=False
(the planner's pick); xla = `jnp.einsum("btk,bnk->btn", x, w)`; cublas = torch.bmm.
"""

from __future__ import annotations

from typing import Callable

from absl import flags

from benchmarks import harness
from benchmarks.families import projections

FLAGS = flags.FLAGS
OPS = ("fwd", "bwd", "2fwd+bwd")
ARMS = ("det", "new", "xla", "cublas")
TABLE = projections.OpTable(
    OPS, ARMS, ("B", "d_in -> d_out", "T"), lambda p: (p.batch, f"{p.d_in} -> {p.d_out}", p.tokens)
)


def project(arm: harness.ArmSpec) -> Callable:
    import jax.numpy as jnp

    import jax_cake

    if arm.kind == "xla" and not arm.path:
        return lambda x, w: jnp.einsum("btk,bnk->btn", x, w)
    return lambda x, w: jax_cake.batched_projection(x, w, deterministic=arm.kind == "det")


def points() -> list[harness.Point]:
    tokens = list(map(int, FLAGS.tokens))
    return [
        harness.Point(t, i, o, "bfloat16", b, "batched")
        for b in map(int, FLAGS.batch)
        for i, o in harness.parse_pairs(FLAGS.pairs)
        for t in tokens
    ]


FAMILY = projections.family(
    "batched",
    "batched_projection against einsum and torch.bmm",
    TABLE,
    project,
    points,
    reads=("batch", "pairs"),
    defaults={"tokens": ["4096"], "pairs": ["128:512", "512:128"]},
)
