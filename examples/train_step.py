"""Training step of a small transformer block whose projections run through jax_cake.

The block (RMSNorm -> q/k/v -> causal attention -> o, RMSNorm -> SwiGLU MLP gate/up ->
down) keeps float32 master weights [d_out, d_in] and bfloat16 activations. q/k/v share
an input and run as one `jax_cake.fused_projections`: one GEMM launch each for the
forward, dx and dw instead of one per weight; o is a `jax_cake.dense_projection`. The MLP
is one `jax_cake.swiglu_mlp` (gate and up as one GEMM with the activation after it, the
down projection with the residual add). Either way the forward takes BF16 products and each
weight gradient comes back in float32 straight from the wgrad accumulator. The block is
rematerialized with `jax_cake.remat.save_projections`: projection outputs are saved,
everything else (norms, attention softmax, SiLU) is recomputed in the backward.

Task: regress a fixed random linear map of the input tokens. The loss must fall: the
script exits with status 1 if the last step's loss is not below 0.9 x the first's.

Adam's learning rate is scaled with the width. Adam moves every weight entry by about
the rate per step, in a sign pattern that for this dense target is not aligned with a
fresh input, so a projection's output moves by about lr x sqrt(d_in): a fixed 3e-3,
which trains d_model=128, makes d_model=2048 diverge (on the XLA path as on the
kernels), while a 1 / d_model rate is stable but slow there. The default peak
rate is 3e-3 x sqrt(128 / d_model), reached by a linear warmup over the first tenth of
the steps; --lr and --warmup_steps override them.

Runs on CPU (XLA fallback) and on a supported GPU (AOT kernels):

    python examples/train_step.py
    python examples/train_step.py --steps=200 --batch=16 --seq=512 --d_model=1024
"""

import functools
import math
import statistics
import sys
import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp

import jax_cake

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 100, "Training steps (the first one includes compilation).")
flags.DEFINE_integer("batch", 8, "Sequences per step.")
flags.DEFINE_integer("seq", 64, "Tokens per sequence.")
flags.DEFINE_integer("d_model", 128, "Model width; a multiple of 8 keeps the GPU kernels eligible.")
flags.DEFINE_integer("heads", 4, "Attention heads; must divide d_model.")
flags.DEFINE_float(
    "lr", None, "Peak Adam learning rate (default: 3e-3 * sqrt(128 / d_model), the rate scaled with the width)."
)
flags.DEFINE_integer("warmup_steps", None, "Steps of linear learning-rate warmup (default: a tenth of --steps).")
flags.DEFINE_integer("seed", 0, "Seed for weights, data and the target map.")
flags.DEFINE_bool(
    "deterministic",
    True,
    "Bitwise reproducible weight gradients; False lets the planner pick split-K / stream-K where measured faster.",
)
flags.DEFINE_integer("log_every", 10, "Print the loss every this many steps.")

BF16, F32 = jnp.bfloat16, jnp.float32
BASE_LR, BASE_WIDTH = 3e-3, 128  # a rate that trains d_model=128, and that width


def default_lr(d_model: int) -> float:
    """The rate scaled with the width (see the module docstring)."""
    return BASE_LR * math.sqrt(BASE_WIDTH / d_model)


def init_params(key, d_model):
    """Float32 master weights, each [d_out, d_in] as dense_projection expects."""
    shapes = {
        "wq": (d_model, d_model),
        "wk": (d_model, d_model),
        "wv": (d_model, d_model),
        "wo": (d_model, d_model),
        "w_gate": (4 * d_model, d_model),
        "w_up": (4 * d_model, d_model),
        "w_down": (d_model, 4 * d_model),
    }
    keys = jax.random.split(key, len(shapes))
    params = {
        name: jax.random.normal(k, shape, F32) / math.sqrt(shape[1]) for k, (name, shape) in zip(keys, shapes.items())
    }
    params["attn_norm"] = jnp.ones((d_model,), F32)
    params["mlp_norm"] = jnp.ones((d_model,), F32)
    return params


