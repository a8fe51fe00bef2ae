"""The public ops: dense and batched projections and the FP32 router GEMM.

Each op is a `jax.custom_vjp` whose forward and backward call one primitive per GEMM
(jax_cake.primitives). Plans are made at trace time from static shapes, dtypes and the
device (jax_cake.planner). Inputs are validated at trace time: a bad argument raises a
TypeError or ValueError naming it, before anything runs.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_cake import partitioning, primitives
from jax_cake.planner import device as device_lib
from jax_cake.planner import plan as make_plan
from jax_cake import remat

# --- validation ---------------------------------------------------------------------


def _check_array(fn: str, name: str, a: Any) -> None:
    if not (hasattr(a, "shape") and hasattr(a, "dtype")):
        raise TypeError(f"{fn}: {name} must be an array, got {type(a).__name__}")


def _check_dtype(fn: str, name: str, a: Any, allowed: tuple, hint: str) -> None:
    if jnp.dtype(a.dtype) not in [jnp.dtype(d) for d in allowed]:
        names = " or ".join(jnp.dtype(d).name for d in allowed)
        raise TypeError(f"{fn}: {name} must be {names}, got {jnp.dtype(a.dtype).name}{hint}")


def _check_rank(fn: str, name: str, a: Any, rank: int, layout: str) -> None:
    if a.ndim != rank:
        raise ValueError(f"{fn}: {name} must have rank {rank} ({layout}), got shape {tuple(a.shape)}")


def _check_deterministic(fn: str, deterministic: Any) -> bool:
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(
            f"{fn}: deterministic must be a Python bool, got {type(deterministic).__name__} {deterministic!r}"
        )
    return bool(deterministic)


def _check_dense_operands(fn: str, x, w, deterministic: Any) -> bool:
    """dense_projection's checks of deterministic, x [..., d_in] bf16 and w [d_out, d_in]
    bf16 or f32 (also run by jax_cake.accumulate and jax_cake.residual); returns
    deterministic as a bool."""
    deterministic = _check_deterministic(fn, deterministic)
    _check_array(fn, "x", x)
    _check_array(fn, "w", w)
    _check_dtype(fn, "x", x, (jnp.bfloat16,), " (cast activations with x.astype(jnp.bfloat16))")
    _check_dtype(fn, "w", w, (jnp.bfloat16, jnp.float32), "")
    if x.ndim < 1:
        raise ValueError(f"{fn}: x must have rank >= 1 ([..., d_in]), got a scalar")
    _check_rank(fn, "w", w, 2, "[d_out, d_in]")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"{fn}: x's last dimension (d_in={x.shape[-1]}) must equal w.shape[1] (d_in={w.shape[1]}); w is [d_out, d_in]"
        )
    return deterministic


def _check_batched_operands(fn: str, x, w, deterministic: Any) -> bool:
    """batched_projection's checks of deterministic, x [B, T, d_in] bf16 and w
    [B, d_out, d_in] bf16 or f32 (also run by jax_cake.accumulate and
    jax_cake.residual); returns deterministic as a bool."""
    deterministic = _check_deterministic(fn, deterministic)
    _check_array(fn, "x", x)
    _check_array(fn, "w", w)
    _check_dtype(fn, "x", x, (jnp.bfloat16,), " (cast activations with x.astype(jnp.bfloat16))")
    _check_dtype(fn, "w", w, (jnp.bfloat16, jnp.float32), "")
    _check_rank(fn, "x", x, 3, "[B, T, d_in]")
    _check_rank(fn, "w", w, 3, "[B, d_out, d_in]")
    if x.shape[0] != w.shape[0]:
        raise ValueError(
            f"{fn}: x and w must have the same batch size B, got x.shape[0]={x.shape[0]} and w.shape[0]={w.shape[0]}"
        )
    if x.shape[2] != w.shape[2]:
        raise ValueError(
            f"{fn}: x.shape[2] (d_in={x.shape[2]}) must equal w.shape[2] (d_in={w.shape[2]}); w is [B, d_out, d_in]"
        )
    return deterministic


def _batch_of_one(x, w):
    """(x [..., d_in], w [d_out, d_in]) -> (x3 [1, T, d_in], w3 [1, d_out, d_in]) for a
    batched core (jax_cake.accumulate, jax_cake.residual). Reshapes, not [None]: the
    transpose of a reshape is a reshape (no reduce over dw)."""
    x3 = jnp.reshape(x, (1, math.prod(x.shape[:-1]), x.shape[-1]))
    return x3, jnp.reshape(w, (1,) + w.shape)


# --- shard_map support --------------------------------------------------------------


def _varying_axes(a) -> frozenset:
    mat = getattr(jax.typeof(a), "mat", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def _to_common_varying(*arrays):
    """Makes every operand varying over the union of their varying manual axes.

    Inside shard_map a replicated weight next to token-sharded activations would
    otherwise give the custom_vjp backward a cotangent whose manual axes do not match
    the input. pcast's transpose sums the gradient over the added axes, which
    is exactly the data-parallel weight-gradient reduction.
    """
    union = frozenset().union(*(_varying_axes(a) for a in arrays))
    if not union:
        return arrays
    out = []
    for a in arrays:
        missing = tuple(sorted(union - _varying_axes(a)))
        out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
    return tuple(out)


# --- the projection core (dense and batched share it) -------------------------------


def _plans(x3, w3, deterministic: bool, w_dtype: str):
    b, t, d_in = x3.shape
    d_out = w3.shape[1]
    device = device_lib.current(x3, w3)
    sizes = dict(tokens=t, d_in=d_in, d_out=d_out, batch=b, device=device)
    return (
        make_plan("fwd", **sizes),
        make_plan("dgrad", **sizes),
        make_plan("wgrad", **sizes, out_dtype=w_dtype, deterministic=deterministic),
    )


def _explicit_specs(*arrays):
    """The operands' PartitionSpecs where their types carry Explicit shardings, else None."""
    if partitioning.explicit_mesh(*arrays) is None:
        return None
    return tuple(jax.typeof(a).sharding.spec for a in arrays)


