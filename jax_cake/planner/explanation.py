"""`explain(plan)`: a Plan in plain words (what runs, and why)."""

from __future__ import annotations

from jax_cake.planner.grouped import describe_gemm
from jax_cake.planner.grouped import GATED_OP
from jax_cake.planner.plan_type import GROUPED_OPS, Plan


def explain(p: Plan) -> str:
    """Plain words: which kernel program and algorithm run for this Plan, and why."""
    if not isinstance(p, Plan):
        raise TypeError(f"explain: p must be a Plan (jax_cake.plan's result), got {type(p).__name__}")
    if p.op in GROUPED_OPS or p.op == GATED_OP:
        gemm = describe_gemm(p)
    else:
        gemm = f"{p.op}: C[{p.batch}x{p.m}x{p.n}] over K={p.k}, {p.out_dtype} out, on {p.device}"
    if not p.uses_kernel:
        return f"{gemm}\n  runs the XLA path: {p.reason}"
    tm, tn, tk = p.tile
    lines = [
        gemm,
        f"  runs the jax_cake {p.backend} {p.op} kernels, '{p.algorithm}' algorithm: {tm}x{tn}x{tk} tiles, "
        f"cluster {p.cluster[0]}x{p.cluster[1]}, {p.splits} split(s), {p.ctas} CTAs, reduction {p.reduction}, "
        f"{p.schedule} schedule, workspace {p.workspace_bytes} bytes",
        f"  bitwise reproducible: {'yes' if p.deterministic else 'no'}",
        f"  why: {p.reason}",
    ]
    return "\n".join(lines)
