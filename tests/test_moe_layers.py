"""benchmarks/moe_layers.py, the MoE baselines of the model benchmark: the dropless layer
over lax's ragged dot computes jax_cake.moe_mlp's values and gradients; the capacity layer
computes the same where nothing is dropped and 0 for each dropped copy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cake as jc
from benchmarks import moe_layers
from helpers import rand, rel_err

T, D, F, G, K = 96, 64, 128, 4, 2


def _operands(seed=0):
    x = rand(seed, (T, D))
    ws = (rand(seed + 1, (G, F, D), jnp.float32, scale=D**-0.5), rand(seed + 2, (G, F, D), jnp.float32, scale=D**-0.5))
    wd = rand(seed + 3, (G, D, F), jnp.float32, scale=F**-0.5)
    logits = jax.random.normal(jax.random.key(seed + 4), (T, G)) + jnp.asarray([2.0, 0.0, 0.0, -1.0])  # expert 0 busy
    ew, ids = jax.lax.top_k(jax.nn.softmax(logits), K)
    return x, (*ws, wd), ids, ew


def _grads(layer, x, ws, ids, ew):
    loss = lambda x, ws, ew: jnp.mean(jnp.square(layer(x, *ws, ids, ew).astype(jnp.float32)))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, ws, ew)


def test_dropless_lax_layer_gives_moe_mlps_values_and_gradients():
    x, ws, ids, ew = _operands()
    y = jax.jit(moe_layers.dropless(moe_layers.lax_ragged))(x, *ws, ids, ew)
    assert y.dtype == jnp.bfloat16
    assert rel_err(y, jc.moe_mlp(x, *ws, ids, ew)) < 1e-2
    (l0, g0), (l1, g1) = (_grads(f, x, ws, ids, ew) for f in (moe_layers.dropless(moe_layers.lax_ragged), jc.moe_mlp))
    assert float(l0) == pytest.approx(float(l1), rel=1e-2)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        assert a.shape == b.shape and rel_err(a, b) < 2e-2


def test_capacity_layer_is_dropless_where_nothing_drops_and_drops_past_the_capacity():
    x, ws, ids, ew = _operands()
    dropless = jax.jit(moe_layers.dropless(moe_layers.lax_ragged))(x, *ws, ids, ew)
    roomy = jax.jit(moe_layers.capacity(factor=G))(x, *ws, ids, ew)  # C = T k: nothing drops
    assert rel_err(roomy, dropless) < 1e-2
    # factor 1.25: expert 0's copies past C (token order) add 0
    cap = moe_layers.capacity_of(T, K, G)
    flat = np.asarray(ids).reshape(-1)
    seen = np.zeros(G, int)
    kept = np.zeros(T * K, bool)
    for c, e in enumerate(flat):
        kept[c], seen[e] = seen[e] < cap, seen[e] + 1
    assert not kept.all(), "the routing should overflow expert 0"
    kept_ew = jnp.where(jnp.asarray(kept.reshape(T, K)), ew, 0.0)
    want = jc.moe_mlp(x, *ws, ids, kept_ew)  # the same layer with dropped copies weighted 0
    got = jax.jit(moe_layers.capacity())(x, *ws, ids, ew)
    assert rel_err(got, want) < 1e-2