def _as_primal_types(cotangents, primals):
    """Under Explicit axes a custom_vjp backward returns each cotangent with its primal's
    sharding type; elsewhere the cotangents are returned as they are."""
    specs = _explicit_specs(*primals)
    if specs is None:
        return tuple(cotangents)
    return tuple(partitioning.reshard_to(c, spec) for c, spec in zip(cotangents, specs))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _projection(x3, w3, deterministic: bool, w_dtype: str, out_request):
    fwd_plan, _, _ = _plans(x3, w3, deterministic, w_dtype)
    return primitives.fwd(x3, w3.astype(jnp.bfloat16), fwd_plan, out_sharding=out_request)


def _projection_fwd(x3, w3, deterministic, w_dtype, out_request):
    w_bf16 = w3.astype(jnp.bfloat16)
    fwd_plan, _, _ = _plans(x3, w3, deterministic, w_dtype)
    return primitives.fwd(x3, w_bf16, fwd_plan, out_sharding=out_request), (x3, w_bf16)


def _projection_bwd(deterministic, w_dtype, out_request, residuals, dy):
    del out_request
    x3, w_bf16 = residuals
    _, dgrad_plan, wgrad_plan = _plans(x3, w_bf16, deterministic, w_dtype)
    dy = dy.astype(jnp.bfloat16)
    # Under Explicit axes each gradient is asked for in its primal's sharding (for an
    # FSDP weight that makes the data-parallel sum of dw a reduce-scatter).
    x_spec, w_spec = _explicit_specs(x3, w_bf16) or (None, None)
    dx = primitives.dgrad(dy, w_bf16, dgrad_plan, out_sharding=x_spec)
    dw = primitives.wgrad(dy, x3, wgrad_plan, deterministic=deterministic, out_sharding=w_spec)
    return _as_primal_types((dx, dw), (x3, w_bf16))


_projection.defvjp(_projection_fwd, _projection_bwd)


# --- out_sharding ------------------------------------------------------------------------


def _check_out_sharding(fn: str, out_sharding: Any, ndim: int):
    """out_sharding as (PartitionSpec, NamedSharding or None) after validation, or None."""
    if out_sharding is None:
        return None
    if isinstance(out_sharding, NamedSharding):
        spec, mesh = out_sharding.spec, out_sharding.mesh
    elif isinstance(out_sharding, P):
        spec, mesh = out_sharding, jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError(
                f"{fn}: out_sharding={spec} is a PartitionSpec but no mesh is set; "
                "call under `with jax.set_mesh(mesh):` or pass a NamedSharding"
            )
    else:
        raise TypeError(
            f"{fn}: out_sharding must be a jax.sharding.PartitionSpec, a NamedSharding or None, "
            f"got {type(out_sharding).__name__} {out_sharding!r}"
        )
    if any(t == jax.sharding.AxisType.Manual for t in jax.sharding.get_abstract_mesh().axis_types):
        raise ValueError(f"{fn}: out_sharding cannot be used inside shard_map (outputs there are per-shard)")
    if len(spec) > ndim:
        raise ValueError(f"{fn}: out_sharding={spec} has {len(spec)} entries, more than the output's rank {ndim}")
    seen: set = set()
    for axes in partitioning.normalize(spec, ndim):
        for axis in axes:
            if axis not in mesh.axis_names:
                raise ValueError(
                    f"{fn}: out_sharding={spec} names mesh axis {axis!r}, which the mesh "
                    f"{tuple(mesh.axis_names)} does not have"
                )
            if axis in seen:
                raise ValueError(f"{fn}: out_sharding={spec} uses mesh axis {axis!r} twice")
            seen.add(axis)
    return spec, out_sharding


