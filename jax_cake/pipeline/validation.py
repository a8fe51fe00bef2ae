"""The checks of every public entry point's operands, with their messages, in one place.

Each raises a TypeError or ValueError naming the entry point (`fn`) and the argument, at
trace time, before anything runs. Used by jax_cake.api (the ops), the Flax and Equinox
adapters and nothing else.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_cake import reference
from jax_cake.primitives import partitioning

_ACTIVATION_HINT = " (cast activations with x.astype(jnp.bfloat16))"


def check_array(fn: str, name: str, a: Any) -> None:
    if not (hasattr(a, "shape") and hasattr(a, "dtype")):
        raise TypeError(f"{fn}: {name} must be an array, got {type(a).__name__}")


def check_dtype(fn: str, name: str, a: Any, allowed: tuple, hint: str) -> None:
    if jnp.dtype(a.dtype) not in [jnp.dtype(d) for d in allowed]:
        names = " or ".join(jnp.dtype(d).name for d in allowed)
        raise TypeError(f"{fn}: {name} must be {names}, got {jnp.dtype(a.dtype).name}{hint}")


def check_rank(fn: str, name: str, a: Any, rank: int, layout: str) -> None:
    if a.ndim != rank:
        raise ValueError(f"{fn}: {name} must have rank {rank} ({layout}), got shape {tuple(a.shape)}")


def check_deterministic(fn: str, deterministic: Any) -> bool:
    """deterministic as a bool; it must be a Python (or NumPy) bool."""
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(
            f"{fn}: deterministic must be a Python bool, got {type(deterministic).__name__} {deterministic!r}"
        )
    return bool(deterministic)


def check_activations(fn: str, x) -> None:
    """x [..., d_in] bfloat16, rank >= 1."""
    check_array(fn, "x", x)
    check_dtype(fn, "x", x, (jnp.bfloat16,), _ACTIVATION_HINT)
    if x.ndim < 1:
        raise ValueError(f"{fn}: x must have rank >= 1 ([..., d_in]), got a scalar")


def _check_projection_dtypes(fn: str, x, w) -> None:
    """x and w are arrays, x bfloat16, w bfloat16 or float32 (a master weight)."""
    check_array(fn, "x", x)
    check_array(fn, "w", w)
    check_dtype(fn, "x", x, (jnp.bfloat16,), _ACTIVATION_HINT)
    check_dtype(fn, "w", w, (jnp.bfloat16, jnp.float32), "")


def check_dense_operands(fn: str, x, w, deterministic: Any) -> bool:
    """deterministic, x [..., d_in] bf16 and w [d_out, d_in] bf16 or f32; returns
    deterministic as a bool."""
    deterministic = check_deterministic(fn, deterministic)
    _check_projection_dtypes(fn, x, w)
    if x.ndim < 1:
        raise ValueError(f"{fn}: x must have rank >= 1 ([..., d_in]), got a scalar")
    check_rank(fn, "w", w, 2, "[d_out, d_in]")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"{fn}: x's last dimension (d_in={x.shape[-1]}) must equal w.shape[1] (d_in={w.shape[1]}); w is [d_out, d_in]"
        )
    return deterministic


def check_batched_operands(fn: str, x, w, deterministic: Any) -> bool:
    """deterministic, x [B, T, d_in] bf16 and w [B, d_out, d_in] bf16 or f32; returns
    deterministic as a bool."""
    deterministic = check_deterministic(fn, deterministic)
    _check_projection_dtypes(fn, x, w)
    check_rank(fn, "x", x, 3, "[B, T, d_in]")
    check_rank(fn, "w", w, 3, "[B, d_out, d_in]")
    if x.shape[0] != w.shape[0]:
        raise ValueError(
            f"{fn}: x and w must have the same batch size B, got x.shape[0]={x.shape[0]} and w.shape[0]={w.shape[0]}"
        )
    if x.shape[2] != w.shape[2]:
        raise ValueError(
            f"{fn}: x.shape[2] (d_in={x.shape[2]}) must equal w.shape[2] (d_in={w.shape[2]}); w is [B, d_out, d_in]"
        )
    return deterministic


def _check_weight_over_x(fn: str, name: str, w, d_in: int, layout: str, note: str) -> None:
    """A rank-2 bf16 or f32 weight whose second dimension is x's d_in."""
    check_array(fn, name, w)
    check_dtype(fn, name, w, (jnp.bfloat16, jnp.float32), "")
    check_rank(fn, name, w, 2, layout)
    if w.shape[1] != d_in:
        raise ValueError(
            f"{fn}: {name}.shape[1] (d_in={w.shape[1]}) must equal x's last dimension (d_in={d_in}); {note}"
        )


