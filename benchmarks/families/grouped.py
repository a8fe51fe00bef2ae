"""--family=grouped: the MoE expert GEMMs, `grouped_projection(x bf16 [M, d_in], w [G, d_out,
d_in], group_sizes int32 [G])`, against XLA's and tokamax's ragged dot and a dense GEMM.

    python -m benchmarks.bench --family=grouped                      # the three MoE models' experts
    python -m benchmarks.bench --family=grouped --moe_points=16384:8:4096:14336 --routings=balanced,skewed

The tokamax arm on a machine without network: the wheels lie in `.whl/` at the repository
root (tokamax 0.0.17 for jax >= 0.11.1 and the requirements jax does not bring, about 6 MB;
git-ignored, so a copy of the tree must name it to take it along). Install them into a
folder and put it on the path:
    python -m pip install --no-index --no-deps --target /tmp/tok .whl/*.whl
    PYTHONPATH=/tmp/tok python -m benchmarks.bench --family=grouped
(`--no-deps`: pip would otherwise look for jax, flax and xprof in .whl/). tokamax's import
needs qwix, which needs flax (the `test` extra has it); `import tokamax` also imports
xprof (22 MB, only for tokamax's own benchmarking), which is not among the wheels: where
xprof does not import, this module puts an empty stand-in for `xprof.cli.tools` in
sys.modules before importing tokamax (`import_tokamax`). Without tokamax the arm is
reported as not importable.

Points (`--moe_points`, M:G:d_in:d_out, M the routed rows = tokens x top-k), defaults:
Mixtral-8x7B's experts (G 8, 4096 -> 14336 and 14336 -> 4096, T 8192 top-2: M 16384),
Qwen3-30B-A3B's (G 128, 2048 -> 768 and back, T 8192 top-8: M 65536) and a DeepSeek-V3
expert-parallel shard's (G 32, 7168 -> 2048 and back, M 16384). `--out_dtype`: w's dtype
(float32: FP32 masters, the FP32 wgrad; bfloat16). Routings (`--routings`): balanced
(equal sizes, the remainder on the first groups), skewed (a Dirichlet(0.5) draw with seed
0, the max(1, G // 8) smallest shares set to 0: some experts empty), one (every row in
group 0). Ops: fwd (y), bwd (dx and dw of a cotangent dy, no forward), fwd+bwd (all three).

Arms (each with its weight in its own layout, made before timing, the same values):
  jax_cake  = jax_cake.grouped_projection(x, w [G, d_out, d_in], sizes), its default plan
              (the grouped kernels on sm_90a);
  xla       = jax.lax.ragged_dot(x, w_kn.astype(bf16), sizes), w_kn [G, d_in, d_out], default
              flags; its gradients as jax.vjp gives them (an FP32 master's dw is the bf16
              dw upcast);
  xla_cudnn = the same in child processes of their own with XLA_FLAGS
              --xla_gpu_experimental_use_ragged_dot_fusion=true (the dense arm, where asked
              for, runs beside it there as `dense@xla_cudnn`, the same anchor measured in
              that process); a child that fails is reported in the status column;
  tokamax   = tokamax.ragged_dot(x, w_kn.astype(bf16), sizes), its default implementation
              (the status column names the one it lowered to: mosaic where a Mosaic GPU
              kernel is in the program, else xla);
  dense     = jax_cake.dense_projection(x [M, d_in], w [d_out, d_in]): the same FLOPs as
              one dense GEMM, the anchor a grouped GEMM should reach;
  kernels   = the grouped kernels alone (sm_90a), on operands laid out before timing (x and
              dy in the row layout, the weight already bf16, the tables made): jax_cake's
              time less its row-layout gathers and the weight's cast;
  dense_tile = the dense anchor on 128 x 128 x 64 cooperative tiles, no CTA pair
              (planner.force; the grouped wgrad's tile, the grouped fwd and dgrad run
              128 x 256): what that tile costs the dense GEMM.
jax_cake / kernels is the share of the row layout's gathers and the weight's cast in
jax_cake's distance to `dense`, kernels / dense the grouped kernels' own.
Before timing, every arm's y, dx and dw (one fwd+bwd) are checked against float64 on
sampled rows of every non-empty group (ROWS_PER_GROUP rows of y and dx, SAMPLED_DW_ROWS
rows of each dw) and, where the jax_cake arm runs in the process, against its whole
tensors (max-relative, harness.XLA_MATCH_REL_TOL). An arm that fails to compile or run is
reported in the status column and not timed; wrong values fail the command (exit 1).

Times: the harness's protocol (harness.paired_groups: the arms interleaved in paired
groups, every step followed by an L2 flush, CUPTI device time, a child process per run and
mode). TFLOP/s counts the useful FLOPs only: 2 M d_in d_out per GEMM (fwd 1 GEMM, bwd 2,
fwd+bwd 3). Ratios are baseline us / jax_cake us (above 1: jax_cake is faster);
dense/jax_cake is the share of the dense anchor's speed jax_cake reaches.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import statistics
import subprocess
import sys
import types
from typing import Callable, Sequence

from absl import app, flags

from benchmarks import harness, plan_rule
from benchmarks import markdown as md

FLAGS = flags.FLAGS
OPS = ("fwd", "bwd", "fwd+bwd")
GEMMS = {"fwd": 1, "bwd": 2, "fwd+bwd": 3}
ARMS = ("jax_cake", "xla", "xla_cudnn", "tokamax", "dense", "kernels", "dense_tile")
ROUTINGS = ("balanced", "skewed", "one")
CUDNN_FLAG = "--xla_gpu_experimental_use_ragged_dot_fusion=true"
CUDNN_PARTNER = "dense@xla_cudnn"  # the dense anchor measured in the xla_cudnn processes
KN_ARMS = ("xla", "xla_cudnn", "tokamax")  # lax's rhs layout [G, d_in, d_out]
DENSE_ARMS = ("dense", CUDNN_PARTNER, "dense_tile")
KERNELS_ARM = "kernels"
# M:G:d_in:d_out
DEFAULT_POINTS = (
    "16384:8:4096:14336",  # Mixtral-8x7B experts, T 8192 top-2: w1 / w3
    "16384:8:14336:4096",  # and w2
    "65536:128:2048:768",  # Qwen3-30B-A3B, T 8192 top-8
    "65536:128:768:2048",
    "16384:32:7168:2048",  # DeepSeek-V3, one expert-parallel shard of 32 experts
    "16384:32:2048:7168",
)
SKEW_ALPHA, SKEW_SEED = 0.5, 0
ROWS_PER_GROUP = 4  # rows of y and dx per non-empty group checked against float64
SAMPLED_DW_ROWS = 4  # rows (d_out indices) of every group's dw checked against float64
F64_REL_TOL = 2.0**-7  # ||arm - f64|| / ||f64|| over the sampled entries (bf16 results: ~2^-9)
READS = ("moe_points", "routings", "ops", "arms", "out_dtype")


def define_flags() -> None:
    flags.DEFINE_list("moe_points", list(DEFAULT_POINTS), "grouped: M:G:d_in:d_out points (M = routed rows).")
    flags.DEFINE_list("routings", list(ROUTINGS), f"grouped: group-size routings, from {ROUTINGS}.")


@dataclasses.dataclass(frozen=True)
class GroupedPoint:
    rows: int  # M, the routed rows
    groups: int  # G
    d_in: int
    d_out: int
    out: str  # w's dtype

    @property
    def label(self) -> str:
        return f"grouped M={self.rows} G={self.groups} {self.d_in}->{self.d_out} {self.out}"

    def flops(self, op: str) -> int:
        return GEMMS[op] * 2 * self.rows * self.d_in * self.d_out


def parse_points(values: Sequence[str], outs: Sequence[str]) -> list[GroupedPoint]:
    points = []
    for v in values:
        parts = v.split(":")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise app.UsageError(f"--moe_points: {v!r} is not M:G:d_in:d_out (positive integers)")
        points += [GroupedPoint(*map(int, parts), out) for out in outs]
    return points


def points() -> list[GroupedPoint]:
    return parse_points(FLAGS.moe_points, harness.selected("out_dtype", harness.OUT_DTYPES))


# --- routings ------------------------------------------------------------------------------


def _round_to(shares, rows: int):
    """Integer sizes summing to rows, proportional to shares (largest remainders)."""
    import numpy as np

    exact = np.asarray(shares, np.float64) * rows / max(float(np.sum(shares)), 1e-300)
    sizes = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - sizes), kind="stable")
    sizes[order[: rows - int(sizes.sum())]] += 1
    return sizes


def group_sizes(routing: str, rows: int, groups: int):
    """[G] int32 numpy sizes summing to rows."""
    import numpy as np

    if routing == "balanced":
        return _round_to(np.ones(groups), rows).astype(np.int32)
    if routing == "one":
        sizes = np.zeros(groups, np.int32)
        sizes[0] = rows
        return sizes
    if routing == "skewed":
        shares = np.random.default_rng(SKEW_SEED).dirichlet(np.full(groups, SKEW_ALPHA))
        empty = min(max(1, groups // 8), groups - 1)
        shares[np.argsort(shares, kind="stable")[:empty]] = 0.0
        return _round_to(shares, rows).astype(np.int32)
    raise ValueError(f"routing {routing!r}: expected one of {ROUTINGS}")


def describe_routing(sizes) -> str:
    rows = int(sum(sizes))
    return f"largest group {max(sizes) / rows:.0%} of the rows, {sum(1 for s in sizes if s == 0)} empty"


# --- arms --------------------------------------------------------------------------------


def import_tokamax():
    """tokamax, with a stand-in for xprof.cli.tools where xprof does not import (tokamax
    imports it for its own benchmarking only); raises ImportError where tokamax does not import."""
    try:
        import xprof.cli.tools  # noqa: F401
    except ImportError:
        stub = {name: types.ModuleType(name) for name in ("xprof", "xprof.cli", "xprof.cli.tools")}
        stub["xprof.cli.tools"].get_kernel_stats_tool = None
        stub["xprof"].cli, stub["xprof.cli"].tools = stub["xprof.cli"], stub["xprof.cli.tools"]
        for name, module in stub.items():
            sys.modules.setdefault(name, module)
    import tokamax

    return tokamax


def forward(arm: str) -> Callable:
    """(x, w, sizes) -> y of the arm; w in the arm's layout (arm_args)."""
    import jax
    import jax.numpy as jnp

    import jax_cake

    if arm == "jax_cake":
        return lambda x, w, sizes: jax_cake.grouped_projection(x, w, sizes)
    if arm in ("xla", "xla_cudnn"):
        return lambda x, w, sizes: jax.lax.ragged_dot(x, w.astype(jnp.bfloat16), sizes)
    if arm == "tokamax":
        tokamax = import_tokamax()
        return lambda x, w, sizes: tokamax.ragged_dot(x, w.astype(jnp.bfloat16), sizes)
    if arm in DENSE_ARMS:
        return lambda x, w, sizes: jax_cake.dense_projection(x, w)
    raise ValueError(f"arm {arm!r}: expected one of {ARMS}")


