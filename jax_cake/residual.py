"""The residual add in the forward GEMM: `residual=` of the projections.

    h = jax_cake.dense_projection(a, w_o, residual=h)   # h + a @ w_o.T, one kernel

A transformer block adds the output of its o and down projections to the residual
stream. Written as `r + dense_projection(x, w)`, the GEMM writes y and a separate
elementwise pass reads y and r and writes the sum. Here the forward kernel adds each
finished tile into r's buffer instead (jax_cake_fwd_residual; r is aliased to the
result, so under jit with r donated, or r an intermediate, the sum is made in place): no
separate pass. XLA does the same for `r + jnp.dot(x, w.T)` (cuBLASLt with beta = 1 and
the output aliased to r).

Numerics: y = bf16(r + bf16(x w^T)). The kernel rounds its FP32 tile to bf16 in shared
memory, then the TMA unit adds it to r in bf16 with one more round to nearest: the value
of the unfused `r + dense_projection(x, w)` (bitwise, up to the GEMM's own FP32 sum
order), and within one bf16 rounding of bf16(r + x w^T) (XLA's fused add, which rounds
once). The reference path (CPU, XLA plans) computes the same double rounding, so every
path of the op gives the unfused op's values. One pass over K, one add per element:
bitwise reproducible.

Gradients: as the projection's for x and w; r's cotangent is dy itself (y = r + ...).
The output keeps the checkpoint name of the other ops (jax_cake.remat).

Where the fused call does not apply it computes the forward and a separate add, with the
same values: no reduce-add variant fits the tiles (the planner logs it once), a mesh of
several devices outside shard_map (the fused call has no partitioning rule; the
forward's rule partitions it and the add follows), or `grad_accumulator=` /
`out_sharding=` given together with `residual=`. Under vmap the vmapped axis folds into
the kernel's tokens or batch axis (as jax_cake.batching does for the other GEMMs).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from jax_cake import api, primitives, reference, remat
from jax_cake.contract import FWD_RESIDUAL_TARGET
from jax_cake.planner import Plan
from jax_cake.planner import device as device_lib
from jax_cake.planner import plan as make_plan
from jax_cake.planner.residual import plan_residual

_F32, _BF16 = jnp.float32, jnp.bfloat16

# --- the primitive ----------------------------------------------------------------------


def add_residual(r, y):
    """bf16(r + y) for bf16 r and y: the separate add, with the fused kernel's rounding."""
    return (r.astype(_F32) + y.astype(_F32)).astype(_BF16)


def _unpartitioned() -> bool:
    """Whether the fused custom call may run as it is: one device, no mesh of more than
    one device set, or inside shard_map over every mesh axis (the operands are the shards)."""
    mesh = jax.sharding.get_abstract_mesh()
    if jax.device_count() == 1 or mesh.empty or mesh.size == 1:
        return True
    return all(t == jax.sharding.AxisType.Manual for t in mesh.axis_types)


def _sizes(x, w) -> dict:
    return dict(tokens=x.shape[1], d_in=x.shape[2], d_out=w.shape[1], batch=x.shape[0])


def _direct(x, w, r, plan: Plan):
    """fwd_residual on unbatched operands (no vmap rule here)."""
    if plan.op != "fwd_residual" or not _unpartitioned():
        if plan.op == "fwd_residual":
            plan = make_plan("fwd", **_sizes(x, w), device=device_lib.current(x, w))
        return add_residual(r, primitives.fwd(x, w, plan))
    b, t, _ = x.shape
    d_out = w.shape[1]

    def ref(x, w, r):
        return add_residual(r, reference.fwd(x, w))

    def cuda(x, w, r):
        result = primitives._result_type(r, (b, t, d_out), _BF16)
        # The custom_vmap rule below folds a vmapped axis away before this call.
        return primitives.ffi_call(FWD_RESIDUAL_TARGET, plan, result, x, w, r, input_output_aliases={2: 0})

    return primitives._dispatch(plan, ref, cuda, x, w, r)


def _fold(size: int, batched, x, w, r):
    """The vmapped residual GEMM (batched operands carry the vmapped axis V first) as one
    unbatched call: with w shared, V folds into the tokens ([V, B, T, K] -> [B, V*T, K]);
    with per-entry weights, into the batch axis."""
    x_b, w_b, r_b = batched
    if not w_b:
        x = x if x_b else jnp.broadcast_to(x, (size,) + x.shape)
        r = r if r_b else jnp.broadcast_to(r, (size,) + r.shape)
        lead, t = x.shape[1], x.shape[2]

        def tokens(v):
            return jnp.moveaxis(v, 0, 1).reshape(lead, size * t, v.shape[-1])

        x2, r2 = tokens(x), tokens(r)
        y = _call(x2, w, r2, plan_residual(**_sizes(x2, w), device=device_lib.current(x2, w)))
        return jnp.moveaxis(y.reshape(lead, size, t, y.shape[-1]), 1, 0)
    x = x if x_b else jnp.broadcast_to(x, (size,) + x.shape)
    r = r if r_b else jnp.broadcast_to(r, (size,) + r.shape)

    def merge(v):
        return v.reshape((v.shape[0] * v.shape[1],) + v.shape[2:])

    x2, w2, r2 = merge(x), merge(w), merge(r)
    y = _call(x2, w2, r2, plan_residual(**_sizes(x2, w2), device=device_lib.current(x2, w2)))
    return y.reshape((size, x.shape[1]) + y.shape[1:])


