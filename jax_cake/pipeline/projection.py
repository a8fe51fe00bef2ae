"""The projection pipeline: plans -> one custom_vjp -> the GEMM primitives.

Every projection of jax_cake (dense_projection, batched_projection, the Flax layout of
jc.dot_general) is this one `jax.custom_vjp` over the batched GEMM convention
x [B, T, d_in], w [B, d_out, d_in] (or Flax's [B, d_in, d_out]). What varies between
them is static `Options`, and each option is an epilogue of one of the three GEMMs:

    forward GEMM       y = x w^T             residual: the "add" epilogue, y = r + x w^T
    input-grad GEMM    dx = dy w             (no option today)
    weight-grad GEMM   dw = dy^T x           accumulate: the "add" epilogue, acc + dw

The gated activation of a SwiGLU MLP is an epilogue of the forward GEMM of the gate/up
projection, and its gradient one of the input-grad GEMM of the down projection
(jax_cake.pipeline.gated, which runs both GEMMs of the MLP in one custom_vjp where the
kernels take them).

Layouts: "nk" is jax_cake's own w [d_out, d_in]; "kn" is Flax's kernel [d_in, d_out]
run without a transpose: with w_kn = [K, N], y = x w_kn is the dgrad GEMM, the input
gradient dy w_kn^T the fwd GEMM, and the weight gradient x^T dy the wgrad GEMM with its
operands swapped (docs/ffi_contract.md).

Plans are made at trace time from the static shapes and the device; the backward makes
them again from the saved operands (the same shapes, so the same plans).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_cake import primitives, reference
from jax_cake.pipeline.sharded_vjp import sharded_vjp
from jax_cake.planner import device as device_lib
from jax_cake.planner import plan as make_plan
from jax_cake.planner.accumulate import plan_accumulate
from jax_cake.planner.residual import plan_residual
from jax_cake.primitives import partitioning

_BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Options:
    """The static options of one projection (hashable: a nondiff argument)."""

    deterministic: bool
    w_dtype: str  # w's dtype name: the weight gradient is written in it
    layout: str = "nk"  # "nk": w [B, d_out, d_in]; "kn": w [B, d_in, d_out] (Flax's kernel)
    residual: bool = False  # the forward GEMM's add epilogue: y = r + x w^T, dr = dy
    accumulate: bool = False  # the weight-grad GEMM's add epilogue: d(acc) = acc + dw, dw = 0
    out_request: P | None = None  # the sharding asked of the forward GEMM's result


def plans(x3, w3, options: Options):
    """(forward, input-grad, weight-grad) plans of the projection of x3 by w3."""
    b, t, _ = x3.shape
    sizes = dict(tokens=t, d_in=w3.shape[2], d_out=w3.shape[1], batch=b, device=device_lib.current(x3, w3))
    weight = make_plan("wgrad", **sizes, out_dtype=options.w_dtype, deterministic=options.deterministic)
    if options.layout == "kn":  # the roles swapped: y = dgrad(x, w_kn), dx = fwd(dy, w_kn)
        return make_plan("dgrad", **sizes), make_plan("fwd", **sizes), weight
    forward = plan_residual(**sizes) if options.residual else make_plan("fwd", **sizes)
    if options.accumulate:
        weight = plan_accumulate(**sizes)
    return forward, make_plan("dgrad", **sizes), weight


def _forward(options: Options, x3, w3, r3, acc3):
    # The forward ignores the running sum (only its cotangent carries it, from the saved
    # buffer); r3 is not kept for the backward (that would cost the fused kernel its
    # in-place add).
    w_bf16 = w3.astype(_BF16)
    plan, _, _ = plans(x3, w_bf16, options)
    if options.layout == "kn":
        y = primitives.dgrad(x3, w_bf16, plan)
    else:
        y = primitives.fwd(x3, w_bf16, plan, out_sharding=options.out_request, add_to=r3)
    return y, (x3, w_bf16, acc3)


def _backward(options: Options, specs, saved, dy):
    x3, w_bf16, acc3 = saved
    x_spec, w_spec, _, acc_spec = specs
    _, input_plan, weight_plan = plans(x3, w_bf16, options)
    dy = dy.astype(_BF16)
    det = options.deterministic
    if options.layout == "kn":
        dx = primitives.fwd(dy, w_bf16, input_plan, out_sharding=x_spec)
        dw = primitives.wgrad(x3, dy, weight_plan, deterministic=det, out_sharding=w_spec)
    else:
        dx = primitives.dgrad(dy, w_bf16, input_plan, out_sharding=x_spec)
        if options.accumulate:
            dw = primitives.wgrad(dy, x3, weight_plan, add_to=acc3)
        else:
            dw = primitives.wgrad(dy, x3, weight_plan, deterministic=det, out_sharding=w_spec)
    # y = r + x w^T: r's cotangent is dy. With accumulate, the new running sum is acc's
    # cotangent and w's is a symbolic zero.
    dr = dy if options.residual else None
    if options.accumulate:
        return dx, None, dr, dw
    return dx, dw, dr, None


_projection = sharded_vjp(_forward, _backward)


def project(x3, w3, *, deterministic: bool, residual=None, accumulator=None, out_request=None, layout: str = "nk"):
    """y3 [B, T, N] bf16: the projection of x3 [B, T, K] bf16 by w3 (bf16 or FP32 master;
    [B, N, K] for layout "nk", [B, K, N] for "kn"), on validated operands.

    residual: None or r3 [B, T, N] bf16, added in the forward GEMM's epilogue.
    accumulator: None or acc3 of w3's shape in FP32, the running sum of w's gradient that
      the weight-grad GEMM's epilogue adds into (its cotangent is acc3 + dw; w's is zero).
    out_request: None or the PartitionSpec asked of y3 (Explicit axes).
    """
    options = Options(
        deterministic=deterministic,
        w_dtype=jnp.dtype(w3.dtype).name,
        layout=layout,
        residual=residual is not None,
        accumulate=accumulator is not None,
        out_request=out_request,
    )
    return _projection(options, x3, w3, residual, accumulator)


def add_residual(r, y):
    """bf16(r + y), the fused epilogue's rounding, as a separate add (where the residual
    does not go into the forward GEMM), r resharded to y's sharding under Explicit axes
    (the add of differently sharded operands is a type error there)."""
    if partitioning.explicit_mesh(r, y) is not None:
        r = partitioning.reshard_to(r, jax.typeof(y).sharding.spec)
    return reference.add_into(r, y)
