"""Gradient accumulation over micro-batches with the sum kept inside the wgrad kernel.

A two-layer MLP (x -> up -> GELU -> down) with float32 master weights. One training step
runs a `lax.scan` over the micro-batches of its batch; the carry holds the FP32 running
sums of the weight gradients. Each projection is called with
`grad_accumulator=<its running sum>`, so `jax.grad(loss, argnums=1)` returns the new sums:
the wgrad kernel adds each micro-batch's gradient into the sum in place (no separate
elementwise pass over the weight gradients). A parameter that is no projection weight
(here the output scale) is accumulated the ordinary way, from its own gradient.

Task: regress a fixed random linear map of the input (the loss must go down). Runs on
CPU (the XLA reference path) and on a supported GPU (the kernels):

    python examples/grad_accumulation.py
    python examples/grad_accumulation.py --micro_batches=4 --tokens=8192 --d_model=4096
"""

import math
import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

import jax_cake

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 30, "Training steps (the first one includes compilation).")
flags.DEFINE_integer("micro_batches", 4, "Micro-batches per step (the scan length).")
flags.DEFINE_integer("tokens", 256, "Tokens per micro-batch.")
flags.DEFINE_integer("d_model", 128, "Model width; a multiple of 8 keeps the GPU kernels eligible.")
flags.DEFINE_float("lr", 0.3, "SGD learning rate.")
flags.DEFINE_integer("seed", 0, "Seed for weights, data and the target map.")
flags.DEFINE_integer("log_every", 5, "Print the loss every this many steps.")

BF16, F32 = jnp.bfloat16, jnp.float32
PROJECTIONS = ("w_up", "w_down")  # accumulated inside the kernel


def init_params(key, d):
    k1, k2 = jax.random.split(key)
    return {
        "w_up": jax.random.normal(k1, (4 * d, d), F32) / math.sqrt(d),
        "w_down": jax.random.normal(k2, (d, 4 * d), F32) / math.sqrt(4 * d),
        "scale": jnp.ones((d,), F32),
    }


def loss_fn(params, sums, x, target):
    """Mean squared error of one micro-batch. sums: the running gradient sums of the
    projection weights (given to the projections; the forward does not read them)."""
    h = jax_cake.dense_projection(x, params["w_up"], grad_accumulator=sums["w_up"])
    h = jax.nn.gelu(h.astype(F32)).astype(BF16)
    y = jax_cake.dense_projection(h, params["w_down"], grad_accumulator=sums["w_down"])
    y = y.astype(F32) * params["scale"]
    return jnp.mean((y - target) ** 2)


def accumulate(params, xs, targets):
    """Sum over the micro-batches of every parameter's gradient (scan, FP32)."""

    def micro_step(carry, batch):
        sums, scale_sum, loss_sum = carry
        loss, (g_params, sums) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, sums, *batch)
        # g_params["w_up"] and ["w_down"] are zero: those gradients went into `sums`.
        return (sums, scale_sum + g_params["scale"], loss_sum + loss), None

    zeros = {name: jnp.zeros(params[name].shape, F32) for name in PROJECTIONS}
    init = (zeros, jnp.zeros_like(params["scale"]), jnp.zeros((), F32))
    (sums, scale_sum, loss_sum), _ = jax.lax.scan(micro_step, init, (xs, targets))
    return {**sums, "scale": scale_sum}, loss_sum / xs.shape[0]


@jax.jit
def train_step(params, xs, targets):
    grads, loss = accumulate(params, xs, targets)
    n = xs.shape[0]
    return jax.tree.map(lambda p, g: p - FLAGS.lr * g / n, params, grads), loss


def check_against_plain_gradients(params, xs, targets):
    """The accumulated sums equal the sum of the micro-batches' ordinary gradients."""

    def plain_loss(params, x, target):
        h = jax.nn.gelu(jax_cake.dense_projection(x, params["w_up"]).astype(F32)).astype(BF16)
        y = jax_cake.dense_projection(h, params["w_down"]).astype(F32) * params["scale"]
        return jnp.mean((y - target) ** 2)

    fused, _ = jax.jit(accumulate)(params, xs, targets)
    grad = jax.jit(jax.grad(plain_loss))
    plain = [grad(params, xs[i], targets[i]) for i in range(xs.shape[0])]
    for name in fused:
        ref = sum(np.asarray(g[name], np.float64) for g in plain)
        err = np.linalg.norm(np.asarray(fused[name], np.float64) - ref) / max(np.linalg.norm(ref), 1e-30)
        # FP32 sums of the same gradients (on GPU: bf16 activation rounding may differ by
        # kernel, so the tolerance is the FP32 wgrad target).
        if err > 1e-5:
            raise SystemExit(f"accumulated gradient of {name} is off by {err:.2e}")
    print("accumulated gradient matches the sum of micro-batch gradients")


def main(argv):
    del argv
    d, n, t = FLAGS.d_model, FLAGS.micro_batches, FLAGS.tokens
    print(f"backend {jax.default_backend()}")
    key_p, key_x, key_m = jax.random.split(jax.random.key(FLAGS.seed), 3)
    params = init_params(key_p, d)
    target_map = jax.random.normal(key_m, (d, d), F32) / math.sqrt(d)
    xs = jax.random.normal(key_x, (n, t, d), F32)
    targets = jnp.einsum("ntd,ed->nte", xs, target_map)
    xs = xs.astype(BF16)
    check_against_plain_gradients(params, xs, targets)
    times = []
    for step in range(FLAGS.steps):
        start = time.perf_counter()
        params, loss = train_step(params, xs, targets)
        loss = float(loss)
        times.append(time.perf_counter() - start)
        if step % FLAGS.log_every == 0 or step == FLAGS.steps - 1:
            print(f"step {step:4d} loss {loss:.5f}")
    if len(times) > 1:
        print(f"median step time {statistics.median(times[1:]) * 1e3:.2f} ms ({n} micro-batches of {t} tokens)")


if __name__ == "__main__":
    app.run(main)
