"""The grouped projection pipeline (MoE experts): plans -> one custom_vjp -> the grouped GEMM
primitives (jax_cake.primitives.grouped).

x [M, d_in] bf16 with its rows sorted by group, w [G, d_out, d_in] bf16 or an FP32 master,
group_sizes [G] int32 (a run-time array):

    forward GEMM       y = x w[g]^T per group of rows            grouped fwd
    input-grad GEMM    dx = dy w[g] per group of rows            grouped dgrad
    weight-grad GEMM   dw[g] = dy[g]^T x[g], ragged in K         grouped wgrad, in w's dtype

Layouts, as the projection pipeline's: "nk" is w [G, d_out, d_in]; "kn" is
lax.ragged_dot's rhs [G, K, N] run as stored: with w_kn = [G, K, N], y = x w_kn[g] is the
grouped dgrad GEMM, dx = dy w_kn[g]^T the grouped fwd GEMM and dw_kn[g] = x[g]^T dy[g] the
grouped wgrad with its operands swapped.

The group sizes' rules (negative sizes count as 0, groups cut at M, rows past the sum get
y = 0 and dx = 0) are reference.grouped_sizes's, applied inside every GEMM. Plans are made
at trace time from the static shapes and the device (jax_cake.planner.grouped); the
backward makes them again from the saved operands. Each GEMM role is itself a custom_vjp
whose backward is the other roles, so this backward can be differentiated (grad of grad).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_cake.pipeline.sharded_vjp import sharded_vjp
from jax_cake.planner import device as device_lib
from jax_cake.primitives import grouped as gemms

_BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Options:
    """The static options of one grouped projection (hashable: a nondiff argument)."""

    deterministic: bool
    layout: str = "nk"  # "nk": w [G, d_out, d_in]; "kn": w [G, d_in, d_out] (lax.ragged_dot's rhs)


def plans(x, w, options: Options):
    """(forward, input-grad, weight-grad) Plans of the grouped projection of x by w."""
    m, groups = x.shape[0], w.shape[0]
    device = device_lib.current(x, w)
    det = options.deterministic
    w_dtype = jnp.dtype(w.dtype).name
    if options.layout == "kn":  # w [G, K, N]: y = dgrad(x, w), dx = fwd(dy, w), dw = wgrad(x, dy)
        n = w.shape[2]
        dy_shape = (m, n)
        return (
            gemms.plan_for("grouped_dgrad", x.shape, w.shape, groups, device, deterministic=det),
            gemms.plan_for("grouped_fwd", dy_shape, w.shape, groups, device, deterministic=det),
            gemms.plan_for("grouped_wgrad", x.shape, dy_shape, groups, device, out_dtype=w_dtype, deterministic=det),
        )
    dy_shape = (m, w.shape[1])
    return (
        gemms.plan_for("grouped_fwd", x.shape, w.shape, groups, device, deterministic=det),
        gemms.plan_for("grouped_dgrad", dy_shape, w.shape, groups, device, deterministic=det),
        gemms.plan_for("grouped_wgrad", dy_shape, x.shape, groups, device, out_dtype=w_dtype, deterministic=det),
    )


def _forward(options: Options, x, w, group_sizes):
    plan, _, _ = plans(x, w, options)
    if options.layout == "kn":
        y = gemms.dgrad(x, w, group_sizes, plan, deterministic=options.deterministic)
    else:
        y = gemms.fwd(x, w, group_sizes, plan, deterministic=options.deterministic)
    # w is kept as given (an FP32 master stays FP32: the backward's GEMMs round it to bf16,
    # and a second derivative's dw comes from the FP32 sum in w's dtype too)
    return y, (x, w, group_sizes)


def _backward(options: Options, specs, saved, dy):
    x, w, group_sizes = saved
    x_spec, w_spec, _ = specs
    _, input_plan, weight_plan = plans(x, w, options)
    dy = dy.astype(_BF16)
    det = options.deterministic
    if options.layout == "kn":
        dx = gemms.fwd(dy, w, group_sizes, input_plan, deterministic=det, out_spec=x_spec)
        dw = gemms.wgrad(x, dy, group_sizes, weight_plan, deterministic=det, out_spec=w_spec)
    else:
        dx = gemms.dgrad(dy, w, group_sizes, input_plan, deterministic=det, out_spec=x_spec)
        dw = gemms.wgrad(dy, x, group_sizes, weight_plan, deterministic=det, out_spec=w_spec)
    return dx, dw, None


_grouped = sharded_vjp(_forward, _backward)


def project_grouped(x, w, group_sizes, *, deterministic: bool, layout: str = "nk"):
    """y [M, N] bf16: the grouped projection of x [M, K] bf16 by w (bf16 or FP32 master;
    [G, N, K] for layout "nk", [G, K, N] for "kn") with group_sizes [G] int32, on validated
    operands."""
    return _grouped(Options(deterministic=deterministic, layout=layout), x, w, group_sizes)
