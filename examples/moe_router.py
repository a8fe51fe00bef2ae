"""Mixture-of-experts layer: FP32 router GEMM plus per-expert projections via jax_cake.

- Router: `jax_cake.router_logits(x f32 [T, d], w f32 [E, d])` -> f32 logits [T, E],
  computed as BF16x3 (near-FP32 accuracy at BF16 tensor-core speed). E = 256 is the
  tuned case.
- Top-k routing with a fixed capacity C per expert: tokens beyond C are dropped (the
  usual Switch/GShard rule), so every expert sees a static [C, d] block.
- Experts: two `jax_cake.batched_projection(x bf16 [E, C, d_in], w f32 [E, d_out, d_in])`
  calls (up, GELU, down), float32 master weights, float32 weight gradients.

Task: regress a fixed random linear map of the tokens; loss must go down.

    python examples/moe_router.py                       # E = 256
    python examples/moe_router.py --experts=16 --tokens=256   # quick CPU run
"""

import functools
import math
import statistics
import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp

import jax_cake

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 30, "Training steps (the first one includes compilation).")
flags.DEFINE_integer("tokens", 1024, "Tokens T per step.")
flags.DEFINE_integer("d_model", 128, "Token width d; a multiple of 8 keeps the GPU kernels eligible.")
flags.DEFINE_integer("d_ff", 256, "Expert hidden width.")
flags.DEFINE_integer("experts", 256, "Number of experts E.")
flags.DEFINE_integer("top_k", 2, "Experts per token.")
flags.DEFINE_float("capacity_factor", 1.25, "Capacity C = ceil(T * top_k / E * factor).")
flags.DEFINE_float(
    "aux_weight",
    0.1,
    "Weight of the load-balancing loss (above Switch's "
    "0.01: this task gives all experts the same job, so only it spreads tokens).",
)
flags.DEFINE_float("lr", 3e-3, "Adam learning rate.")
flags.DEFINE_integer("seed", 0, "Seed for weights, data and the target map.")
flags.DEFINE_bool("deterministic", True, "Bitwise reproducible GEMMs (see jax_cake.plan).")
flags.DEFINE_integer("log_every", 5, "Print the loss every this many steps.")

BF16, F32 = jnp.bfloat16, jnp.float32


def init_params(key, experts, d_model, d_ff):
    k_router, k_up, k_down = jax.random.split(key, 3)
    return {
        # Unit-scale logits at the start: a tiny router lets Adam's normalized steps
        # grow a few experts' rows first, and routing collapses onto them.
        "router": jax.random.normal(k_router, (experts, d_model), F32) / math.sqrt(d_model),
        "w_up": jax.random.normal(k_up, (experts, d_ff, d_model), F32) / math.sqrt(d_model),
        "w_down": jax.random.normal(k_down, (experts, d_model, d_ff), F32) / math.sqrt(d_ff),
    }


def moe_layer(params, x, *, top_k, capacity, deterministic):
    """x f32 [T, d] -> (y f32 [T, d], load-balancing loss, fraction of dropped routes)."""
    tokens = x.shape[0]
    experts = params["router"].shape[0]
    logits = jax_cake.router_logits(x, params["router"], deterministic=deterministic)
    probs = jax.nn.softmax(logits, axis=-1)
    top_p, top_e = jax.lax.top_k(probs, top_k)  # [T, k]
    gates = top_p / jnp.sum(top_p, axis=-1, keepdims=True)

    # Slot of each route inside its expert, first choices of all tokens before second
    # choices (choice-major order), so a full expert drops second choices first.
    route_e = top_e.T.reshape(-1)  # [k * T]
    route_gate = gates.T.reshape(-1)
    route_token = jnp.tile(jnp.arange(tokens), top_k)
    onehot = jax.nn.one_hot(route_e, experts, dtype=jnp.int32)
    slot = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), route_e[:, None], axis=1)[:, 0] - 1
    kept = slot < capacity

    # Dispatch: out-of-capacity slots are out of bounds and dropped by the scatter.
    x_bf16 = x.astype(BF16)
    expert_in = jnp.zeros((experts, capacity, x.shape[1]), BF16)
    expert_in = expert_in.at[route_e, slot].set(x_bf16[route_token], mode="drop")
    hidden = jax.nn.gelu(jax_cake.batched_projection(expert_in, params["w_up"], deterministic=deterministic))
    expert_out = jax_cake.batched_projection(hidden, params["w_down"], deterministic=deterministic)  # [E, C, d]

    # Combine: gather each kept route's output, weight by its gate, sum over choices.
    routed = expert_out.at[route_e, slot].get(mode="fill", fill_value=0).astype(F32)
    routed = routed * (route_gate * kept)[:, None]
    y = routed.reshape(top_k, tokens, -1).sum(axis=0)

    # Switch-Transformer balance loss: E * sum_e (share of first choices) * (mean prob).
    first_choice_share = jnp.mean(jax.nn.one_hot(top_e[:, 0], experts, dtype=F32), axis=0)
    balance = experts * jnp.sum(first_choice_share * jnp.mean(probs, axis=0))
    return y, balance, 1.0 - jnp.mean(kept)