def check_weights(fn: str, ws, d_in: int) -> None:
    """ws: a non-empty list or tuple of [d_out_i, d_in] bf16 or f32 weights over one x."""
    if not isinstance(ws, (list, tuple)):
        got = "an array (wrap one weight as (w,))" if hasattr(ws, "shape") else type(ws).__name__
        raise TypeError(f"{fn}: ws must be a list or tuple of [d_out, d_in] weights, got {got}")
    if not ws:
        raise ValueError(f"{fn}: ws must hold at least one weight, got an empty {type(ws).__name__}")
    for i, w in enumerate(ws):
        _check_weight_over_x(fn, f"ws[{i}]", w, d_in, "[d_out, d_in]", "every weight is [d_out, d_in] over the same x")


def check_activation(fn: str, activation: Any) -> str:
    """activation: one of the gated epilogue's names (reference.ACTIVATIONS)."""
    if not isinstance(activation, str) or activation not in reference.ACTIVATIONS:
        names = " or ".join(repr(a) for a in reference.ACTIVATIONS)
        raise ValueError(f"{fn}: activation must be {names}, got {type(activation).__name__} {activation!r}")
    return activation


def check_gated_weights(fn: str, w_gate, w_up, d_in: int) -> None:
    """w_gate and w_up: [F, d_in] bf16 or f32 weights of the same shape over x."""
    for name, w in (("w_gate", w_gate), ("w_up", w_up)):
        _check_weight_over_x(fn, name, w, d_in, "[d_ff, d_in]", f"{name} is [d_ff, d_in]")
    if tuple(w_gate.shape) != tuple(w_up.shape):
        raise ValueError(
            f"{fn}: w_gate and w_up must have the same shape [d_ff, d_in], got w_gate {tuple(w_gate.shape)} "
            f"and w_up {tuple(w_up.shape)}"
        )


def check_down_weight(fn: str, w_down, d_ff: int) -> None:
    """w_down: [d_out, d_ff] bf16 or f32, its d_in the gated projection's d_ff."""
    check_array(fn, "w_down", w_down)
    check_dtype(fn, "w_down", w_down, (jnp.bfloat16, jnp.float32), "")
    check_rank(fn, "w_down", w_down, 2, "[d_out, d_ff]")
    if w_down.shape[1] != d_ff:
        raise ValueError(
            f"{fn}: w_down.shape[1] (d_ff={w_down.shape[1]}) must equal w_gate.shape[0] (d_ff={d_ff}); "
            "w_down is [d_out, d_ff]"
        )


def check_router_operands(fn: str, x, w, deterministic: Any) -> bool:
    """deterministic, x [T, d] f32 and w [E, d] f32; returns deterministic as a bool."""
    deterministic = check_deterministic(fn, deterministic)
    check_array(fn, "x", x)
    check_array(fn, "w", w)
    hint = " (the router takes FP32 inputs; its BF16x3 split happens inside)"
    check_dtype(fn, "x", x, (jnp.float32,), hint)
    check_dtype(fn, "w", w, (jnp.float32,), hint)
    check_rank(fn, "x", x, 2, "[T, d]")
    check_rank(fn, "w", w, 2, "[E, d]")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"{fn}: x.shape[1] (d={x.shape[1]}) must equal w.shape[1] (d={w.shape[1]}); w is [E, d]")
    return deterministic


def check_accumulator(fn: str, acc, w) -> None:
    """grad_accumulator: float32 of w's shape."""
    check_array(fn, "grad_accumulator", acc)
    if jnp.dtype(acc.dtype) != jnp.dtype(jnp.float32):
        raise TypeError(
            f"{fn}: grad_accumulator must be float32 (the FP32 running sum of w's gradient), got "
            f"{jnp.dtype(acc.dtype).name}; start it with jnp.zeros(w.shape, jnp.float32)"
        )
    if tuple(acc.shape) != tuple(w.shape):
        raise ValueError(f"{fn}: grad_accumulator must have w's shape {tuple(w.shape)}, got shape {tuple(acc.shape)}")


def check_accumulator_varying(fn: str, x, w, acc) -> None:
    """Inside shard_map the running sum must vary over every manual axis x or w varies
    over (a replicated sum would be counted once per shard)."""
    union = partitioning.varying_axes(x) | partitioning.varying_axes(w) | partitioning.varying_axes(acc)
    missing = sorted(union - partitioning.varying_axes(acc))
    if missing:
        raise ValueError(
            f"{fn}: grad_accumulator must vary over the manual axes {missing} as x does (one partial sum per "
            "shard: make it with jax.lax.pcast(..., to='varying') and psum it after the last micro-batch)"
        )