def kernel_plans(rows: int, d_in: int, w_shape, w_dtype) -> dict:
    """{op: Plan} of the grouped kernels' three roles at these sizes on the device planned
    for (planner.device.current), as grouped_projection plans them."""
    from jax_cake.planner import device as device_lib
    from jax_cake.primitives import grouped as grouped_lib

    device, groups, d_out = device_lib.current(), w_shape[0], w_shape[1]
    x, dy = (rows, d_in), (rows, d_out)
    return {
        "fwd": grouped_lib.plan_for("grouped_fwd", x, w_shape, groups, device),
        "dgrad": grouped_lib.plan_for("grouped_dgrad", dy, w_shape, groups, device),
        "wgrad": grouped_lib.plan_for("grouped_wgrad", dy, x, groups, device, out_dtype=w_dtype),
    }


def kernels_step(op: str, w_dtype: str) -> Callable:
    """The kernels arm's step (x laid out, (w bf16, row_table, k_table, dest), dy laid out)
    -> the op's outputs: y and dx laid out, dw [G, d_out, d_in] in w_dtype (the master's)."""
    from jax_cake.primitives import gemm as gemm_lib

    def step(x, ws, dy):
        w, row_table, k_table, dest = ws
        plans = kernel_plans(dest.shape[0], x.shape[1], w.shape, w_dtype)
        y = lambda: gemm_lib.grouped_fwd(x, w, row_table, plans["fwd"])
        dx = lambda: gemm_lib.grouped_dgrad(dy, w, row_table, plans["dgrad"])
        dw = lambda: gemm_lib.grouped_wgrad(dy, x, k_table, plans["wgrad"])
        return {"fwd": lambda: (y(),), "bwd": lambda: (dx(), dw()), "fwd+bwd": lambda: (y(), dx(), dw())}[op]()

    return step


