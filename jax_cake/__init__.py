"""jax_cake: fast, reproducible projection GEMMs for JAX training.

import jax_cake as jc
y = jc.dense_projection(x, w, deterministic=True)    # y = x @ w.T
q, k, v = jc.fused_projections(x, (wq, wk, wv))      # one GEMM launch each for fwd, dx, dw
y = jc.swiglu_mlp(x, w_gate, w_up, w_down)            # silu(x @ w_gate.T) * (x @ w_up.T) @ w_down.T
y = jc.grouped_projection(x, w, group_sizes)          # y[r] = x[r] @ w[group of r].T (MoE experts)
y = jc.moe_mlp(x, w_gate, w_up, w_down, ids, weights) # dropless MoE MLP: sum_j weights[t, j] MLP_ids[t, j](x[t])
print(jc.explain(jc.plan("wgrad", tokens=16384, d_in=4096, d_out=48)))
"""

from jax_cake import remat
from jax_cake.api import (
    batched_projection,
    dense_projection,
    fused_projections,
    gated_projection,
    grouped_gated_projection,
    grouped_projection,
    moe_mlp,
    ragged_dot,
    router_logits,
    swiglu_mlp,
)
from jax_cake.flax_adapter import dot_general, promote_dtype
from jax_cake.planner import Plan, explain, plan

from jax_cake.version import __version__

__all__ = [
    "Plan",
    "batched_projection",
    "dense_projection",
    "dot_general",
    "explain",
    "fused_projections",
    "gated_projection",
    "grouped_gated_projection",
    "grouped_projection",
    "moe_mlp",
    "plan",
    "promote_dtype",
    "ragged_dot",
    "remat",
    "router_logits",
    "swiglu_mlp",
]
