"""vmap of the jax_cake GEMMs: the vmapped axis maps onto the kernels, never a loop.

Every primitive is a `jax.custom_batching.custom_vmap` whose rule rewrites the batched
GEMM as one unbatched GEMM on folded operands (the kernels take [B, T, K] . [B, N, K]):

- fwd / dgrad with the weight shared across the vmapped axis V (only x or dy batched): V
  folds into the tokens, [V, B, T, K] -> [B, V*T, K]: one GEMM with V times the rows.
- per-batch weights (both operands batched): V folds into the batch axis B, the batched
  program (as batched_projection).
- wgrad, or one operand batched where tokens cannot carry it: the other operand is
  broadcast over V, then V folds into B (a weight gradient per vmapped entry).
- router ops: a vmapped x or g with a shared w folds into the tokens; per-entry router
  weights and weight gradients have no batched router program and run the XLA reference
  under vmap (dot_general with a batch dimension, one op, no loop).

The FFI calls themselves refuse to be batched (vmap_method=None): a path that missed
this rule raises instead of running a sequential loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from jax_cake import reference
from jax_cake.planner import device as device_lib

_PROJECTION = ("fwd", "dgrad", "wgrad")


def vmappable(local, a, b, out_sharding=None):
    """local(a, b) (a jax_cake.primitives.Local) with this module's vmap rule."""
    from jax_cake import primitives

    @custom_vmap
    def gemm(a, b):
        return primitives.call_sharded(local, a, b, out_sharding)

    @gemm.def_vmap
    def rule(axis_size, in_batched, a, b):
        return fold(local, axis_size, tuple(in_batched), a, b), True

    return gemm(a, b)


def _run(local, a, b):
    """The GEMM on folded operands, planned for their shapes (vmappable again: nested vmap)."""
    from jax_cake import primitives

    return primitives.call(local.for_shapes(a.shape, b.shape, device_lib.current(a, b)), a, b)


def merge_lead(v):
    """[V, B, ...] -> [V * B, ...]: a vmapped axis folded into the leading batch axis."""
    return v.reshape((v.shape[0] * v.shape[1],) + v.shape[2:])


def fold(local, size: int, batched: tuple[bool, bool], a, b):
    """The vmapped GEMM (batched operands carry the vmapped axis first) as one GEMM."""
    a_batched, b_batched = batched
    op = local.op
    if op in _PROJECTION:
        if op != "wgrad" and a_batched and not b_batched:  # shared weight: into the tokens
            lead, t, k = a.shape[1:]
            folded = jnp.moveaxis(a, 0, 1).reshape(lead, size * t, k)
            y = _run(local, folded, b)
            return jnp.moveaxis(y.reshape(lead, size, t, y.shape[-1]), 1, 0)
        a = a if a_batched else jnp.broadcast_to(a, (size,) + a.shape)
        b = b if b_batched else jnp.broadcast_to(b, (size,) + b.shape)
        y = _run(local, merge_lead(a), merge_lead(b))
        return y.reshape((size, a.shape[1]) + y.shape[1:])
    if op in ("router_fwd", "router_dgrad") and a_batched and not b_batched:
        t = a.shape[1]
        y = _run(local, a.reshape(size * t, a.shape[2]), b)
        return y.reshape(size, t, y.shape[-1])
    # Per-entry router weights or router weight gradients: the XLA reference, batched.
    in_axes = (0 if a_batched else None, 0 if b_batched else None)
    return jax.vmap(getattr(reference, op), in_axes=in_axes)(a, b)