def arm_step(arm: str, op: str, w_dtype: str = "float32") -> Callable:
    """(x, ws, dy) -> the op's outputs for the arm (arm_operands'): the forward's op_step;
    the kernels arm's own (its dw in w_dtype); dense_tile's inside a force block of the
    grouped kernels' tile."""
    if arm == KERNELS_ARM:
        return kernels_step(op, w_dtype)
    step = op_step(op, forward(arm))
    if arm != "dense_tile":
        return step
    from jax_cake.planner import force
    from jax_cake.planner.grouped import KERNEL_TILE

    def forced(*args):
        with force("det", tile=KERNEL_TILE, schedule="tiles", cluster=(1, 1)):
            return step(*args)

    return forced


def op_step(op: str, fn: Callable) -> Callable:
    """(x, (w, sizes), dy) -> the op's outputs, the harness's step signature (steps_program)."""
    import jax

    def vjp(x, ws):
        w, sizes = ws
        return jax.vjp(lambda x_, w_: fn(x_, w_, sizes), x, w)

    if op == "fwd":
        return lambda x, ws, dy: (fn(x, *ws),)
    if op == "bwd":
        return lambda x, ws, dy: vjp(x, ws)[1](dy)
    if op == "fwd+bwd":

        def fwd_bwd(x, ws, dy):
            y, pullback = vjp(x, ws)
            return (y, *pullback(dy))

        return fwd_bwd
    raise ValueError(f"op {op!r}: expected one of {OPS}")