def adam(params, grads, state, step, lr, b1=0.9, b2=0.999, eps=1e-8):
    """Plain-jax Adam on the float32 master weights; state = (m, v)."""
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state[0], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state[1], grads)
    t = step + 1
    scale = lr * jnp.sqrt(1 - b2**t) / (1 - b1**t)
    params = jax.tree.map(lambda p, m, v: p - scale * m / (jnp.sqrt(v) + eps), params, m, v)
    return params, (m, v)


def main(argv):
    del argv
    if not FLAGS["verbosity"].present:  # hide jax's INFO line about the absent TPU backend
        logging.set_verbosity(logging.WARNING)
    if not 1 <= FLAGS.top_k <= FLAGS.experts or FLAGS.steps < 2:
        raise app.UsageError("need 1 <= top_k <= experts and steps >= 2")
    capacity = math.ceil(FLAGS.tokens * FLAGS.top_k / FLAGS.experts * FLAGS.capacity_factor)
    param_key, map_key, data_key = jax.random.split(jax.random.key(FLAGS.seed), 3)
    params = init_params(param_key, FLAGS.experts, FLAGS.d_model, FLAGS.d_ff)
    target_map = jax.random.normal(map_key, (FLAGS.d_model,) * 2, F32) / math.sqrt(FLAGS.d_model)
    opt_state = tuple(jax.tree.map(jnp.zeros_like, params) for _ in range(2))
    layer = functools.partial(moe_layer, top_k=FLAGS.top_k, capacity=capacity, deterministic=FLAGS.deterministic)

    def loss_fn(params, x):
        y, balance, dropped = layer(params, x)
        task = jnp.mean((y - x @ target_map) ** 2)
        return task + FLAGS.aux_weight * balance, (task, balance, dropped)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, step):
        x = jax.random.normal(jax.random.fold_in(data_key, step), (FLAGS.tokens, FLAGS.d_model), F32)
        grads, metrics = jax.grad(loss_fn, has_aux=True)(params, x)
        params, opt_state = adam(params, grads, opt_state, step, FLAGS.lr)
        return params, opt_state, metrics

    print(
        f"backend {jax.default_backend()}, T {FLAGS.tokens}, E {FLAGS.experts}, "
        f"top_k {FLAGS.top_k}, capacity {capacity}, deterministic {FLAGS.deterministic}"
    )
    times, losses = [], []
    for step in range(FLAGS.steps):
        start = time.perf_counter()
        params, opt_state, (task, balance, dropped) = train_step(params, opt_state, jnp.int32(step))
        losses.append(float(task))  # blocks until the step is done
        times.append(time.perf_counter() - start)
        if step % FLAGS.log_every == 0 or step == FLAGS.steps - 1:
            print(
                f"step {step:5d}  loss {losses[-1]:.6f}  balance {float(balance):.4f}  "
                f"dropped {100 * float(dropped):.1f}%"
            )
    print(f"loss {losses[0]:.6f} -> {losses[-1]:.6f}")
    print(
        f"median step time {1e3 * statistics.median(times[1:]):.3f} ms "
        f"over {FLAGS.steps - 1} steps (first step with compile {1e3 * times[0]:.0f} ms)"
    )


if __name__ == "__main__":
    app.run(main)
