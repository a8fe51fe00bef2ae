"""--family=dense: `dense_projection(x bf16 [T, d_in], w [d_out, d_in])`, w bf16 or fp32.

    python -m benchmarks.bench --tokens=16384 --d_in=4096 --d_out=48 --ops=wgrad,bwd
    python -m benchmarks.bench --grid=wide --out_dtype=bfloat16 --ops=fwd,dgrad

Grid: --tokens x --d_in x --d_out (--grid's widths where not given) x --out_dtype (w's
dtype, the wgrad's output dtype). Ops fwd, dgrad, wgrad, bwd, 2fwd+bwd. Arms: det =
deterministic=True; split = the split-K program forced (`split/s16/t64x256x64` names a
split count and a wgrad tile); new = deterministic=False (the planner's pick, plan-table
rows included); xla = `jnp.dot(x, w.astype(bf16).T)`, xla/path = jax_cake's own XLA path
(the op under `planner.force("xla")`: what a plan table's xla row runs); cublas = torch.mm
(a GPU with a CUDA torch). det and split force their program, so an xla row never replaces
the kernels they time; `det/t128x176x64/pp/c2/rm4` forces a tile, schedule, cluster and
tile walk (harness.parse_arm).
"""

from __future__ import annotations

from typing import Callable

from absl import flags

from benchmarks import harness
from benchmarks.families import projections

FLAGS = flags.FLAGS
OPS = ("fwd", "dgrad", "wgrad", "bwd", "2fwd+bwd")
ARMS = ("det", "split", "new", "xla", "cublas")
TABLE = projections.OpTable(
    OPS,
    ARMS,
    ("d_in -> d_out", "out", "T"),
    lambda p: (f"{p.d_in} -> {p.d_out}", {"float32": "FP32", "bfloat16": "BF16"}[p.out], p.tokens),
)
COLUMNS = TABLE.columns


def project(arm: harness.ArmSpec) -> Callable:
    """(x, w) -> y of the arm."""
    import jax.numpy as jnp

    import jax_cake

    if arm.kind == "xla" and not arm.path:
        return lambda x, w: jnp.dot(x, w.astype(jnp.bfloat16).T)
    return lambda x, w: jax_cake.dense_projection(x, w, deterministic=arm.kind == "det")


def points() -> list[harness.Point]:
    tokens, d_in, d_out = (map(int, v) for v in (FLAGS.tokens, FLAGS.d_in, FLAGS.d_out))
    return harness.grid_points(tokens, d_in, d_out, harness.selected("out_dtype", harness.OUT_DTYPES))


FAMILY = projections.family(
    "dense",
    "dense_projection against XLA's dot and cuBLAS",
    TABLE,
    project,
    points,
    reads=("d_in", "d_out", "grid", "out_dtype"),
    grid="d_out",
)