@dataclasses.dataclass
class Inputs:
    buf: object  # the L2 flush buffer
    x: object  # [M, d_in] bf16
    w: object  # [G, d_out, d_in] in the point's dtype
    w_kn: object  # w as [G, d_in, d_out] (lax's layout), a copy
    w_dense: object  # [d_out, d_in], the dense anchor's
    dy: object  # [M, d_out] bf16


def make_inputs(point: GroupedPoint, flush_mb: int, seed: int = 0) -> Inputs:
    import jax
    import jax.numpy as jnp

    kx, kw, kd, ky = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, (point.rows, point.d_in), jnp.bfloat16)
    w = (jax.random.normal(kw, (point.groups, point.d_out, point.d_in), jnp.float32) * 0.02).astype(point.out)
    w_kn = jnp.swapaxes(w, 1, 2).copy()
    w_dense = (jax.random.normal(kd, (point.d_out, point.d_in), jnp.float32) * 0.02).astype(point.out)
    dy = jax.random.normal(ky, (point.rows, point.d_out), jnp.bfloat16)
    return Inputs(harness.flush_buffer(flush_mb), x, w, w_kn, w_dense, dy)


def arm_operands(arm: str, inputs: Inputs, sizes) -> tuple:
    """(x, ws, dy) of the arm's step: ws = arm_args'; the kernels arm's x and dy laid out
    and ws = (w bf16, row_table, k_table, dest) (PaddedLayout's), all made here, before
    any timing."""
    import jax.numpy as jnp

    if arm != KERNELS_ARM:
        return inputs.x, arm_args(arm, inputs, sizes), inputs.dy
    from jax_cake.planner.grouped import KERNEL_TILE
    from jax_cake.primitives import grouped as grouped_lib

    layout = grouped_lib.padded_layout(jnp.asarray(sizes, jnp.int32), inputs.x.shape[0], k_tile=KERNEL_TILE[2])
    ws = (inputs.w.astype(jnp.bfloat16), layout.row_table, layout.k_table, layout.dest)
    return layout.lay_out(inputs.x), ws, layout.lay_out(inputs.dy)


def from_layout(arm: str, ws, out):
    """A result of the arm's step in the rows' order: the kernels arm's laid-out y / dx
    gathered back by dest (PaddedLayout.gather); any other arm's as it is."""
    import jax.numpy as jnp

    if arm != KERNELS_ARM or out.ndim != 2:
        return out
    return jnp.take(out, ws[3], axis=0, mode="fill", fill_value=0)


def arm_args(arm: str, inputs: Inputs, sizes) -> tuple:
    """(w, sizes) of the arm: its weight in its layout, the sizes as an int32 device array
    (the dense arms' [M]: unused)."""
    import jax.numpy as jnp

    if arm in DENSE_ARMS:
        return inputs.w_dense, jnp.asarray([inputs.x.shape[0]], jnp.int32)
    return (inputs.w_kn if arm in KN_ARMS else inputs.w), jnp.asarray(sizes, jnp.int32)


# --- value checks ------------------------------------------------------------------------


def _as_nk(arm: str, dw):
    """dw in [G, d_out, d_in] (the kn arms' dw is [G, d_in, d_out]); the dense arm's [1, d_out, d_in]."""
    import jax.numpy as jnp

    if arm in KN_ARMS:
        return jnp.swapaxes(dw, 1, 2)
    return dw[None] if dw.ndim == 2 else dw