def _call(x, w, r, plan: Plan):
    @custom_vmap
    def gemm(x, w, r):
        return _direct(x, w, r, plan)

    @gemm.def_vmap
    def rule(axis_size, in_batched, x, w, r):
        return _fold(axis_size, tuple(in_batched), x, w, r), True

    return gemm(x, w, r)


def fwd_residual(x, w, r, plan: Plan):
    """y[B, T, d_out] bf16 = bf16(r + bf16(x[B, T, d_in] . w[B, d_out, d_in]^T)), bf16
    operands and residual r[B, T, d_out], FP32 accumulation.

    A kernel plan for op "fwd_residual" (`plan_residual`) runs jax_cake_fwd_residual
    with r aliased to the result (input_output_aliases {2: 0}): the kernel reduce-adds
    its bf16 tiles into r's buffer, no separate pass. A plan for op "fwd" (no reduce-add
    variant fits) runs that forward and an XLA add; an XLA plan, and any platform but
    CUDA, the reference with the same double rounding (the module docstring). Under a
    mesh of several devices (outside shard_map) the partitioned forward runs, then the
    add. Under vmap the vmapped axis folds into the tokens or the batch axis.
    """
    return _call(x, w, r, plan)


# --- the op ---------------------------------------------------------------------------------


def _plans(x3, w3, deterministic: bool, w_dtype: str):
    sizes = dict(_sizes(x3, w3), device=device_lib.current(x3, w3))
    return (
        plan_residual(**sizes),
        make_plan("dgrad", **sizes),
        make_plan("wgrad", **sizes, out_dtype=w_dtype, deterministic=deterministic),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _residual_projection(x3, w3, r3, deterministic: bool, w_dtype: str):
    plan, _, _ = _plans(x3, w3, deterministic, w_dtype)
    return fwd_residual(x3, w3.astype(_BF16), r3, plan)


def _residual_fwd(x3, w3, r3, deterministic, w_dtype):
    w_bf16 = w3.astype(_BF16)
    plan, _, _ = _plans(x3, w3, deterministic, w_dtype)
    return fwd_residual(x3, w_bf16, r3, plan), (x3, w_bf16)


def _residual_bwd(deterministic, w_dtype, residuals, dy):
    x3, w_bf16 = residuals
    _, dgrad_plan, wgrad_plan = _plans(x3, w_bf16, deterministic, w_dtype)
    dy = dy.astype(_BF16)
    x_spec, w_spec = api._explicit_specs(x3, w_bf16) or (None, None)
    dx = primitives.dgrad(dy, w_bf16, dgrad_plan, out_sharding=x_spec)
    dw = primitives.wgrad(dy, x3, wgrad_plan, deterministic=deterministic, out_sharding=w_spec)
    dx, dw = api._as_primal_types((dx, dw), (x3, w_bf16))
    return dx, dw, dy  # y = r + x w^T: r's cotangent is dy


_residual_projection.defvjp(_residual_fwd, _residual_bwd)


def _check_residual(fn: str, r, y_shape) -> None:
    api._check_array(fn, "residual", r)
    if jnp.dtype(r.dtype) != jnp.dtype(_BF16):
        raise TypeError(
            f"{fn}: residual must be bfloat16 (it is added to the bf16 output in place), got "
            f"{jnp.dtype(r.dtype).name}; cast it with residual.astype(jnp.bfloat16)"
        )
    if tuple(r.shape) != tuple(y_shape):
        raise ValueError(
            f"{fn}: residual must have the output's shape {tuple(y_shape)} ([..., d_out]), got shape {tuple(r.shape)}"
        )


def dense_projection(x, w, residual, *, deterministic=True, grad_accumulator=None, out_sharding=None):
    """`jax_cake.dense_projection(x, w, residual=...)` (see its docstring)."""
    fn = "dense_projection"
    deterministic = api._check_dense_operands(fn, x, w, deterministic)
    lead = x.shape[:-1]
    _check_residual(fn, residual, lead + (w.shape[0],))
    if grad_accumulator is not None or out_sharding is not None:  # not fused with these: a separate add
        y = api.dense_projection(
            x, w, deterministic=deterministic, grad_accumulator=grad_accumulator, out_sharding=out_sharding
        )
        return remat.name_output(add_residual(residual, y))
    x3, w3 = api._batch_of_one(x, w)
    r3 = jnp.reshape(residual, (1, math.prod(lead), w.shape[0]))
    x3, w3, r3 = api._to_common_varying(x3, w3, r3)
    y3 = _residual_projection(x3, w3, r3, deterministic, jnp.dtype(w.dtype).name)
    return remat.name_output(jnp.reshape(y3, lead + (w.shape[0],)))


def batched_projection(x, w, residual, *, deterministic=True, grad_accumulator=None, out_sharding=None):
    """`jax_cake.batched_projection(x, w, residual=...)` (see its docstring)."""
    fn = "batched_projection"
    deterministic = api._check_batched_operands(fn, x, w, deterministic)
    _check_residual(fn, residual, (x.shape[0], x.shape[1], w.shape[1]))
    if grad_accumulator is not None or out_sharding is not None:  # not fused with these: a separate add
        y = api.batched_projection(
            x, w, deterministic=deterministic, grad_accumulator=grad_accumulator, out_sharding=out_sharding
        )
        return remat.name_output(add_residual(residual, y))
    x, w, r = api._to_common_varying(x, w, residual)
    return remat.name_output(_residual_projection(x, w, r, deterministic, jnp.dtype(w.dtype).name))
