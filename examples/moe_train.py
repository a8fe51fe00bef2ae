"""Trains a dropless mixture-of-experts block with jax_cake and optax.

- Router: `jax_cake.router_logits(x f32 [T, d], w f32 [E, d])` -> f32 logits [T, E],
  computed as BF16x3 (near-FP32 accuracy at BF16 tensor-core speed); softmax, then
  `jax.lax.top_k` of the probabilities gives each token's k experts and their weights
  (renormalized to sum to 1).
- Experts: `jax_cake.moe_mlp(x bf16 [T, d], w_gate, w_up [E, F, d], w_down [E, d, F],
  expert_ids [T, k], expert_weights [T, k])`, a SwiGLU MLP per expert, **dropless**: every
  routed token is computed (no capacity, nothing dropped). Inside, the T k token copies are
  sorted by expert on the device and run as grouped GEMMs; the k outputs of a token are
  weighted and summed in FP32 in a fixed order, so the step is bitwise reproducible. FP32
  master weights get FP32 gradients; the router learns through the routing weights'
  gradient.
- Loss: the task (regress a fixed random nonlinear map of the tokens) plus a Switch-style
  load-balancing loss E * sum_e f_e p_e (f_e: the share of routed copies that go to expert
  e, p_e: its mean router probability), with Adam from optax.

The script exits 1 if the task loss does not fall.

    python examples/moe_train.py                              # E = 16, T = 512
    python examples/moe_train.py --experts=256 --tokens=8192  # a larger layer (GPU)
"""

import functools
import math
import statistics
import sys
import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import optax

import jax_cake

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 30, "Training steps (the first one includes compilation).")
flags.DEFINE_integer("tokens", 512, "Tokens T per step.")
flags.DEFINE_integer("d_model", 64, "Token width d.")
flags.DEFINE_integer("d_ff", 128, "Expert hidden width F.")
flags.DEFINE_integer("experts", 16, "Number of experts E.")
flags.DEFINE_integer("top_k", 2, "Experts per token k.")
flags.DEFINE_float("aux_weight", 0.01, "Weight of the load-balancing loss (Switch's 0.01).")
flags.DEFINE_float("lr", 3e-3, "Adam learning rate.")
flags.DEFINE_integer("seed", 0, "Seed for weights, data and the target map.")
flags.DEFINE_bool("deterministic", True, "Bitwise reproducible GEMMs (see jax_cake.plan).")
flags.DEFINE_integer("log_every", 5, "Print the loss every this many steps.")

BF16, F32 = jnp.bfloat16, jnp.float32


def init_params(key, experts, d_model, d_ff):
    k_router, k_gate, k_up, k_down = jax.random.split(key, 4)
    scale_in, scale_ff = 1 / math.sqrt(d_model), 1 / math.sqrt(d_ff)
    return {
        # Unit-scale logits at the start: a tiny router lets Adam's normalized steps grow a
        # few experts' rows first, and routing collapses onto them.
        "router": jax.random.normal(k_router, (experts, d_model), F32) * scale_in,
        "w_gate": jax.random.normal(k_gate, (experts, d_ff, d_model), F32) * scale_in,
        "w_up": jax.random.normal(k_up, (experts, d_ff, d_model), F32) * scale_in,
        "w_down": jax.random.normal(k_down, (experts, d_model, d_ff), F32) * scale_ff,
    }


def moe_block(params, x, *, top_k, deterministic):
    """x f32 [T, d] -> (y f32 [T, d], load-balancing loss, max expert load / mean load)."""
    experts = params["router"].shape[0]
    logits = jax_cake.router_logits(x, params["router"], deterministic=deterministic)  # FP32, BF16x3
    probs = jax.nn.softmax(logits, axis=-1)
    top_p, top_e = jax.lax.top_k(probs, top_k)  # [T, k]: int32 ids and their probabilities
    weights = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    y = jax_cake.moe_mlp(
        x.astype(BF16),
        params["w_gate"],
        params["w_up"],
        params["w_down"],
        top_e,
        weights,
        deterministic=deterministic,
    )
    # Switch-style balance loss: E * sum_e f_e p_e, f_e the share of the routed copies sent to
    # expert e (no gradient: it counts), p_e the mean probability (the router learns from it).
    share = jnp.mean(jax.nn.one_hot(top_e, experts, dtype=F32), axis=(0, 1))
    balance = experts * jnp.sum(share * jnp.mean(probs, axis=0))
    return y.astype(F32), balance, jnp.max(share) * experts


def main(argv):
    del argv
    if not FLAGS["verbosity"].present:  # hide jax's INFO line about the absent TPU backend
        logging.set_verbosity(logging.WARNING)
    if not 1 <= FLAGS.top_k <= FLAGS.experts or FLAGS.steps < 2:
        raise app.UsageError("need 1 <= top_k <= experts and steps >= 2")
    param_key, map_key, data_key = jax.random.split(jax.random.key(FLAGS.seed), 3)
    params = init_params(param_key, FLAGS.experts, FLAGS.d_model, FLAGS.d_ff)
    map_a, map_b = jax.random.normal(map_key, (2, FLAGS.d_model, FLAGS.d_model), F32) / math.sqrt(FLAGS.d_model)
    optimizer = optax.adam(FLAGS.lr)
    opt_state = optimizer.init(params)
    block = functools.partial(moe_block, top_k=FLAGS.top_k, deterministic=FLAGS.deterministic)

    def loss_fn(params, x):
        y, balance, peak = block(params, x)
        task = jnp.mean((y - jnp.tanh(x @ map_a) @ map_b) ** 2)
        return task + FLAGS.aux_weight * balance, (task, balance, peak)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, step):
        x = jax.random.normal(jax.random.fold_in(data_key, step), (FLAGS.tokens, FLAGS.d_model), F32)
        grads, metrics = jax.grad(loss_fn, has_aux=True)(params, x)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    print(
        f"backend {jax.default_backend()}, T {FLAGS.tokens}, E {FLAGS.experts}, top_k {FLAGS.top_k}, "
        f"dropless, deterministic {FLAGS.deterministic}, Adam lr {FLAGS.lr:.3g}"
    )
    times, losses = [], []
    for step in range(FLAGS.steps):
        start = time.perf_counter()
        params, opt_state, (task, balance, peak) = train_step(params, opt_state, jnp.int32(step))
        losses.append(float(task))  # blocks until the step is done
        times.append(time.perf_counter() - start)
        if step % FLAGS.log_every == 0 or step == FLAGS.steps - 1:
            print(
                f"step {step:5d}  loss {losses[-1]:.6f}  balance {float(balance):.4f}  "
                f"busiest expert {float(peak):.2f}x the mean load"
            )
    print(f"loss {losses[0]:.6f} -> {losses[-1]:.6f}")
    print(
        f"median step time {1e3 * statistics.median(times[1:]):.3f} ms "
        f"over {FLAGS.steps - 1} steps (first step with compile {1e3 * times[0]:.0f} ms)"
    )
    if not losses[-1] < 0.9 * losses[0]:
        print(f"FAIL: the loss did not fall (lr {FLAGS.lr:.3g}; try another --lr or more --steps)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    app.run(main)  # exits with main's return value
