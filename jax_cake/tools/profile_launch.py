"""One launch of one GEMM arm inside a profiler range, for Nsight Compute.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        --section WarpStateStats --section MemoryWorkloadAnalysis -o OUT/fwd_xla \\
        python -m jax_cake.tools.profile_launch --gemm=fwd:4096:14336 --arm=xla

The arm (jax_cake.tools.bench's syntax: xla, det/t128x160x64/pp/c2, ...) is compiled for the
GEMM (op:d_in:d_out[:w_dtype] at T = --tokens, as power_state's --gemms), run --warmup times
(autotuning, lazy loading and the first launch stay outside the range), then launched once
between cuProfilerStart and cuProfilerStop (jax_cake.tools.cuda_driver), so a profiler
started with --profile-from-start off sees exactly that launch's kernels. XLA's command
buffers are turned off (before the backend starts) so its kernels launch one by one, as
ncu profiles them. Needs a GPU.
"""

from __future__ import annotations

import os
import re
from typing import Callable

from absl import app, flags

FLAGS = flags.FLAGS


def launch_in_range(call: Callable, warmup: int, start: Callable, stop: Callable):
    """call() warmup times, then once between start() and stop(); each result is waited on
    (jax.block_until_ready) before the next step. Returns the profiled call's result."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(call())
    start()
    try:
        out = jax.block_until_ready(call())
    finally:
        stop()
    return out


def compiled_call(gemm: str, arm_name: str, tokens: int) -> tuple[Callable, str]:
    """(a no-argument call of the arm's compiled op, the custom call or cuBLAS target its
    optimized HLO holds, for the log)."""
    import jax

    from jax_cake.tools import bench, power_state

    op, d_in, d_out, w_dtype = power_state.parse_gemm(gemm)
    arm = bench.parse_arm(arm_name)
    _, x, w, dy = bench.make_inputs(bench.Point(tokens, d_in, d_out, w_dtype), 1)
    fn = bench.op_fn(op, bench.jax_projection(arm))
    with bench.planning_for(arm):
        compiled = jax.jit(fn).lower(x, w, dy).compile()
    targets = sorted(set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())))
    return (lambda: compiled(x, w, dy)), ", ".join(targets) or "no custom call (an XLA fusion)"


def main(argv):
    del argv
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    import jax

    from jax_cake.tools import cuda_driver

    if jax.devices()[0].platform != "gpu":
        raise app.UsageError("profile_launch needs a GPU: it brackets one GPU launch for a profiler")
    call, targets = compiled_call(FLAGS.gemm, FLAGS.arm, FLAGS.tokens)
    start, stop = cuda_driver.profiler_range()
    launch_in_range(call, FLAGS.warmup, start, stop)
    print(f"profiled one launch of {FLAGS.gemm} ({FLAGS.arm}, T={FLAGS.tokens}): {targets}")


if __name__ == "__main__":
    flags.DEFINE_string("gemm", "fwd:4096:14336", "op:d_in:d_out[:w_dtype], as power_state's --gemms.")
    flags.DEFINE_string("arm", "xla", "The arm, in jax_cake.tools.bench's syntax.")
    flags.DEFINE_integer("tokens", 8192, "T.")
    flags.DEFINE_integer("warmup", 3, "Un-profiled launches first.")
    app.run(main)