def rms_norm(x, scale):
    # Statistics in float32: a bf16 mean of squares loses too many bits at d_model >= 1024.
    x32 = x.astype(F32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (x32 * scale).astype(BF16)


def block(params, x, *, heads, deterministic):
    """One pre-norm transformer block. x: bf16 [batch, seq, d_model] -> same."""

    def proj(h, name):
        return jax_cake.dense_projection(h, params[name], deterministic=deterministic)

    def fused(h, *names):  # projections of one input: one GEMM launch each for fwd, dx, dw
        return jax_cake.fused_projections(h, [params[n] for n in names], deterministic=deterministic)

    batch, seq, d_model = x.shape
    head_dim = d_model // heads
    h = rms_norm(x, params["attn_norm"])
    q, k, v = (y.reshape(batch, seq, heads, head_dim) for y in fused(h, "wq", "wk", "wv"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=F32)
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    scores = jnp.where(causal, scores / math.sqrt(head_dim), -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(BF16)
    attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, seq, d_model)
    x = x + proj(attn, "wo")
    h = rms_norm(x, params["mlp_norm"])
    w_gate, w_up, w_down = (params[n] for n in ("w_gate", "w_up", "w_down"))
    return jax_cake.swiglu_mlp(h, w_gate, w_up, w_down, residual=x, deterministic=deterministic)


def learning_rate(step, lr, warmup_steps):
    """Linear warmup from lr / warmup_steps to lr, then constant."""
    return lr * jnp.minimum(1.0, (step + 1) / max(warmup_steps, 1))


def adam(params, grads, state, step, lr, b1=0.9, b2=0.999, eps=1e-8):
    """Plain-jax Adam on the float32 master weights; state = (m, v); lr may be traced."""
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state[0], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state[1], grads)
    t = step + 1
    scale = lr * jnp.sqrt(1 - b2**t) / (1 - b1**t)
    params = jax.tree.map(lambda p, m, v: p - scale * m / (jnp.sqrt(v) + eps), params, m, v)
    return params, (m, v)


def make_train_step(target_map, *, batch, seq, heads, lr, warmup_steps, deterministic, data_key):
    remat_block = jax.checkpoint(
        lambda p, x: block(p, x, heads=heads, deterministic=deterministic), policy=jax_cake.remat.save_projections
    )

    def loss_fn(params, x):
        y = remat_block(params, x).astype(F32)
        target = x.astype(F32) @ target_map
        return jnp.mean((y - target) ** 2)

    @functools.partial(jax.jit, donate_argnums=(0, 1))  # update weights in place
    def train_step(params, opt_state, step):
        # Fresh synthetic batch per step, generated on the device (no host transfer).
        x = jax.random.normal(jax.random.fold_in(data_key, step), (batch, seq, target_map.shape[0]), F32).astype(BF16)
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        params, opt_state = adam(params, grads, opt_state, step, learning_rate(step, lr, warmup_steps))
        return params, opt_state, loss

    return train_step


def main(argv):
    del argv
    if not FLAGS["verbosity"].present:  # hide jax's INFO line about the absent TPU backend
        logging.set_verbosity(logging.WARNING)
    if FLAGS.d_model % FLAGS.heads or FLAGS.steps < 2:
        raise app.UsageError("need d_model % heads == 0 and steps >= 2")
    lr = default_lr(FLAGS.d_model) if FLAGS.lr is None else FLAGS.lr
    warmup_steps = FLAGS.steps // 10 if FLAGS.warmup_steps is None else FLAGS.warmup_steps
    param_key, map_key, data_key = jax.random.split(jax.random.key(FLAGS.seed), 3)
    params = init_params(param_key, FLAGS.d_model)
    target_map = jax.random.normal(map_key, (FLAGS.d_model,) * 2, F32) / math.sqrt(FLAGS.d_model)
    opt_state = tuple(jax.tree.map(jnp.zeros_like, params) for _ in range(2))
    train_step = make_train_step(
        target_map,
        batch=FLAGS.batch,
        seq=FLAGS.seq,
        heads=FLAGS.heads,
        lr=lr,
        warmup_steps=warmup_steps,
        deterministic=FLAGS.deterministic,
        data_key=data_key,
    )
    print(
        f"backend {jax.default_backend()}, tokens/step {FLAGS.batch * FLAGS.seq}, "
        f"d_model {FLAGS.d_model}, deterministic {FLAGS.deterministic}, "
        f"Adam lr {lr:.3g} after {warmup_steps} warmup steps"
    )
    # What the MLP down-projection's weight gradient runs (kernel program or XLA) and why.
    print(
        jax_cake.explain(
            jax_cake.plan(
                "wgrad",
                tokens=FLAGS.batch * FLAGS.seq,
                d_in=4 * FLAGS.d_model,
                d_out=FLAGS.d_model,
                out_dtype=F32,
                deterministic=FLAGS.deterministic,
            )
        )
    )

    times, losses = [], []
    for step in range(FLAGS.steps):
        start = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, jnp.int32(step))
        losses.append(float(loss))  # blocks until the step is done
        times.append(time.perf_counter() - start)
        if step % FLAGS.log_every == 0 or step == FLAGS.steps - 1:
            print(f"step {step:5d}  loss {losses[-1]:.6f}")
    print(f"loss {losses[0]:.6f} -> {losses[-1]:.6f}")
    print(
        f"median step time {1e3 * statistics.median(times[1:]):.3f} ms "
        f"over {FLAGS.steps - 1} steps (first step with compile {1e3 * times[0]:.0f} ms)"
    )
    if not losses[-1] < 0.9 * losses[0]:
        print(f"FAIL: the loss did not fall (lr {lr:.3g}; try a smaller --lr or more --steps)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    app.run(main)  # exits with main's return value
