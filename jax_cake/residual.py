"""The residual add in the forward GEMM: `residual=` of the projections.

    h = jax_cake.dense_projection(a, w_o, residual=h)   # h + a @ w_o.T

A transformer block adds the output of its o and down projections to the residual
stream. Written as `r + dense_projection(x, w)`, the GEMM writes y and a separate
elementwise pass reads y and r and writes the sum. The fused kernel
(jax_cake_fwd_residual) adds each finished tile into r's buffer instead (r aliased to the
result, so under jit with r donated, or r an intermediate, the sum is made in place), as
XLA does for `r + jnp.dot(x, w.T)` (cuBLASLt with beta = 1 and the output aliased to r).

For now the planner holds that kernel back (RESIDUAL_KERNELS_ENABLED in
jax_cake/planner/residual.py, until tests/gpu/test_residual_gpu.py passes at every shape
on the GPU): the op runs the forward and a separate add, with the same values. What
follows about the fused call describes it as it runs once enabled.

Numerics: y = bf16(r + bf16(x w^T)). The kernel rounds its FP32 tile to bf16 in shared
memory, then the TMA unit adds it to r in bf16 with one more round to nearest: the value
of the unfused `r + dense_projection(x, w)` (bitwise, up to the GEMM's own FP32 sum
order), and within one bf16 rounding of bf16(r + x w^T) (XLA's fused add, which rounds
once). The reference path (CPU, XLA plans) computes the same double rounding, so every
path of the op gives the unfused op's values. One pass over K, one add per element:
bitwise reproducible.

Gradients: as the projection's for x and w; r's cotangent is dy itself (y = r + ...).
The output keeps the checkpoint name of the other ops (jax_cake.remat).

Where the fused call does not apply the op computes the forward and a separate add, with
the same values: while the kernels are held back (today, everywhere), where no
reduce-add variant fits the tiles (the planner logs it once), wherever the operands need
partitioning, i.e. more than one device and not inside shard_map over every mesh axis
(the fused call has no partitioning rule; the forward's rule partitions it, the residual
is resharded to the forward's output under Explicit axes, and the add follows), or with
`grad_accumulator=` / `out_sharding=` given together with `residual=`. Under vmap the vmapped axis folds into
the kernel's tokens or batch axis (as jax_cake.batching does for the other GEMMs).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from jax_cake import api, batching, partitioning, primitives, reference, remat
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


def _separate_add(r, y):
    """add_residual(r, y) with r first resharded to y's sharding where their types carry
    Explicit shardings (there the add of differently sharded operands is a type error)."""
    if partitioning.explicit_mesh(r, y) is not None:
        r = partitioning.reshard_to(r, jax.typeof(y).sharding.spec)
    return add_residual(r, y)


def _fused_call_applies(*arrays) -> bool:
    """Whether the fused custom call (no partitioning rule) may run as it is: nothing to
    partition (one device, or a one-device mesh in scope) or inside shard_map over every
    mesh axis (the operands are the shards); the same test as primitives.call_sharded's."""
    return primitives._manual(*arrays) or primitives._one_device()


def _sizes(x, w) -> dict:
    return dict(tokens=x.shape[1], d_in=x.shape[2], d_out=w.shape[1], batch=x.shape[0])


def _direct(x, w, r, plan: Plan):
    """fwd_residual on unbatched operands (no vmap rule here)."""
    if plan.op != "fwd_residual" or not _fused_call_applies(x, w, r):
        if plan.op == "fwd_residual":
            plan = make_plan("fwd", **_sizes(x, w), device=device_lib.current(x, w))
        return _separate_add(r, primitives.fwd(x, w, plan))
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

    x2, w2, r2 = batching.merge_lead(x), batching.merge_lead(w), batching.merge_lead(r)
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

    A kernel plan for op "fwd_residual" (`plan_residual`, only while
    RESIDUAL_KERNELS_ENABLED) runs jax_cake_fwd_residual with r aliased to the result
    (input_output_aliases {2: 0}): the kernel reduce-adds its bf16 tiles into r's buffer,
    no separate pass. A plan for op "fwd" (the kernels held back, or no reduce-add variant
    fits) runs that forward and an XLA add; an XLA plan, and any platform but CUDA, the
    reference with the same double rounding (the module docstring). Where the operands
    need partitioning (more than one device, outside shard_map over every mesh axis) the
    partitioned forward runs, then the add (r resharded to y under Explicit axes). Under
    vmap the vmapped axis folds into the tokens or the batch axis.
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _residual_projection(x3, w3, r3, deterministic: bool, w_dtype: str, r_spec):
    plan, _, _ = _plans(x3, w3, deterministic, w_dtype)
    return fwd_residual(x3, w3.astype(_BF16), r3, plan)


def _residual_fwd(x3, w3, r3, deterministic, w_dtype, r_spec):
    w_bf16 = w3.astype(_BF16)
    plan, _, _ = _plans(x3, w3, deterministic, w_dtype)
    return fwd_residual(x3, w_bf16, r3, plan), (x3, w_bf16)


def _residual_bwd(deterministic, w_dtype, r_spec, residuals, dy):
    x3, w_bf16 = residuals
    _, dgrad_plan, wgrad_plan = _plans(x3, w_bf16, deterministic, w_dtype)
    dy = dy.astype(_BF16)
    x_spec, w_spec = api._explicit_specs(x3, w_bf16) or (None, None)
    dx = primitives.dgrad(dy, w_bf16, dgrad_plan, out_sharding=x_spec)
    dw = primitives.wgrad(dy, x3, wgrad_plan, deterministic=deterministic, out_sharding=w_spec)
    dx, dw = api._as_primal_types((dx, dw), (x3, w_bf16))
    # y = r + x w^T: r's cotangent is dy, in r's sharding type under Explicit axes (dy has
    # y's). r_spec is r's spec taken at the call (static), so r itself is not kept alive
    # for the backward (that would cost the fused kernel its in-place add).
    dr = dy if r_spec is None else partitioning.reshard_to(dy, r_spec)
    return dx, dw, dr


def _r_spec(r3):
    """r3's PartitionSpec where its type carries an Explicit sharding, else None (static)."""
    specs = api._explicit_specs(r3)
    return None if specs is None else jax.sharding.PartitionSpec(*specs[0])


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
        return remat.name_output(_separate_add(residual, y))
    x3, w3 = api._batch_of_one(x, w)
    r3 = jnp.reshape(residual, (1, math.prod(lead), w.shape[0]))
    x3, w3, r3 = api._to_common_varying(x3, w3, r3)
    y3 = _residual_projection(x3, w3, r3, deterministic, jnp.dtype(w.dtype).name, _r_spec(r3))
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
        return remat.name_output(_separate_add(residual, y))
    x, w, r = api._to_common_varying(x, w, residual)
    return remat.name_output(_residual_projection(x, w, r, deterministic, jnp.dtype(w.dtype).name, _r_spec(r)))