@dataclasses.dataclass(frozen=True)
class Reference:
    """float64 values of y, dx and dw at sampled entries: rows `rows[g]` (ROWS_PER_GROUP
    rows of group g, evenly spaced) of y and dx where `filled[g]` (a non-empty group), rows
    `js` (SAMPLED_DW_ROWS d_out indices) of every group's dw [G, d_out, d_in] (an empty
    group's: 0)."""

    rows: object  # [G, ROWS_PER_GROUP] row indices
    filled: object  # [G] bool
    js: object  # [SAMPLED_DW_ROWS]
    y: object  # [G, ROWS_PER_GROUP, d_out]
    dx: object  # [G, ROWS_PER_GROUP, d_in]
    dw: object  # [G, SAMPLED_DW_ROWS, d_in]


def _reference64(x, w, dy, owner, rows, js):
    """Under enable_x64, on the device: y and dx at rows [G, k] (group g's rows times w[g]
    rounded to bf16), and dw[:, js, :] as a one-hot sum over every row (owner[r]: its group)."""
    import jax
    import jax.numpy as jnp

    f64, hi = jnp.float64, jax.lax.Precision.HIGHEST

    def per_group(args):
        xg, dyg, wg = args
        wg = wg.astype(jnp.bfloat16).astype(f64)
        return jnp.matmul(xg.astype(f64), wg.T, precision=hi), jnp.matmul(dyg.astype(f64), wg, precision=hi)

    y, dx = jax.lax.map(per_group, (x[rows], dy[rows], w))
    onehot = (owner[:, None] == jnp.arange(w.shape[0])[None, :]).astype(f64)  # [M, G]
    dw = jnp.einsum("mg,mj,mk->gjk", onehot, dy[:, js].astype(f64), x.astype(f64), precision=hi)
    return y, dx, dw


@functools.cache
def _reference64_jit():
    import jax

    return jax.jit(_reference64)


