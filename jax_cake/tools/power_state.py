"""One GEMM's device time back to back and between memory-bound passes, per arm.

    python -m jax_cake.tools.power_state --md=$OUT/power_state.md     # H200: about a minute

A compute-bound GEMM on the H200 runs at the GPU's power cap: back-to-back launches hold
the clock down, a memory-bound pass between them lets it recover (a training step is the
second case). So one kernel's time depends on what runs around it, and a comparison of two
kernels holds only under the same conditions. For each GEMM of `--gemms` (op:d_in:d_out[:w_dtype]
at T = `--tokens`, w_dtype the wgrad output) and each arm of `--arms` (jax_cake.tools.bench's syntax: xla, det/...),
the jitted op runs `--launches` times back to back, then `--launches` times each followed
by a pass over a `--pass_mb` buffer (bench.flush: a read and a write of it), each under one
CUPTI trace. An arm's time is the median over launches of its kernels' summed time in a
launch (the pass's kernels left out); the table gives both, and XLA's time over each arm's
in the same state. Needs a GPU: a CPU has no device timeline.
"""

from __future__ import annotations

import statistics
from typing import Sequence

from absl import app, flags

from jax_cake.tools import bench
from jax_cake.tools import markdown as md

FLAGS = flags.FLAGS
DEFAULT_GEMMS = ("dgrad:14336:4096", "fwd:4096:14336")
DEFAULT_ARMS = ("xla", "det/t128x256x64/tiles/c2", "det/t128x192x64/pp/c2")
STATES = ("back to back", "between passes")


GEMM_OPS = ("fwd", "dgrad", "wgrad")
W_DTYPES = ("bfloat16", "float32")


def parse_gemm(text: str) -> tuple[str, int, int, str]:
    """(op, d_in, d_out, w dtype) of an "op:d_in:d_out[:w_dtype]", op one of GEMM_OPS and
    w_dtype (the wgrad output: bfloat16, the default, or float32) one of W_DTYPES."""
    op, *dims = text.split(":")
    dtype = dims.pop() if len(dims) == 3 else "bfloat16"
    if (
        op not in GEMM_OPS
        or len(dims) != 2
        or not all(d.isdigit() and int(d) > 0 for d in dims)
        or dtype not in W_DTYPES
    ):
        raise ValueError(f"--gemms: {text!r} is not {'|'.join(GEMM_OPS)}:d_in:d_out[:{'|'.join(W_DTYPES)}]")
    return op, int(dims[0]), int(dims[1]), dtype


def per_launch_us(events: Sequence[tuple[int, int, str]], skip: set[str], kernels_per_launch: int) -> list[float]:
    """Each launch's summed kernel time (us), from the (start_ns, end_ns, name) events of
    launches in time order that each bring `kernels_per_launch` kernels besides those whose
    base name is in `skip`."""
    durations = [(end - start) / 1e3 for start, end, name in events if bench.base_kernel_name(name) not in skip]
    if kernels_per_launch < 1 or len(durations) % kernels_per_launch:
        raise RuntimeError(f"{len(durations)} kernels do not split into launches of {kernels_per_launch}")
    return [sum(durations[i : i + kernels_per_launch]) for i in range(0, len(durations), kernels_per_launch)]


def _traced(call, launches: int) -> list[tuple[int, int, str]]:
    import jax

    session = bench.ProfileSession()
    for _ in range(launches):
        out = call()
    jax.block_until_ready(out)
    return bench.device_events(session.stop())[0]


def measure(
    op: str, d_in: int, d_out: int, w_dtype: str, arms: Sequence[str], tokens: int, launches: int, pass_mb: int
) -> dict:
    """{arm: {state: median us}} of one GEMM (module docstring)."""
    import jax

    point = bench.Point(tokens, d_in, d_out, w_dtype)
    buf, x, w, dy = bench.make_inputs(point, pass_mb)
    pass_only = jax.jit(bench.flush)
    jax.block_until_ready(pass_only(buf))
    pass_names = {bench.base_kernel_name(n) for _, _, n in _traced(lambda: pass_only(buf), 1)}
    out = {}
    for name in arms:
        arm = bench.parse_arm(name)
        fn = bench.op_fn(op, bench.jax_projection(arm))

        def then_pass(buf, x, w, dy, fn=fn):
            y = fn(x, w, dy)
            return y, bench.flush(jax.lax.optimization_barrier((y, buf))[1])

        with bench.planning_for(arm):
            alone = jax.jit(fn).lower(x, w, dy).compile()
            paired = jax.jit(then_pass).lower(buf, x, w, dy).compile()
        jax.block_until_ready((alone(x, w, dy), paired(buf, x, w, dy)))  # warm up
        per_launch = len(_traced(lambda: alone(x, w, dy), 1))
        times = {
            STATES[0]: per_launch_us(_traced(lambda: alone(x, w, dy), launches), set(), per_launch),
            STATES[1]: per_launch_us(_traced(lambda: paired(buf, x, w, dy), launches), pass_names, per_launch),
        }
        out[name] = {state: statistics.median(t) for state, t in times.items()}
    return out


def table(results: dict[tuple[str, int, int], dict], header: str = "") -> str:
    """Markdown: per GEMM and arm the time in each state and XLA's time over the arm's."""
    columns = ["GEMM", "arm", *(f"{s} (us)" for s in STATES), *(f"XLA / arm, {s}" for s in STATES)]
    rows = []
    for (op, d_in, d_out, w_dtype), arms in results.items():
        xla = arms.get("xla")
        gemm = f"{op} {d_in} -> {d_out}" + (f" ({w_dtype} dw)" if op == "wgrad" else "")
        for arm, t in arms.items():
            ratios = [f"{xla[s] / t[s]:.3f}" if xla and arm != "xla" else "" for s in STATES]
            rows.append([gemm, arm, *(f"{t[s]:.0f}" for s in STATES), *ratios])
    lines = [header, ""] if header else []
    return "\n".join(lines + md.table(columns, rows)) + "\n"


def main(argv):
    del argv
    import jax

    gemms = [parse_gemm(g) for g in FLAGS.gemms]
    arms = list(FLAGS.arms)
    for a in arms:
        bench.parse_arm(a)  # a bad arm fails before anything runs
    if jax.devices()[0].platform != "gpu":
        raise app.UsageError("power_state needs a GPU: a CPU has no device timeline")
    results = {g: measure(*g, arms, FLAGS.tokens, FLAGS.launches, FLAGS.pass_mb) for g in gemms}
    text = table(results, f"power_state: {jax.devices()[0].device_kind}, jax {jax.__version__}, T={FLAGS.tokens}, "
                 f"{FLAGS.launches} launches per state, {FLAGS.pass_mb} MiB pass")
    print(text)
    if FLAGS.md:
        with open(FLAGS.md, "w") as f:
            f.write(text)


if __name__ == "__main__":
    flags.DEFINE_list("gemms", list(DEFAULT_GEMMS), "op:d_in:d_out[:w_dtype] GEMMs (op fwd, dgrad or wgrad).")
    flags.DEFINE_list("arms", list(DEFAULT_ARMS), "Arms in jax_cake.tools.bench's syntax (xla first for the ratios).")
    flags.DEFINE_integer("tokens", 8192, "T.")
    flags.DEFINE_integer("launches", 300, "Launches per state.")
    flags.DEFINE_integer("pass_mb", 1536, "The memory-bound pass's buffer (MiB) between launches.")
    flags.DEFINE_string("md", None, "Write the table here.")
    app.run(main)