def _apply_out_sharding(y, checked):
    """y with the sharding asked for: a reshard under Explicit axes, a constraint otherwise."""
    if checked is None:
        return y
    spec, out_sharding = checked
    if partitioning.explicit_mesh(y) is not None:
        return partitioning.reshard_to(y, spec)
    return jax.lax.with_sharding_constraint(y, out_sharding)


def dense_projection(x, w, *, deterministic: bool = True, grad_accumulator=None, out_sharding=None, residual=None):
    """y = x @ w.T with BF16 operands and FP32 accumulation.

    Args:
      x: [..., d_in] bfloat16 activations (any number of leading token dimensions).
      w: [d_out, d_in] bfloat16 or float32 weight. A float32 weight is a master weight:
        it is rounded to bfloat16 for the products, and its gradient is float32, written
        from the kernel's FP32 accumulator (no bfloat16 rounding).
      deterministic: keyword-only. True (default): bitwise identical results on every
        run for the same inputs, shapes and GPU. False: the planner may pick a faster
        split-K program whose weight-gradient sum order can vary, where measured faster.
      grad_accumulator: keyword-only, None (default) or a float32 array of w's shape: the
        running sum of w's gradient over micro-batches. Given, the backward adds this
        call's dw into it inside the wgrad kernel (in place under jit, bitwise
        reproducible): the cotangent of grad_accumulator is `grad_accumulator + dw` and
        w's is zero, so `jax.grad(loss, argnums=<the sums>)` returns the new sums (a
        lax.scan over micro-batches carries them). Give a sum to one call per loss.
        See jax_cake.accumulate.
      out_sharding: keyword-only, None (default), a PartitionSpec (with a mesh set by
        `jax.set_mesh`) or a NamedSharding: the sharding of y. None: the sharding rule's
        (jax_cake.partitioning): the tokens keep x's sharding, d_out w's where x does not
        use that mesh axis. Given, y is resharded to it (Explicit axes) or constrained to
        it (Auto axes), and a reduction over a sharded d_in becomes a reduce-scatter where
        the asked-for sharding allows one.
      residual: keyword-only, None (default) or a bfloat16 array of y's shape [...,
        d_out]: returns residual + x @ w.T. The kernel that makes the add in the
        forward (in the residual's buffer) is held back for now
        (RESIDUAL_KERNELS_ENABLED in jax_cake/planner/residual.py): the op runs the
        forward and a separate add, with the same values: bf16(residual + bf16(x @
        w.T)), those of `residual + dense_projection(x, w)`. The residual's gradient is
        dy, with the residual's sharding. See jax_cake.residual.

    Returns:
      y: [..., d_out] bfloat16. Gradients: dx bfloat16, dw in w's dtype.
    """
    fn = "dense_projection"
    if residual is not None:  # residual + the projection (jax_cake.residual)
        from jax_cake import residual as residual_lib

        return residual_lib.dense_projection(
            x, w, residual, deterministic=deterministic, grad_accumulator=grad_accumulator, out_sharding=out_sharding
        )
    if grad_accumulator is not None:  # gradient accumulation in the wgrad kernel
        from jax_cake import accumulate

        return accumulate.dense_projection(
            x, w, grad_accumulator, deterministic=deterministic, out_sharding=out_sharding
        )
    deterministic = _check_dense_operands(fn, x, w, deterministic)
    out = _check_out_sharding(fn, out_sharding, x.ndim)
    lead = x.shape[:-1]
    x3 = jnp.reshape(x, (1, math.prod(lead), x.shape[-1]))
    x3, w = _to_common_varying(x3, w)
    # The asked-for sharding reaches the GEMM where y3 has it as it is (x of rank 2).
    request = P(None, *out[0]) if out is not None and x.ndim == 2 else None
    y3 = _projection(x3, w[None], deterministic, jnp.dtype(w.dtype).name, request)
    y = _apply_out_sharding(jnp.reshape(y3, lead + (w.shape[0],)), out)
    return remat.name_output(y)