def reference(x, w, dy, sizes) -> Reference:
    """Reference values from the same operands (w [G, d_out, d_in] rounded to bf16 for y and
    dx, as every arm rounds it), in float64 on the device: one program, whatever G."""
    import jax
    import numpy as np

    sizes = np.asarray(sizes, np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    rows = np.stack(
        [np.linspace(lo, max(lo, hi - 1), ROWS_PER_GROUP).round() for lo, hi in zip(starts[:-1], starts[1:])]
    ).astype(np.int32)
    rows = np.minimum(rows, x.shape[0] - 1)  # an empty last group's rows: any valid row, never compared
    owner = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
    js = np.unique(np.linspace(0, w.shape[1] - 1, SAMPLED_DW_ROWS).round().astype(np.int32))
    with jax.enable_x64(True):
        y, dx, dw = (np.asarray(v) for v in _reference64_jit()(x, w, dy, owner, rows, js))
    return Reference(rows, sizes > 0, js, y, dx, dw)


def sampled_error(ref: Reference, y, dx, dw) -> dict[str, float]:
    """||out - ref|| / ||ref|| of y, dx and dw (dw as [G, d_out, d_in]) on the reference's
    entries; inf where a sampled entry is not finite."""
    import jax.numpy as jnp
    import numpy as np

    rows = ref.rows[ref.filled]
    got = {"y": y[rows], "dx": dx[rows], "dw": dw[:, ref.js, :]}
    want = {"y": ref.y[ref.filled], "dx": ref.dx[ref.filled], "dw": ref.dw}
    out = {}
    for name in ("y", "dx", "dw"):
        a = np.asarray(jnp.asarray(got[name], jnp.float32), np.float64)
        err = np.linalg.norm(a - want[name]) / max(float(np.linalg.norm(want[name])), 1e-300)
        out[name] = float(err) if np.all(np.isfinite(a)) else math.inf
    return out


def max_relative(a, b) -> float:
    """max |a - b| / max |b| (inf where a holds a NaN or Inf)."""
    import jax.numpy as jnp

    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    if not bool(jnp.all(jnp.isfinite(a))):
        return math.inf
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def check_arms(arms: Sequence[str], inputs: Inputs, sizes) -> tuple[dict[str, str], dict[str, str]]:
    """Runs every arm's fwd+bwd once and checks its values: ({arm: why it cannot run},
    {arm: what is wrong with its values}); an arm in neither passed."""
    import jax
    import jax.numpy as jnp

    broken, wrong, outs, refs = {}, {}, {}, {}
    w_dtype = jnp.dtype(inputs.w.dtype).name
    for arm in arms:
        dense = arm in DENSE_ARMS
        if arm == KERNELS_ARM:
            plans = kernel_plans(*inputs.x.shape, inputs.w.shape, w_dtype)
            if not all(p.uses_kernel for p in plans.values()):
                broken[arm] = f"no grouped kernel runs here ({plans['fwd'].reason})"
                continue
        else:
            try:
                forward(arm)
            except Exception as e:  # noqa: BLE001 - tokamax's import (or its requirements'): reported, not timed
                broken[arm] = f"not importable ({harness.first_line(e)})"
                continue
        try:
            x, ws, dy = arm_operands(arm, inputs, sizes)
            y, dx, dw = jax.jit(arm_step(arm, "fwd+bwd", w_dtype))(x, ws, dy)
            jax.block_until_ready(dw)
        except Exception as e:  # noqa: BLE001 - XLA's compile and run errors: the arm is reported, not timed
            broken[arm] = f"failed to compile or run ({harness.first_line(e)})"
            continue
        y, dx, dw = from_layout(arm, ws, y), from_layout(arm, ws, dx), _as_nk(arm, dw)
        if dense not in refs:
            if dense:
                refs[dense] = reference(inputs.x, inputs.w_dense[None], inputs.dy, [inputs.x.shape[0]])
            else:
                refs[dense] = reference(inputs.x, inputs.w, inputs.dy, sizes)
        errs = sampled_error(refs[dense], y, dx, dw)
        bad = [f"{k} {v:.3g} from float64" for k, v in errs.items() if not v <= F64_REL_TOL]
        if not dense:
            outs[arm] = (y, dx, dw)
        if bad:
            wrong[arm] = ", ".join(bad)
    if "jax_cake" in outs:
        for arm, got in outs.items():
            errs = [(n, max_relative(a, b)) for n, a, b in zip(("y", "dx", "dw"), got, outs["jax_cake"])]
            bad = [f"{n} {e:.3g} (max-relative) from jax_cake's" for n, e in errs if not e <= harness.XLA_MATCH_REL_TOL]
            if bad:
                wrong[arm] = "; ".join(filter(None, [wrong.get(arm), ", ".join(bad)]))
    return broken, wrong


def lowered_implementation(arm: str, inputs: Inputs, sizes) -> str:
    """What tokamax's default implementation lowered to: "mosaic" where the forward's
    program calls a Mosaic GPU kernel (custom call mosaic_gpu*), else "xla"."""
    import jax

    text = jax.jit(forward(arm)).lower(inputs.x, *arm_args(arm, inputs, sizes)).as_text()
    return "mosaic" if "custom_call @mosaic_gpu" in text else "xla"


# --- a child: one (run, mode) --------------------------------------------------------------


def cudnn_process() -> bool:
    return CUDNN_FLAG in os.environ.get("XLA_FLAGS", "")


def measure(point: GroupedPoint, routing: str, arms: Sequence[str], ops: Sequence[str], timer_kind: str):
    """({(op, arm): (per-group median us or None, a note or why it has no time)}, the group
    sizes, {arm: what is wrong with its values}) for one point and routing."""
    import jax

    inputs = make_inputs(point, FLAGS.flush_mb)
    sizes = group_sizes(routing, point.rows, point.groups)
    broken, wrong = check_arms(arms, inputs, sizes)
    notes = {}
    if "tokamax" in arms and "tokamax" not in broken:
        notes["tokamax"] = f"lowered to {lowered_implementation('tokamax', inputs, sizes)}"
    args = {arm: arm_operands(arm, inputs, sizes) for arm in arms if arm not in broken}
    w_dtype = point.out
    out = {}
    for op in ops:
        programs = {}
        for arm in arms:
            if arm in broken or arm in wrong:
                out[op, arm] = (None, broken.get(arm) or f"wrong values: {wrong[arm]}")
                continue
            program = harness.steps_program(arm_step(arm, op, w_dtype), FLAGS.steps)
            try:
                programs[arm] = jax.jit(program, donate_argnums=0).lower(inputs.buf, *args[arm]).compile()
            except Exception as e:  # noqa: BLE001 - reported per (op, arm), not timed
                out[op, arm] = (None, f"{op} failed to compile ({harness.first_line(e)})")
        if not programs:
            continue
        timer = harness.make_timer(timer_kind, inputs.buf, FLAGS.steps)
        for arm, program in list(programs.items()):  # warm-up: graph instantiation, autotuning, lazy loading
            try:
                timer.buf = jax.block_until_ready(program(timer.buf, *args[arm])[0])
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: reported per (op, arm), not timed
                out[op, arm] = (None, f"{op} failed to run ({harness.first_line(e)})")
                del programs[arm]
                timer.buf = harness.flush_buffer(FLAGS.flush_mb)  # the failed call may have consumed it
        if not programs:
            inputs.buf = timer.buf
            continue
        calls = {arm: (lambda b, p=program, a=args[arm]: p(b, *a)[0]) for arm, program in programs.items()}
        for arm, groups_us in harness.paired_groups(timer, calls, FLAGS.groups).items():
            out[op, arm] = (groups_us, notes.get(arm, ""))
        inputs.buf = timer.buf
        del programs, calls
    return out, sizes, wrong


def child(mode: str, run: int, timer_kind: str) -> list[dict]:
    arms = list(FLAGS.arms)
    if ("xla_cudnn" in arms) != cudnn_process():
        raise app.UsageError(f"the xla_cudnn arm runs alone in a process with XLA_FLAGS {CUDNN_FLAG} (the parent's)")
    if cudnn_process() and "dense" in arms:  # the anchor beside xla_cudnn, reported apart
        arms[arms.index("dense")] = CUDNN_PARTNER
    samples = []
    for point in points():
        for routing in FLAGS.routings:
            print(f"[{mode} run {run}] {point.label} {routing}", file=sys.stderr, flush=True)
            out, sizes, wrong = measure(point, routing, arms, list(FLAGS.ops), timer_kind)
            for (op, arm), (groups_us, error) in out.items():
                samples.append(
                    {
                        **dataclasses.asdict(point),
                        "routing": routing,
                        "sizes": [int(s) for s in sizes],
                        "op": op,
                        "mode": mode,
                        "run": run,
                        "arm": arm,
                        "groups_us": groups_us,
                        "note": error,
                        "wrong": arm in wrong,
                    }
                )
    return samples


def parent(argv: Sequence[str], modes: Sequence[str]) -> tuple[dict, list[dict]]:
    """The arms' children; the xla_cudnn arm's (with the dense anchor where asked for) in
    children of their own with the ragged-dot fusion flag."""
    arms, runs = list(FLAGS.arms), FLAGS.runs
    base = [a for a in argv if not a.startswith("--arms=")]
    header, samples = {}, []
    main = [a for a in arms if a != "xla_cudnn"]
    if main:
        header, samples = harness.run_children("benchmarks.bench", [*base, f"--arms={','.join(main)}"], modes, runs)
    if "xla_cudnn" in arms:
        cudnn = ["xla_cudnn"] + (["dense"] if "dense" in arms else [])
        saved = os.environ.get("XLA_FLAGS")
        os.environ["XLA_FLAGS"] = f"{saved or ''} {CUDNN_FLAG}".strip()
        try:
            h, s = harness.run_children("benchmarks.bench", [*base, f"--arms={','.join(cudnn)}"], modes, runs)
            header = header or h
            samples += s
        except subprocess.CalledProcessError as e:
            why = f"its child process exited with status {e.returncode} (its stderr above)"
            samples += failed_samples(why, points(), FLAGS.routings, FLAGS.ops, modes)
        finally:
            if saved is None:
                os.environ.pop("XLA_FLAGS", None)
            else:
                os.environ["XLA_FLAGS"] = saved
    if not header:  # only xla_cudnn, whose children failed
        header = dict.fromkeys(("gpu", "sms", "driver", "jax", "date"), "n/a") | {"timer": "n/a (no child ran)"}
    return header, samples


def failed_samples(
    why: str, points: Sequence[GroupedPoint], routings: Sequence[str], ops: Sequence[str], modes: Sequence[str]
) -> list[dict]:
    """One sample per (point, routing, op, mode) saying why the xla_cudnn arm has no time."""
    return [
        {**dataclasses.asdict(p), "routing": r, "op": op, "mode": m, "run": 0, "arm": "xla_cudnn"}
        | {"groups_us": None, "note": why, "wrong": False}
        for p in points
        for r in routings
        for op in ops
        for m in modes
    ]


# --- report --------------------------------------------------------------------------------

SHAPE_COLUMNS = ("G", "M", "d_in -> d_out", "w", "routing")


def point_of(sample: dict) -> GroupedPoint:
    return GroupedPoint(*(sample[f.name] for f in dataclasses.fields(GroupedPoint)))


def columns(arms: Sequence[str]) -> list[str]:
    timed = [*arms, *([CUDNN_PARTNER] if "xla_cudnn" in arms and "dense" in arms else [])]
    cols = ["GPU", "SMs", *SHAPE_COLUMNS, "op", "mode"]
    for arm in timed:
        cols += [f"{arm} us", f"{arm} TFLOP/s"]
    cols += [f"{arm}/jax_cake" for arm in arms if arm != "jax_cake" and "jax_cake" in arms]
    return cols + ["status"]


def table_rows(header: dict, samples: Sequence[dict], arms: Sequence[str]) -> list[dict]:
    """One row per (point, routing, op, mode): each arm's median over runs of its per-run
    median group time, its TFLOP/s, baseline / jax_cake, and why an arm has no time."""
    groups: dict[tuple, dict[str, list]] = {}
    for s in samples:
        point = point_of(s)
        entry = groups.setdefault((point, s["routing"], s["op"], s["mode"]), {})
        times, notes = entry.setdefault("times", {}), entry.setdefault("notes", {})
        kept = [g for g in s["groups_us"] or () if g is not None]
        if kept:
            times.setdefault(s["arm"], []).append(statistics.median(kept))
        if s.get("note"):
            notes.setdefault(s["arm"], s["note"])
    order = {p: i for i, p in enumerate(dict.fromkeys(k[0] for k in groups))}
    key = lambda k: (plan_rule.MODES.index(k[3]), order[k[0]], ROUTINGS.index(k[1]), OPS.index(k[2]))
    rows = []
    for point, routing, op, mode in sorted(groups, key=key):
        entry = groups[point, routing, op, mode]
        us = {arm: statistics.median(v) for arm, v in entry["times"].items()}
        row = {"GPU": header["gpu"], "SMs": header["sms"] or "n/a", "G": point.groups, "M": point.rows}
        row.update({"d_in -> d_out": f"{point.d_in} -> {point.d_out}", "w": point.out, "routing": routing})
        row.update(op=op, mode=mode)
        for arm in [*arms, CUDNN_PARTNER]:
            if arm in us:
                row[f"{arm} us"] = us[arm]
                row[f"{arm} TFLOP/s"] = point.flops(op) / us[arm] / 1e6
        for arm in arms:
            if arm != "jax_cake" and us.get(arm) and us.get("jax_cake"):
                row[f"{arm}/jax_cake"] = us[arm] / us["jax_cake"]
        row["status"] = "; ".join(f"{a}: {n}" for a, n in entry["notes"].items()) or "ok"
        rows.append(row)
    return rows


def routing_lines(samples: Sequence[dict]) -> list[str]:
    seen = {}
    for s in samples:
        if "sizes" in s:
            seen.setdefault((s["groups"], s["rows"], s["routing"]), s["sizes"])
    return [f"- G={g}, M={m}, {r}: {describe_routing(sizes)}" for (g, m, r), sizes in seen.items()]


def geomean_lines(rows: Sequence[dict]) -> list[str]:
    def ratios(picked):
        return dict.fromkeys(c for r in picked for c in r if c.endswith("/jax_cake"))

    return harness.geomean_lines(rows, OPS, ratios)


def report(header: dict, samples: Sequence[dict]) -> harness.Report:
    arms = list(FLAGS.arms)
    rows = table_rows(header, samples, arms)
    cols = columns(arms)
    note = "; here new = jax_cake (grouped_projection). TFLOP/s: the useful FLOPs, 2 M d_in d_out per GEMM."
    if "xla_cudnn" in arms:
        note += " xla_cudnn ran in processes of its own" + (f", beside {CUDNN_PARTNER}." if "dense" in arms else ".")
    text = [harness.header_line(header) + note, "", "Routings:", *routing_lines(samples), ""]
    geomeans = geomean_lines(rows)
    if geomeans:
        text += ["Geomeans over rows (range in parentheses):", *geomeans, ""]
    text += md.dict_table(cols, rows)
    wrong = sorted({f"{s['arm']} at {s['routing']} {point_of(s).label}" for s in samples if s.get("wrong")})
    failed = f"wrong values: {', '.join(wrong)}" if wrong else ""
    return harness.Report("\n".join(text) + "\n", cols, rows, failed)


def check() -> None:
    harness.selected("ops", OPS)
    harness.selected("arms", ARMS)
    harness.selected("routings", ROUTINGS)
    if not FLAGS.arms:
        raise app.UsageError("--arms: give at least one arm (--family=grouped)")
    points()


FAMILY = harness.Family(
    "grouped",
    "grouped_projection (MoE experts) against XLA's, cuDNN's and tokamax's ragged dot and a dense GEMM",
    READS,
    {"ops": list(OPS), "arms": list(ARMS), "out_dtype": ["float32"], "runs": 1, "groups": 5, "steps": 2},
    child,
    report,
    check,
    parent=parent,
)
