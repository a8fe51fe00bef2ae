"""The grouped kernels' tiles and tile walks, each GEMM role alone: the measurement behind
the grouped plans' tile and raster rules (docs/planner.md).

    python -m benchmarks.grouped_walks                      # on the GPU: the grouped family's six points
    python -m benchmarks.grouped_walks --moe_points=16384:8:14336:4096 --rounds=7
    python -m benchmarks.grouped_walks --roles=fwd,dgrad         # the roles with several tiles

Per point (balanced routing, the grouped family's operands laid out before timing, as its
`kernels` arm), every compiled grouped variant of each role (fwd, dgrad, FP32 wgrad) runs
under `planner.force(tile=..., raster=...)` for each walk of WALKS. Timing: `--rounds`
rounds, in each every configuration once (a warm call, then `--reps` calls timed together
on the host clock), the configurations interleaved; the median over rounds is printed.
Values, before timing: every configuration's result in the rows' order (y and dx gathered
back through the layout; the laid-out buffer's tiles past the groups are never written) is
bitwise equal to the first walk of its tile, and within bf16 rounding (1e-2 relative) of
the default plan's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

from absl import app, flags

from benchmarks import markdown as md
from benchmarks.families import grouped as family

FLAGS = flags.FLAGS
ROLES = ("fwd", "dgrad", "wgrad")
WALKS = {"fwd": ("m", "m8", "m4"), "dgrad": ("m", "m8", "m4"), "wgrad": ("m", "m16", "m8")}
REL_TOL = 1e-2


def configurations(roles: Sequence[str] = ROLES) -> list[tuple[str, tuple[int, int, int], str]]:
    """(role, tile, walk) of every compiled grouped variant of each role and every walk."""
    from jax_cake.planner import grouped as grouped_planner

    out = []
    for role in roles:
        out_dtype = "float32" if role == "wgrad" else "bfloat16"
        for tile in grouped_planner.kernel_tiles(f"grouped_{role}", out_dtype):
            out += [(role, tile, walk) for walk in WALKS[role]]
    return out


def relative(a, b) -> float:
    """||a - b|| / ||b|| in float64 (numpy arrays or jax arrays)."""
    import numpy as np

    a, b = (np.asarray(v, np.float64) for v in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def check_values(results: dict, default: dict) -> list[str]:
    """The problems of results {(role, tile, walk): array in the rows' order}: not bitwise
    equal to its tile's first walk, or farther than REL_TOL from default {role: array}."""
    import numpy as np

    bad, first = [], {}
    for (role, tile, walk), value in results.items():
        value = np.asarray(value, np.float32)
        base = first.setdefault((role, tile), (walk, value))
        if not np.array_equal(value, base[1]):
            bad.append(f"{role} {tile[1]}:{walk} differs bitwise from {tile[1]}:{base[0]}")
        error = relative(value, np.asarray(default[role], np.float32))
        if error > REL_TOL:
            bad.append(f"{role} {tile[1]}:{walk} is {error:.1e} from the default plan's")
    return bad


def _step(role: str, tile, walk: str, shapes) -> Callable:
    """The role's kernel call on laid-out operands, planned inside a force block, as a jitted
    function of the kernels arm's (x, ws, dy) returning its result in the rows' order."""
    import jax

    from jax_cake.planner import force
    from jax_cake.primitives import gemm as gemm_lib

    rows, d_in, w_shape = shapes
    with force("det", tile=tile, raster=walk):
        plan = family.kernel_plans(rows, d_in, w_shape, "float32")[role]
    if (plan.tile, plan.raster) != (tuple(tile), walk):
        raise RuntimeError(
            f"{role}: planned {plan.tile} {plan.raster}, asked for {tile} {walk} (not on an sm_90a GPU?)"
        )

    def run(x, ws, dy):
        w, row_table, k_table, _ = ws
        if role == "fwd":
            out = gemm_lib.grouped_fwd(x, w, row_table, plan)
        elif role == "dgrad":
            out = gemm_lib.grouped_dgrad(dy, w, row_table, plan)
        else:
            out = gemm_lib.grouped_wgrad(dy, x, k_table, plan)
        return family.from_layout(family.KERNELS_ARM, ws, out)  # y, dx in the rows' order

    return jax.jit(run)


def measure(point, rounds: int, reps: int, roles: Sequence[str] = ROLES) -> tuple[dict, list[str]]:
    """{(role, tile, walk): median us} at one point, and the value problems found."""
    import jax

    inputs = family.make_inputs(point, 0)
    sizes = family.group_sizes("balanced", point.rows, point.groups)
    x, ws, dy = family.arm_operands(family.KERNELS_ARM, inputs, sizes)
    args = (x, ws, dy)
    w, dest = ws[0], ws[3]
    shapes = (dest.shape[0], x.shape[1], w.shape)
    steps = {c: _step(*c, shapes) for c in configurations(roles)}
    results = {c: jax.block_until_ready(f(*args)) for c, f in steps.items()}
    plans = family.kernel_plans(*shapes, "float32")  # the default plans: among the configurations
    bad = check_values(results, {role: results[(role, plans[role].tile, plans[role].raster)] for role in roles})
    times: dict = {c: [] for c in steps}
    for _ in range(rounds):
        for c, f in steps.items():
            jax.block_until_ready(f(*args))
            t0 = time.perf_counter()
            for _ in range(reps):
                out = f(*args)
            jax.block_until_ready(out)
            times[c].append((time.perf_counter() - t0) / reps * 1e6)
    return {c: statistics.median(v) for c, v in times.items()}, bad


def table(point_label: str, medians: dict) -> list[str]:
    """One markdown table: a row per (role, tile), a column per walk."""
    walks = list(dict.fromkeys(w for role in ROLES for w in WALKS[role]))
    rows = []
    for role, tile in dict.fromkeys((r, t) for r, t, _ in medians):
        cells = {w: f"{medians[(role, tile, w)]:.0f}" for w in walks if (role, tile, w) in medians}
        rows.append([role, f"{tile[0]} x {tile[1]}", *(cells.get(w, "") for w in walks)])
    return [f"{point_label}, median us:", "", *md.table(["role", "tile", *walks], rows)]


def main(argv: Sequence[str]) -> None:
    del argv
    if not FLAGS.roles or set(FLAGS.roles) - set(ROLES):
        raise app.UsageError(f"--roles: {FLAGS.roles} must be a non-empty subset of {list(ROLES)}")
    import jax

    from jax_cake import native

    if jax.devices()[0].platform != "gpu":
        raise app.UsageError("grouped_walks times the grouped kernels: it needs an sm_90a GPU and the built library")
    native.ensure_registered()
    print(
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    failed = False
    for point in family.parse_points(FLAGS.moe_points, ["float32"]):
        medians, bad = measure(point, FLAGS.rounds, FLAGS.reps, FLAGS.roles)
        print("\n".join(["", *table(point.label, medians), *(f"BAD {b}" for b in bad)]), flush=True)
        failed |= bool(bad)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    flags.DEFINE_list("moe_points", list(family.DEFAULT_POINTS), "M:G:d_in:d_out points (M = routed rows).")
    flags.DEFINE_integer("rounds", 5, "Interleaved rounds; the median over them is printed.")
    flags.DEFINE_integer("reps", 5, "Calls timed together in each round.")
    flags.DEFINE_list("roles", list(ROLES), f"The GEMM roles to time, from {ROLES}.")
    app.run(main)
