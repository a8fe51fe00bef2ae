"""vmap of the jax_cake GEMMs: the vmapped axis maps onto the kernels, never a loop.

Every GEMM call (jax_cake.primitives.call) is a `jax.custom_batching.custom_vmap` whose
rule, `fold`, rewrites the batched GEMM as one unbatched GEMM on folded operands (the
kernels take [B, T, K] . [B, N, K]):

- fwd / dgrad with the weight shared across the vmapped axis V (only x or dy batched): V
  folds into the tokens, [V, B, T, K] -> [B, V*T, K]: one GEMM with V times the rows.
- per-batch weights (both operands batched): V folds into the batch axis B, the batched
  program (as batched_projection).
- wgrad, or one operand batched where tokens cannot carry it: the other operand is
  broadcast over V, then V folds into B (a weight gradient per vmapped entry).
- an "add" epilogue's addend (the residual of fwd, the running sum of wgrad) has the
  result's layout and folds with it (broadcast over V where it is not batched).
- router ops: a vmapped x or g with a shared w folds into the tokens; per-entry router
  weights and weight gradients have no batched router program and run the XLA reference
  under vmap (dot_general with a batch dimension, one op, no loop).

`fold` gets the GEMM to run on the folded operands as `run` (which plans again for their
shapes), so this module depends on nothing above it. The FFI calls themselves refuse to
be batched (vmap_method=None): a path that missed this rule raises instead of running a
sequential loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_cake import reference

_PROJECTION = ("fwd", "dgrad", "wgrad")


def merge_lead(v):
    """[V, B, ...] -> [V * B, ...]: a vmapped axis folded into the leading batch axis."""
    return v.reshape((v.shape[0] * v.shape[1],) + v.shape[2:])


def _broadcast(v, batched: bool, size: int):
    return v if batched else jnp.broadcast_to(v, (size,) + v.shape)


def fold(op: str, size: int, batched: tuple[bool, ...], run, a, b, c=None):
    """The vmapped GEMM `op` (batched operands carry the vmapped axis V first) as one GEMM
    `run(a, b, c)` on folded operands; c is the add epilogue's addend, or None."""
    a_batched, b_batched = batched[:2]
    c_batched = len(batched) > 2 and batched[2]
    if op in _PROJECTION:
        if op != "wgrad" and not b_batched:  # shared weight: into the tokens
            a = _broadcast(a, a_batched, size)
            lead, t = a.shape[1], a.shape[2]

            def tokens(v):
                return jnp.moveaxis(v, 0, 1).reshape(lead, size * t, v.shape[-1])

            y = run(tokens(a), b, None if c is None else tokens(_broadcast(c, c_batched, size)))
            return jnp.moveaxis(y.reshape(lead, size, t, y.shape[-1]), 1, 0)
        a, b = _broadcast(a, a_batched, size), _broadcast(b, b_batched, size)
        c = None if c is None else merge_lead(_broadcast(c, c_batched, size))
        y = run(merge_lead(a), merge_lead(b), c)
        return y.reshape((size, a.shape[1]) + y.shape[1:])
    if op in ("router_fwd", "router_dgrad") and a_batched and not b_batched:
        t = a.shape[1]
        y = run(a.reshape(size * t, a.shape[2]), b, None)
        return y.reshape(size, t, y.shape[-1])
    # Per-entry router weights or router weight gradients: the XLA reference, batched.
    in_axes = (0 if a_batched else None, 0 if b_batched else None)
    return jax.vmap(getattr(reference, op), in_axes=in_axes)(a, b)
