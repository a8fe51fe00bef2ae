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
y = 0 and dx = 0) are reference.grouped_sizes's, applied inside every GEMM. With `aligned`
(moe_mlp's rows, already in the grouped kernels' layout) the rows past the groups are
unspecified in the GEMMs' results, and h and the gated backward's dg, du are masked to 0
there. Plans are made at trace time from the static shapes and the device
(jax_cake.planner.grouped); the backward makes them again from the saved operands. Each GEMM role is itself a custom_vjp
whose backward is the other roles, so this backward can be differentiated (grad of grad).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_cake import contract, reference
from jax_cake.pipeline.fused import WIDE_D_OUT
from jax_cake.pipeline.sharded_vjp import sharded_vjp
from jax_cake.planner import device as device_lib
from jax_cake.planner.grouped import plan_grouped_gated
from jax_cake.primitives import grouped as gemms
from jax_cake.primitives import partitioning

_BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Options:
    """The static options of one grouped projection (hashable: a nondiff argument)."""

    deterministic: bool
    layout: str = "nk"  # "nk": w [G, d_out, d_in]; "kn": w [G, d_in, d_out] (lax.ragged_dot's rhs)
    aligned: bool = False  # x's rows laid out already (primitives.grouped.Call.aligned)


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
        y = gemms.dgrad(x, w, group_sizes, plan, deterministic=options.deterministic, aligned=options.aligned)
    else:
        y = gemms.fwd(x, w, group_sizes, plan, deterministic=options.deterministic, aligned=options.aligned)
    # w is kept as given (an FP32 master stays FP32: the backward's GEMMs round it to bf16,
    # and a second derivative's dw comes from the FP32 sum in w's dtype too)
    return y, (x, w, group_sizes)


def _backward(options: Options, specs, saved, dy):
    x, w, group_sizes = saved
    x_spec, w_spec, _ = specs
    _, input_plan, weight_plan = plans(x, w, options)
    dy = dy.astype(_BF16)
    det, aligned = options.deterministic, options.aligned
    if options.layout == "kn":
        dx = gemms.fwd(dy, w, group_sizes, input_plan, deterministic=det, out_spec=x_spec, aligned=aligned)
        dw = gemms.wgrad(x, dy, group_sizes, weight_plan, deterministic=det, out_spec=w_spec, aligned=aligned)
    else:
        dx = gemms.dgrad(dy, w, group_sizes, input_plan, deterministic=det, out_spec=x_spec, aligned=aligned)
        dw = gemms.wgrad(dy, x, group_sizes, weight_plan, deterministic=det, out_spec=w_spec, aligned=aligned)
    return dx, dw, None


_grouped = sharded_vjp(_forward, _backward)


def project_grouped(x, w, group_sizes, *, deterministic: bool, layout: str = "nk", aligned: bool = False):
    """y [M, N] bf16: the grouped projection of x [M, K] bf16 by w (bf16 or FP32 master;
    [G, N, K] for layout "nk", [G, K, N] for "kn") with group_sizes [G] int32, on validated
    operands. aligned: x's rows are laid out already (group_sizes a PaddedLayout's
    padded_sizes); y's rows past the groups are then unspecified."""
    return _grouped(Options(deterministic=deterministic, layout=layout, aligned=aligned), x, w, group_sizes)


