"""The dropless MoE expert MLP written without jax_cake, as a JAX user writes it today: the
baselines of the model family's moe cases (benchmarks/families/model.py).

Every layer takes x [T, d] bf16, FP32 (or bf16) masters w_gate / w_up [G, d_ff, d] and
w_down [G, d, d_ff], expert_ids [T, k] in [0, G) and expert_weights [T, k], and returns
y [T, d] bf16 = sum_j ew[t, j] SwiGLU-MLP_{e[t, j]}(x[t]) (the sum in FP32, rounded once),
the value of jax_cake.moe_mlp:
- `dropless(ragged)`: the T k token copies sorted by expert (a stable argsort), gathered,
  three grouped GEMMs `ragged(rows, w_bf16 [G, N, K], group_sizes)` with the SwiGLU between
  them, the outputs scattered back to copy order and combined. `ragged` is
  `lax_ragged` (jax.lax.ragged_dot_general over w as stored) or `tokamax_ragged`
  (tokamax.ragged_dot, which takes rhs [G, K, N]: w transposed in the same pass as its
  bf16 cast).
- `capacity`: the capacity-based layer (Switch / GShard; MaxText's dropping path):
  each expert takes at most C = ceil(1.25 T k / G) copies, in token order; later copies
  are dropped (they add 0 to y). Dispatch by index (a scatter into [G, C, d] and a
  gather back, not a one-hot einsum, whose [T k, G, C] dispatch tensor alone is 5.4e9
  elements at Qwen3-30B-A3B's shape), the expert GEMMs one batched einsum over [G, C, *]:
  it computes 1.25 T k rows where the dropless layers compute T k.
"""

from __future__ import annotations

import math

CAPACITY_FACTOR = 1.25


def lax_ragged(rows, w, group_sizes):
    """rows [M, K] . w[g] [N, K]^T per group: jax.lax.ragged_dot_general over w as stored."""
    import jax

    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
    )
    return jax.lax.ragged_dot_general(rows, w, group_sizes, dims)


def tokamax_ragged():
    """The same GEMM by tokamax.ragged_dot (its default implementation); ImportError where
    tokamax does not import (benchmarks/families/grouped.py says how to install it offline)."""
    import jax.numpy as jnp

    from benchmarks.families.grouped import import_tokamax

    tokamax = import_tokamax()
    return lambda rows, w, group_sizes: tokamax.ragged_dot(rows, jnp.swapaxes(w, 1, 2), group_sizes)


def _swiglu(g, u):
    import jax
    import jax.numpy as jnp

    return (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(jnp.bfloat16)


def _combine(copies, expert_weights):
    """[T, k, d] outputs in copy order -> y [T, d] bf16, weighted in FP32."""
    import jax.numpy as jnp

    return jnp.einsum("tk,tkd->td", expert_weights.astype(jnp.float32), copies.astype(jnp.float32)).astype(jnp.bfloat16)


def dropless(ragged):
    """The dropless layer over the grouped GEMM `ragged` (lax_ragged, tokamax_ragged())."""
    import jax.numpy as jnp

    def layer(x, w_gate, w_up, w_down, expert_ids, expert_weights):
        tokens, k = expert_ids.shape
        groups = w_gate.shape[0]
        flat = expert_ids.reshape(-1)
        perm = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=groups).astype(jnp.int32)
        rows = x[perm // k]
        bf16 = lambda w: w.astype(jnp.bfloat16)
        h = _swiglu(ragged(rows, bf16(w_gate), sizes), ragged(rows, bf16(w_up), sizes))
        out = ragged(h, bf16(w_down), sizes)
        copies = jnp.zeros_like(out).at[perm].set(out)
        return _combine(copies.reshape(tokens, k, -1), expert_weights)

    return layer


def capacity_of(tokens: int, k: int, groups: int, factor: float = CAPACITY_FACTOR) -> int:
    return math.ceil(factor * tokens * k / groups)


def capacity(factor: float = CAPACITY_FACTOR):
    """The capacity-based layer: each expert's first C copies (token order), the rest dropped."""
    import jax
    import jax.numpy as jnp

    def layer(x, w_gate, w_up, w_down, expert_ids, expert_weights):
        tokens, k = expert_ids.shape
        groups, d = w_gate.shape[0], x.shape[1]
        cap = capacity_of(tokens, k, groups, factor)
        flat = expert_ids.reshape(-1)  # copy c = t k + j
        onehot = jax.nn.one_hot(flat, groups, dtype=jnp.int32)
        position = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)  # in its expert's queue
        slot = jnp.where(position < cap, position, cap)  # cap: out of bounds, dropped
        buf = jnp.zeros((groups, cap, d), jnp.bfloat16).at[flat, slot].set(x[jnp.arange(tokens * k) // k], mode="drop")
        bf16 = lambda w: w.astype(jnp.bfloat16)
        g = jnp.einsum("gcd,gfd->gcf", buf, bf16(w_gate))
        u = jnp.einsum("gcd,gfd->gcf", buf, bf16(w_up))
        out = jnp.einsum("gcf,gdf->gcd", _swiglu(g, u), bf16(w_down))
        copies = out.at[flat, slot].get(mode="fill", fill_value=0)  # a dropped copy: 0
        return _combine(copies.reshape(tokens, k, d), expert_weights)

    return layer