def batched_projection(x, w, *, deterministic: bool = True, grad_accumulator=None, out_sharding=None, residual=None):
    """y[b] = x[b] @ w[b].T for every batch entry b (e.g. MLA head rows), one launch.

    Args:
      x: [B, T, d_in] bfloat16.
      w: [B, d_out, d_in] bfloat16 or float32 (master weight, as in dense_projection).
      deterministic: keyword-only, as in dense_projection.
      grad_accumulator: keyword-only, None or a float32 [B, d_out, d_in] running sum of
        w's gradient, as in dense_projection.
      out_sharding: keyword-only, the sharding of y, as in dense_projection.
      residual: keyword-only, None or a bfloat16 [B, T, d_out] array added to y, as in
        dense_projection (for now the forward and a separate add).

    Returns:
      y: [B, T, d_out] bfloat16. Gradients: dx bfloat16, dw in w's dtype.
    """
    fn = "batched_projection"
    if residual is not None:  # residual + the projection (jax_cake.residual)
        from jax_cake import residual as residual_lib

        return residual_lib.batched_projection(
            x, w, residual, deterministic=deterministic, grad_accumulator=grad_accumulator, out_sharding=out_sharding
        )
    if grad_accumulator is not None:  # gradient accumulation in the wgrad kernel
        from jax_cake import accumulate

        return accumulate.batched_projection(
            x, w, grad_accumulator, deterministic=deterministic, out_sharding=out_sharding
        )
    deterministic = _check_batched_operands(fn, x, w, deterministic)
    out = _check_out_sharding(fn, out_sharding, 3)
    x, w = _to_common_varying(x, w)
    y = _projection(x, w, deterministic, jnp.dtype(w.dtype).name, out[0] if out is not None else None)
    return remat.name_output(_apply_out_sharding(y, out))


# --- the router -----------------------------------------------------------------------


def _router_plans(x, w, deterministic: bool):
    t, d = x.shape
    sizes = dict(tokens=t, d_in=d, d_out=w.shape[0], out_dtype=jnp.float32, device=device_lib.current(x, w))
    return (
        make_plan("router_fwd", **sizes),
        make_plan("router_dgrad", **sizes),
        make_plan("router_wgrad", **sizes, deterministic=deterministic),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _router(x, w, deterministic: bool):
    fwd_plan, _, _ = _router_plans(x, w, deterministic)
    return primitives.router_fwd(x, w, fwd_plan)


def _router_fwd(x, w, deterministic):
    fwd_plan, _, _ = _router_plans(x, w, deterministic)
    return primitives.router_fwd(x, w, fwd_plan), (x, w)


def _router_bwd(deterministic, residuals, g):
    x, w = residuals
    _, dgrad_plan, wgrad_plan = _router_plans(x, w, deterministic)
    g = g.astype(jnp.float32)
    x_spec, w_spec = _explicit_specs(x, w) or (None, None)
    dx = primitives.router_dgrad(g, w, dgrad_plan, out_sharding=x_spec)
    dw = primitives.router_wgrad(g, x, wgrad_plan, deterministic=deterministic, out_sharding=w_spec)
    return _as_primal_types((dx, dw), (x, w))


_router.defvjp(_router_fwd, _router_bwd)


def router_logits(x, w, *, deterministic: bool = True):
    """FP32 MoE router logits = x @ w.T by BF16x3 emulation.

    Each FP32 operand is split into hi + lo bfloat16 parts and hi*hi + hi*lo + lo*hi are
    accumulated in FP32 (the accuracy of jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3).
    The backward uses the same emulation for dx and dw.

    Args:
      x: [T, d] float32 tokens.
      w: [E, d] float32 router weight (E = 256 experts is the tuned case).
      deterministic: keyword-only, as in dense_projection (applies to dw).

    Returns:
      logits: [T, E] float32.
    """
    fn = "router_logits"
    deterministic = _check_deterministic(fn, deterministic)
    _check_array(fn, "x", x)
    _check_array(fn, "w", w)
    hint = " (the router takes FP32 inputs; its BF16x3 split happens inside)"
    _check_dtype(fn, "x", x, (jnp.float32,), hint)
    _check_dtype(fn, "w", w, (jnp.float32,), hint)
    _check_rank(fn, "x", x, 2, "[T, d]")
    _check_rank(fn, "w", w, 2, "[E, d]")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"{fn}: x.shape[1] (d={x.shape[1]}) must equal w.shape[1] (d={w.shape[1]}); w is [E, d]")
    x, w = _to_common_varying(x, w)
    return remat.name_output(_router(x, w, deterministic))