# --- the gated option: the grouped forward GEMM's gated epilogue (MoE SwiGLU / GeGLU experts) --
#
# h = act(x Wg[g]^T) * (x Wu[g]^T) per group of rows, as pipeline/gated.py is for the dense
# projection: with W = the bf16 casts of Wg, Wu [G, F, d_in] interleaved by rows
# (reference.interleave along axis 1: [G, 2F, d_in]),
#
#   forward   ONE grouped fwd gu = x W[g]^T ([M, 2F] bf16, the pre-activation, named
#             remat.PREACTIVATION_NAME), h = reference.gate(g, u): bf16(act(g) * u) in FP32,
#             in the kernel's epilogue where the planner plans it
#             (planner.grouped.plan_grouped_gated), else an XLA pass right after the GEMM
#   backward  (dg, du) = reference.gate_grad(dh, g, u) from the saved gu; dx = ONE grouped
#             dgrad over K = 2F of [dg | du] interleaved; dWg, dWu: where F >= WIDE_D_OUT
#             (compute bound) one grouped wgrad per weight, from dg and du, straight into
#             its weight's dtype; narrower, ONE grouped wgrad over the 2F rows (FP32 where
#             either weight is FP32) split by rows, each cast to its weight's dtype. Each
#             dW entry is an FP32 sum over its group's rows rounded once either way, the
#             same bits where both weights share a dtype (a bf16 weight beside an FP32 one
#             gets the bf16 wgrad's sum, not the FP32 wgrad's two-level one); per weight,
#             no [G, 2F, d_in] buffer is written and then copied by the split, and XLA can
#             reuse each gradient's buffer (the MoE step's temp memory, docs/benchmarks.md)
#
# Rows past the groups get gu = 0, so h = act(0) * 0 = 0 and they add nothing to dW. The
# interleave's block is the gated kernel epilogue's (contract.GATE_BLOCK) where F is a
# multiple of it and nothing needs partitioning, else 1 (a d_ff shard then holds its gate
# and up rows); the values do not depend on it. The elementwise parts are plain JAX and
# every GEMM a differentiable role, so the backward can be differentiated (grad of grad;
# the fused forward is differentiated through its unfused form).


@dataclasses.dataclass(frozen=True)
class GatedOptions:
    """The static options of one grouped gated projection (hashable: a nondiff argument)."""

    deterministic: bool
    activation: str  # one of reference.ACTIVATIONS
    w_dtypes: tuple[str, str]  # w_gate's and w_up's dtype names: their gradients' dtypes
    block: int = 1  # the gate/up interleave's block (gated_block)
    aligned: bool = False  # x's rows laid out already (primitives.grouped.Call.aligned)


def gated_block(x, w_gate, w_up) -> int:
    """The gate/up interleave's block: contract.GATE_BLOCK where d_ff is a multiple of it and
    the operands need no partitioning (one device, or inside shard_map), else 1."""
    if w_gate.shape[1] % contract.GATE_BLOCK == 0 and partitioning.unpartitioned(x, w_gate, w_up):
        return contract.GATE_BLOCK
    return 1


def stack_gated(w_gate, w_up, block: int):
    """W [G, 2F, d_in] bf16: the weights' casts interleaved by rows within each group."""
    return reference.interleave(w_gate.astype(_BF16), w_up.astype(_BF16), 1, block)


def _gated_plans(x, w, options: GatedOptions):
    """(forward, input-grad, weight-grads) Plans over the stacked weight w [G, 2F, d_in].
    forward: with the gated epilogue where plan_grouped_gated allows it. weight-grads: where
    F >= WIDE_D_OUT one Plan per weight (over its F rows, in its dtype), else ONE over the
    2F rows, FP32 unless both weights are bf16."""
    device = device_lib.current(x, w)
    det, groups = options.deterministic, w.shape[0]
    d_gu_shape = (x.shape[0], w.shape[1])
    f = w.shape[1] // 2
    if f >= WIDE_D_OUT:
        wgrads = tuple(((x.shape[0], f), dtype) for dtype in options.w_dtypes)
    else:
        wgrads = ((d_gu_shape, "bfloat16" if options.w_dtypes == ("bfloat16", "bfloat16") else "float32"),)
    forward = gemms.plan_for("grouped_fwd", x.shape, w.shape, groups, device, deterministic=det)
    return (
        plan_grouped_gated(forward, options.activation, options.block),
        gemms.plan_for("grouped_dgrad", d_gu_shape, w.shape, groups, device, deterministic=det),
        tuple(
            gemms.plan_for("grouped_wgrad", dy_shape, x.shape, groups, device, out_dtype=dtype, deterministic=det)
            for dy_shape, dtype in wgrads
        ),
    )