def check_residual(fn: str, r, y_shape) -> None:
    """residual: bfloat16 of the output's shape."""
    check_array(fn, "residual", r)
    if jnp.dtype(r.dtype) != jnp.dtype(jnp.bfloat16):
        raise TypeError(
            f"{fn}: residual must be bfloat16 (it is added to the bf16 output in place), got "
            f"{jnp.dtype(r.dtype).name}; cast it with residual.astype(jnp.bfloat16)"
        )
    if tuple(r.shape) != tuple(y_shape):
        raise ValueError(
            f"{fn}: residual must have the output's shape {tuple(y_shape)} ([..., d_out]), got shape {tuple(r.shape)}"
        )


def check_out_sharding(fn: str, out_sharding: Any, shape: tuple[int, ...]):
    """out_sharding for an output of `shape`, as (PartitionSpec, NamedSharding or
    PartitionSpec) after validation, or None."""
    ndim = len(shape)
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
    for dim, (size, axes) in enumerate(zip(shape, partitioning.normalize(spec, ndim))):
        for axis in axes:
            if axis not in mesh.axis_names:
                raise ValueError(
                    f"{fn}: out_sharding={spec} names mesh axis {axis!r}, which the mesh "
                    f"{tuple(mesh.axis_names)} does not have"
                )
            if axis in seen:
                raise ValueError(f"{fn}: out_sharding={spec} uses mesh axis {axis!r} twice")
            seen.add(axis)
        parts = math.prod(mesh.shape[axis] for axis in axes)
        if isinstance(size, int) and size % parts:  # (a symbolic size is checked by jax)
            raise ValueError(
                f"{fn}: out_sharding={spec} splits output dimension {dim} (size {size}) into {parts} "
                "parts, which do not divide it"
            )
    return spec, out_sharding


def _check_group_sizes(fn: str, group_sizes, w, w_name: str) -> None:
    """group_sizes: int32 [G], one size per group of w (w.shape[0] is G)."""
    if jnp.dtype(group_sizes.dtype) != jnp.dtype(jnp.int32):
        raise TypeError(
            f"{fn}: group_sizes must be int32, got {jnp.dtype(group_sizes.dtype).name} "
            "(cast it with group_sizes.astype(jnp.int32))"
        )
    check_rank(fn, "group_sizes", group_sizes, 1, "[G], one size per group")
    if group_sizes.shape[0] != w.shape[0]:
        raise ValueError(
            f"{fn}: group_sizes must hold one size per group of {w_name}: {w_name}.shape[0] is G={w.shape[0]}, "
            f"got group_sizes of shape {tuple(group_sizes.shape)}"
        )


def check_grouped_operands(
    fn: str, x, w, group_sizes, deterministic: Any, names=("x", "w"), layout: str = "nk"
) -> bool:
    """deterministic; x [M, d_in] bf16 (rows sorted by group); w [G, d_out, d_in] (layout
    "nk") or [G, d_in, d_out] ("kn", lax.ragged_dot's rhs) bf16 or f32 with G >= 1;
    group_sizes [G] int32. `names`: what the caller calls x and w. Returns deterministic
    as a bool."""
    deterministic = check_deterministic(fn, deterministic)
    x_name, w_name = names
    check_array(fn, x_name, x)
    check_array(fn, w_name, w)
    check_array(fn, "group_sizes", group_sizes)
    check_dtype(fn, x_name, x, (jnp.bfloat16,), f" (cast activations with {x_name}.astype(jnp.bfloat16))")
    check_dtype(fn, w_name, w, (jnp.bfloat16, jnp.float32), "")
    w_layout = "[G, d_out, d_in]" if layout == "nk" else "[G, K, N]"
    check_rank(fn, x_name, x, 2, "[M, d_in] with its rows sorted by group" if layout == "nk" else "[M, K]")
    check_rank(fn, w_name, w, 3, w_layout)
    d_in_axis = 2 if layout == "nk" else 1
    if x.shape[1] != w.shape[d_in_axis]:
        raise ValueError(
            f"{fn}: {x_name}.shape[1] ({x.shape[1]}) must equal {w_name}.shape[{d_in_axis}] "
            f"({w.shape[d_in_axis]}), the contracted size; {w_name} is {w_layout}"
        )
    if w.shape[0] < 1:
        raise ValueError(f"{fn}: {w_name} must hold at least one group, got shape {tuple(w.shape)} ({w_layout})")
    _check_group_sizes(fn, group_sizes, w, w_name)
    return deterministic


def is_default_precision(precision) -> bool:
    """Whether a `lax` precision argument asks for the default (None, Precision.DEFAULT or a
    pair of them); a DotAlgorithm, a preset or anything else is not."""
    if precision is None:
        return True
    if isinstance(precision, (tuple, list)):
        return len(precision) == 2 and all(is_default_precision(p) for p in precision)
    try:
        return jax.lax.Precision(precision) == jax.lax.Precision.DEFAULT
    except (ValueError, TypeError):
        return False


