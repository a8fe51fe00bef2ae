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
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_cake import primitives, reference
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
    r_spec: P | None = None  # the residual's spec under Explicit axes (dr's sharding type)


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


def _forward(x3, w_bf16, r3, options: Options):
    plan, _, _ = plans(x3, w_bf16, options)
    if options.layout == "kn":
        return primitives.dgrad(x3, w_bf16, plan)
    return primitives.fwd(x3, w_bf16, plan, out_sharding=options.out_request, add_to=r3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _projection(x3, w3, r3, acc3, options: Options):
    del acc3  # the forward ignores the running sum: only its cotangent carries it
    return _forward(x3, w3.astype(_BF16), r3, options)


def _projection_fwd(x3, w3, r3, acc3, options):
    w_bf16 = w3.astype(_BF16)
    return _forward(x3, w_bf16, r3, options), (x3, w_bf16, acc3)


def _projection_bwd(options, saved, dy):
    x3, w_bf16, acc3 = saved
    _, input_plan, weight_plan = plans(x3, w_bf16, options)
    dy = dy.astype(_BF16)
    det = options.deterministic
    # Under Explicit axes each gradient is asked for in its primal's sharding (for an
    # FSDP weight that makes the data-parallel sum of dw a reduce-scatter).
    x_spec, w_spec = partitioning.explicit_specs(x3, w_bf16) or (None, None)
    if options.layout == "kn":
        dx = primitives.fwd(dy, w_bf16, input_plan, out_sharding=x_spec)
        dw = primitives.wgrad(x3, dy, weight_plan, deterministic=det, out_sharding=w_spec)
    else:
        dx = primitives.dgrad(dy, w_bf16, input_plan, out_sharding=x_spec)
        if options.accumulate:
            dw = primitives.wgrad(dy, x3, weight_plan, add_to=acc3)
        else:
            dw = primitives.wgrad(dy, x3, weight_plan, deterministic=det, out_sharding=w_spec)
    if options.accumulate:  # the new running sum is acc's cotangent; w's is a symbolic zero
        dx, new_sum = partitioning.as_primal_types((dx, dw), (x3, acc3))
        dw = None
    else:
        dx, dw = partitioning.as_primal_types((dx, dw), (x3, w_bf16))
        new_sum = None
    # y = r + x w^T: r's cotangent is dy, in r's sharding type under Explicit axes (dy has
    # y's). r_spec is static, so r itself is not kept alive for the backward (that would
    # cost the fused kernel its in-place add).
    dr = None
    if options.residual:
        dr = dy if options.r_spec is None else partitioning.reshard_to(dy, options.r_spec)
    return dx, dw, dr, new_sum


_projection.defvjp(_projection_fwd, _projection_bwd)


def project(x3, w3, *, deterministic: bool, residual=None, accumulator=None, out_request=None, layout: str = "nk"):
    """y3 [B, T, N] bf16: the projection of x3 [B, T, K] bf16 by w3 (bf16 or FP32 master;
    [B, N, K] for layout "nk", [B, K, N] for "kn"), on validated operands.

    residual: None or r3 [B, T, N] bf16, added in the forward GEMM's epilogue.
    accumulator: None or acc3 of w3's shape in FP32, the running sum of w's gradient that
      the weight-grad GEMM's epilogue adds into (its cotangent is acc3 + dw; w's is zero).
    out_request: None or the PartitionSpec asked of y3 (Explicit axes).
    Inside shard_map the operands are made varying over the same manual axes first.
    """
    x3, w3, *extra = partitioning.to_common_varying(*(v for v in (x3, w3, residual, accumulator) if v is not None))
    r3 = extra.pop(0) if residual is not None else None
    acc3 = extra.pop(0) if accumulator is not None else None
    r_spec = None
    if r3 is not None:
        specs = partitioning.explicit_specs(r3)
        r_spec = None if specs is None else P(*specs[0])
    options = Options(
        deterministic=deterministic,
        w_dtype=jnp.dtype(w3.dtype).name,
        layout=layout,
        residual=r3 is not None,
        accumulate=acc3 is not None,
        out_request=out_request,
        r_spec=r_spec,
    )
    return _projection(x3, w3, r3, acc3, options)


def add_residual(r, y):
    """bf16(r + y), the fused epilogue's rounding, as a separate add (where the residual
    does not go into the forward GEMM), r resharded to y's sharding under Explicit axes
    (the add of differently sharded operands is a type error there)."""
    if partitioning.explicit_mesh(r, y) is not None:
        r = partitioning.reshard_to(r, jax.typeof(y).sharding.spec)
    return reference.add_into(r, y)