def _in_groups(rows, group_sizes):
    """[rows, 1] bool: whether each row is in a group (its GEMM rows defined)."""
    return (jnp.arange(rows, dtype=jnp.int32) < jnp.sum(group_sizes))[:, None]


def _gated_forward(options: GatedOptions, x, w_gate, w_up, group_sizes):
    w = stack_gated(w_gate, w_up, options.block)
    plan, _, _ = _gated_plans(x, w, options)
    h, gu = gemms.fwd_gated(
        x, w, group_sizes, plan, options.activation, options.block, deterministic=options.deterministic,
        aligned=options.aligned,
    )
    if options.aligned:  # the rows past the groups were never written: h is 0 there
        h = jnp.where(_in_groups(h.shape[0], group_sizes), h, jnp.zeros((), h.dtype))
    return h, (x, w_gate, w_up, group_sizes, gu)


def _gated_backward(options: GatedOptions, specs, saved, dh):
    x, w_gate, w_up, group_sizes, gu = saved
    x_spec, wg_spec, wu_spec, _ = specs
    block, det, aligned = options.block, options.deterministic, options.aligned
    g, u = reference.deinterleave(gu, -1, block)
    dg, du = reference.gate_grad(dh.astype(_BF16), g, u, options.activation)
    if aligned:  # the rows past the groups hold unwritten gu: their cotangents are 0
        in_groups = _in_groups(dg.shape[0], group_sizes)
        dg, du = (jnp.where(in_groups, d, jnp.zeros((), d.dtype)) for d in (dg, du))
    d_gu = reference.interleave(dg, du, -1, block)
    w = stack_gated(w_gate, w_up, block)
    _, input_plan, weight_plans = _gated_plans(x, w, options)
    dx = gemms.dgrad(d_gu, w, group_sizes, input_plan, deterministic=det, out_spec=x_spec, aligned=aligned)
    if len(weight_plans) == 2:
        # Compute bound: one wgrad per weight, straight into its dtype and buffer (one wgrad
        # over 2F writes a [G, 2F, d_in] buffer that the split copies: 3.5 GiB in FP32 at
        # Mixtral's experts).
        dw_gate, dw_up = (
            gemms.wgrad(d, x, group_sizes, plan, deterministic=det, out_spec=spec, aligned=aligned)
            for d, plan, spec in zip((dg, du), weight_plans, (wg_spec, wu_spec))
        )
        return dx, dw_gate, dw_up, None
    out_spec = wg_spec if wg_spec == wu_spec else None
    (weight_plan,) = weight_plans
    dw = gemms.wgrad(d_gu, x, group_sizes, weight_plan, deterministic=det, out_spec=out_spec, aligned=aligned)
    dw_gate, dw_up = reference.deinterleave(dw, 1, block)
    return dx, dw_gate.astype(w_gate.dtype), dw_up.astype(w_up.dtype), None


_grouped_gated = sharded_vjp(_gated_forward, _gated_backward)


def project_grouped_gated(
    x, w_gate, w_up, group_sizes, *, activation: str, deterministic: bool, block=None, aligned: bool = False
):
    """h [M, F] bf16 = act(x Wg[g]^T) * (x Wu[g]^T) per group of rows, for validated x [M,
    d_in] bf16 (rows sorted by group), w_gate, w_up [G, F, d_in] (bf16 or FP32 masters) and
    group_sizes [G] int32. block: the interleave's (None: gated_block's). aligned: x's rows
    are laid out already (group_sizes a PaddedLayout's padded_sizes); h's rows past the
    groups are 0 either way."""
    options = GatedOptions(
        deterministic=deterministic,
        activation=activation,
        w_dtypes=(jnp.dtype(w_gate.dtype).name, jnp.dtype(w_up.dtype).name),
        block=gated_block(x, w_gate, w_up) if block is None else block,
        aligned=aligned,
    )
    return _grouped_gated(options, x, w_gate, w_up, group_sizes)