def _check_expert_weight(fn: str, name: str, w, layout: str) -> None:
    """A rank-3 bf16 or f32 weight of one matrix per expert."""
    check_array(fn, name, w)
    check_dtype(fn, name, w, (jnp.bfloat16, jnp.float32), "")
    check_rank(fn, name, w, 3, layout)
    if w.shape[0] < 1:
        raise ValueError(f"{fn}: {name} must hold at least one expert, got shape {tuple(w.shape)} ({layout})")


def _check_gate_up_experts(fn: str, w_gate, w_up, d_in: int, x_name: str) -> None:
    """w_gate and w_up: [G, d_ff, d_in] bf16 or f32 of the same shape over x's d_in."""
    layout = "[G, d_ff, d_in]"
    for name, w in (("w_gate", w_gate), ("w_up", w_up)):
        _check_expert_weight(fn, name, w, layout)
        if w.shape[2] != d_in:
            raise ValueError(
                f"{fn}: {name}.shape[2] (d_in={w.shape[2]}) must equal {x_name}'s last dimension (d_in={d_in}); "
                f"{name} is {layout}"
            )
    if tuple(w_gate.shape) != tuple(w_up.shape):
        raise ValueError(
            f"{fn}: w_gate and w_up must have the same shape {layout}, got w_gate {tuple(w_gate.shape)} "
            f"and w_up {tuple(w_up.shape)}"
        )


def check_grouped_gated_operands(fn: str, x, w_gate, w_up, group_sizes, activation: Any, deterministic: Any):
    """deterministic, activation; x [M, d_in] bf16 (rows sorted by group); w_gate, w_up [G,
    d_ff, d_in] bf16 or f32 of the same shape, G >= 1; group_sizes [G] int32. Returns
    (activation, deterministic)."""
    deterministic = check_deterministic(fn, deterministic)
    activation = check_activation(fn, activation)
    check_array(fn, "x", x)
    check_dtype(fn, "x", x, (jnp.bfloat16,), _ACTIVATION_HINT)
    check_rank(fn, "x", x, 2, "[M, d_in] with its rows sorted by group")
    _check_gate_up_experts(fn, w_gate, w_up, x.shape[1], "x")
    check_array(fn, "group_sizes", group_sizes)
    _check_group_sizes(fn, group_sizes, w_gate, "w_gate")
    return activation, deterministic


def check_moe_operands(
    fn: str, x, w_gate, w_up, w_down, expert_ids, expert_weights, activation: Any, deterministic: Any
):
    """deterministic, activation; x [T, d] bf16; w_gate, w_up [G, d_ff, d] and w_down [G, d,
    d_ff] bf16 or f32 (G, d, d_ff consistent); expert_ids [T, k] of an integer dtype, k >=
    1; expert_weights [T, k] float32 or bfloat16. Returns (activation, deterministic)."""
    deterministic = check_deterministic(fn, deterministic)
    activation = check_activation(fn, activation)
    check_array(fn, "x", x)
    check_dtype(fn, "x", x, (jnp.bfloat16,), _ACTIVATION_HINT)
    check_rank(fn, "x", x, 2, "[T, d]")
    _check_gate_up_experts(fn, w_gate, w_up, x.shape[1], "x")
    groups, d_ff, d = w_gate.shape
    _check_expert_weight(fn, "w_down", w_down, "[G, d, d_ff]")
    if tuple(w_down.shape) != (groups, d, d_ff):
        raise ValueError(
            f"{fn}: w_down must have shape [G, d, d_ff] = {(groups, d, d_ff)} (G and d_ff of w_gate "
            f"{tuple(w_gate.shape)}, d of x), got {tuple(w_down.shape)}"
        )
    check_array(fn, "expert_ids", expert_ids)
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise TypeError(
            f"{fn}: expert_ids must have an integer dtype (int32 from jax.lax.top_k), got "
            f"{jnp.dtype(expert_ids.dtype).name}"
        )
    check_rank(fn, "expert_ids", expert_ids, 2, "[T, k], k experts per token")
    if expert_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"{fn}: expert_ids must hold one row per token of x: x.shape[0] is T={x.shape[0]}, "
            f"got expert_ids of shape {tuple(expert_ids.shape)}"
        )
    if expert_ids.shape[1] < 1:
        raise ValueError(
            f"{fn}: expert_ids must route each token to k >= 1 experts, got shape {tuple(expert_ids.shape)}"
        )
    check_array(fn, "expert_weights", expert_weights)
    check_dtype(fn, "expert_weights", expert_weights, (jnp.float32, jnp.bfloat16), "")
    if tuple(expert_weights.shape) != tuple(expert_ids.shape):
        raise ValueError(
            f"{fn}: expert_weights must have expert_ids' shape {tuple(expert_ids.shape)} ([T, k]), got shape "
            f"{tuple(expert_weights.shape)}"
        )
    return activation, deterministic
