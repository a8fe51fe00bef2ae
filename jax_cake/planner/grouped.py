"""Plans of the grouped (ragged) GEMMs: grouped_projection's and ragged_dot's MoE experts.

The three GEMMs of a grouped projection (x [M, d_in] with its rows sorted by group, w
[G, d_out, d_in], group_sizes [G] a run-time array), as Plan's op, m, n, k:

    grouped_fwd    y [M, d_out] = x . w[g]^T per group of rows      m = M,     n = d_out, k = d_in
    grouped_dgrad  dx [M, d_in] = dy . w[g] per group of rows        m = M,     n = d_in,  k = d_out
    grouped_wgrad  dw [G, d_out, d_in] = dy[g]^T . x[g], K ragged    m = d_out, n = d_in,  k = M

with Plan.groups = G. The group sizes are known only when the step runs, so a plan is
made for the static sizes alone: M / G rows per group is what the explanation can say
about the work of one group. No grouped kernel is built in this version of jax_cake, so
every grouped plan is the XLA path (reference.grouped_*: lax.ragged_dot_general with an
FP32 result rounded once); a kernel plan will take its place here, under the same ops and
the same API.
"""

from __future__ import annotations

import logging
import os

from jax_cake import logs
from jax_cake.planner import device as device_lib
from jax_cake.planner.plan_type import Plan

_XLA_RAGGED = "XLA's ragged dot (lax.ragged_dot_general) with an FP32 result rounded once, the same semantics"
NO_KERNEL = f"no grouped (ragged) GEMM kernel is built in this version of jax_cake: {_XLA_RAGGED}"


def gemm_dims(op: str, tokens, d_in, d_out) -> tuple:
    """(m, n, k) of grouped op `op` (the module docstring's table)."""
    if op == "grouped_fwd":
        return tokens, d_out, d_in
    if op == "grouped_dgrad":
        return tokens, d_in, d_out
    return d_out, d_in, tokens


def plan_grouped(
    op: str,
    *,
    tokens,
    groups,
    d_in,
    d_out,
    out_dtype: str,
    dev: device_lib.DeviceInfo,
    symbolic=(),
    program_pin: str | None = None,
) -> Plan:
    """The Plan of grouped op `op` on validated sizes (jax_cake.planner.choose.plan checks
    them): the XLA path, with the reason. program_pin: a force block's program."""
    m, n, k = gemm_dims(op, tokens, d_in, d_out)
    if program_pin == "xla":
        reason = "forced by jax_cake.planner.force"
    elif os.environ.get("JAX_CAKE_DISABLE", "") not in ("", "0"):
        reason = f"JAX_CAKE_DISABLE is set: {_XLA_RAGGED}"
    elif symbolic:
        reason = f"symbolic {', '.join(symbolic)} (a shape-polymorphic export): {_XLA_RAGGED}"
    else:
        reason = NO_KERNEL
    if dev.platform == "cuda":  # a GPU user expects the kernels: say once why not
        logs.once(logging.WARNING, "jax_cake: on %s the grouped GEMMs run the XLA path: %s", dev.describe(), reason)
    return Plan(
        op=op,
        backend="xla",
        batch=1,
        m=m,
        n=n,
        k=k,
        out_dtype=out_dtype,
        device=dev.describe(),
        reason=reason,
        groups=groups,
    )


def describe_gemm(p: Plan) -> str:
    """The first line of explain() for a grouped plan: the GEMM, its groups and the rows
    (for grouped_wgrad the tokens of K) a group holds on average, M / G."""
    wgrad = p.op == "grouped_wgrad"
    tokens, what = (p.k, "tokens") if wgrad else (p.m, "rows")
    if isinstance(tokens, int) and p.groups:
        per_group = f", M / G = {tokens / p.groups:.1f} {what} per group expected"
    else:
        per_group = ""
    on = f"{p.out_dtype} out, on {p.device}"
    if wgrad:
        gemm = f"{p.op}: C[{p.groups}x{p.m}x{p.n}] (one per group)"
        return f"{gemm} over the K={p.k} tokens in {p.groups} groups{per_group}, {on}"
    return f"{p.op}: C[{p.m}x{p.n}] over K={p.k}, its {p.m} rows in {p.groups} groups{per_group}, {on}"
