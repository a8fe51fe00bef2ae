"""A small decoder language model in Flax NNX, trained with optax, every projection on jax_cake.

The model is plain Flax: nnx.Linear / nnx.LinearGeneral layers with float32 parameters
(param_dtype) computing in bfloat16 (dtype). Passing
`dot_general=jax_cake.dot_general, promote_dtype=jax_cake.promote_dtype` to each layer
is the only change: the q/k/v, output and LM-head projections run on jax_cake's GEMMs
with Flax's [d_in, d_out] kernels as they are (no transposed copy), and each float32
kernel's gradient comes from the GEMM's FP32 accumulator. The SwiGLU MLP is a small NNX
module holding its three float32 weights apart, in jax_cake's [d_out, d_in] layout, that
calls `jax_cake.swiglu_mlp` (gate and up as one GEMM with the activation after it, the
down projection adding the residual); without jax_cake the same module runs the same
math on `jnp.dot`. Attention scores, the embedding lookup and the norms are ordinary XLA
ops.

Task: next-token prediction on sequences that follow a fixed random permutation of the
vocabulary (token t+1 = perm[token t]); the loss falls from log(vocab) towards zero.
The script exits with status 1 if the loss did not fall.

    python examples/flax_train.py                                   # CPU, seconds
    python examples/flax_train.py --steps=300 --batch=32 --seq=1024 --d_model=1024 \\
        --heads=8 --layers=4 --vocab=32768                          # a GPU run
"""

import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax
from absl import app, flags
from flax import nnx

import jax_cake

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 40, "Training steps (the first one includes compilation).")
flags.DEFINE_integer("batch", 8, "Sequences per step.")
flags.DEFINE_integer("seq", 32, "Tokens per sequence.")
flags.DEFINE_integer("vocab", 64, "Vocabulary size; a multiple of 8 keeps the LM head on the GPU kernels.")
flags.DEFINE_integer("d_model", 64, "Model width; a multiple of 8 keeps the GPU kernels eligible.")
flags.DEFINE_integer("heads", 4, "Attention heads; must divide d_model.")
flags.DEFINE_integer("d_ff", 0, "MLP width (0: 8/3 x d_model rounded up to a multiple of 16, as the kernels like).")
flags.DEFINE_integer("layers", 2, "Decoder blocks.")
flags.DEFINE_float("lr", 3e-3, "AdamW learning rate.")
flags.DEFINE_integer("seed", 0, "Seed for weights and data.")
flags.DEFINE_bool("jax_cake", True, "Route the projections through jax_cake (False: plain Flax, for comparison).")
flags.DEFINE_integer("log_every", 10, "Print the loss every this many steps.")

BF16, F32 = jnp.bfloat16, jnp.float32


def projection_options(use_jax_cake: bool) -> dict:
    """What every projection layer gets: bf16 compute, float32 master parameters, the hooks."""
    options = dict(dtype=BF16, param_dtype=F32)
    if use_jax_cake:
        options.update(dot_general=jax_cake.dot_general, promote_dtype=jax_cake.promote_dtype)
    return options


class SwiGLU(nnx.Module):
    """y = residual + (silu(x Wg^T) * (x Wu^T)) Wd^T with float32 weights [d_out, d_in]."""

    def __init__(self, d_model: int, d_ff: int, use_jax_cake: bool, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2)  # fan-in is d_in, the last axis
        self.w_gate = nnx.Param(init(rngs.params(), (d_ff, d_model), F32))
        self.w_up = nnx.Param(init(rngs.params(), (d_ff, d_model), F32))
        self.w_down = nnx.Param(init(rngs.params(), (d_model, d_ff), F32))
        self.use_jax_cake = use_jax_cake

    def __call__(self, x, residual):
        w_gate, w_up, w_down = self.w_gate[...], self.w_up[...], self.w_down[...]
        if self.use_jax_cake:
            return jax_cake.swiglu_mlp(x, w_gate, w_up, w_down, residual=residual)
        gate, up = (jnp.dot(x, w.astype(BF16).T) for w in (w_gate, w_up))
        return residual + jnp.dot(jax.nn.silu(gate) * up, w_down.astype(BF16).T)


class Block(nnx.Module):
    """Pre-norm decoder block: causal multi-head attention, then a SwiGLU MLP."""

    def __init__(self, d_model: int, d_ff: int, heads: int, use_jax_cake: bool, options: dict, rngs: nnx.Rngs):
        head_dim = d_model // heads
        self.norm1 = nnx.RMSNorm(d_model, dtype=BF16, param_dtype=F32, rngs=rngs)
        self.q = nnx.LinearGeneral(d_model, (heads, head_dim), use_bias=False, rngs=rngs, **options)
        self.k = nnx.LinearGeneral(d_model, (heads, head_dim), use_bias=False, rngs=rngs, **options)
        self.v = nnx.LinearGeneral(d_model, (heads, head_dim), use_bias=False, rngs=rngs, **options)
        self.o = nnx.LinearGeneral((heads, head_dim), d_model, axis=(-2, -1), use_bias=False, rngs=rngs, **options)
        self.norm2 = nnx.RMSNorm(d_model, dtype=BF16, param_dtype=F32, rngs=rngs)
        self.mlp = SwiGLU(d_model, d_ff, use_jax_cake, rngs)

    def __call__(self, x):
        h = self.norm1(x)
        q, k, v = self.q(h), self.k(h), self.v(h)  # [B, S, H, D] bf16
        # Attention scores and mixing have batch dimensions on both sides: plain XLA.
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=F32) / jnp.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        p = jax.nn.softmax(jnp.where(causal, s, -1e30), axis=-1).astype(BF16)
        x = x + self.o(jnp.einsum("bhqk,bkhd->bqhd", p, v))
        return self.mlp(self.norm2(x), residual=x)


class DecoderLM(nnx.Module):
    def __init__(
        self, vocab: int, d_model: int, d_ff: int, heads: int, layers: int, use_jax_cake: bool, rngs: nnx.Rngs
    ):
        options = projection_options(use_jax_cake)
        self.embed = nnx.Embed(vocab, d_model, param_dtype=F32, rngs=rngs)
        self.blocks = nnx.List([Block(d_model, d_ff, heads, use_jax_cake, options, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(d_model, dtype=BF16, param_dtype=F32, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, use_bias=False, rngs=rngs, **options)

    def __call__(self, tokens):
        x = self.embed(tokens).astype(BF16)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).astype(F32)  # logits


def batches(key, vocab: int, batch: int, seq: int):
    """Sequences that follow a fixed random permutation of the vocabulary."""
    perm_key, key = jax.random.split(key)
    perm = jax.random.permutation(perm_key, vocab)
    while True:
        key, start_key = jax.random.split(key)
        first = jax.random.randint(start_key, (batch,), 0, vocab)

        def step(tok, _):
            return perm[tok], tok

        _, tokens = jax.lax.scan(step, first, None, length=seq + 1)
        yield tokens.T  # [batch, seq + 1]


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit
def train_step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss


def main(argv):
    del argv
    if FLAGS.d_model % FLAGS.heads:
        raise app.UsageError(f"--heads={FLAGS.heads} must divide --d_model={FLAGS.d_model}")
    print(f"backend {jax.default_backend()}")
    d_ff = FLAGS.d_ff or 16 * math.ceil(8 * FLAGS.d_model / 3 / 16)
    model = DecoderLM(
        FLAGS.vocab, FLAGS.d_model, d_ff, FLAGS.heads, FLAGS.layers, FLAGS.jax_cake, nnx.Rngs(FLAGS.seed)
    )
    optimizer = nnx.Optimizer(model, optax.adamw(FLAGS.lr, weight_decay=0.01), wrt=nnx.Param)
    params = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(
        f"decoder LM: {FLAGS.layers} blocks, d_model {FLAGS.d_model}, SwiGLU d_ff {d_ff}, {FLAGS.heads} heads, "
        f"vocab {FLAGS.vocab}, {params:,} parameters; "
        f"projections on {'jax_cake' if FLAGS.jax_cake else 'lax.dot_general'}"
    )
    data = batches(jax.random.key(FLAGS.seed + 1), FLAGS.vocab, FLAGS.batch, FLAGS.seq)
    losses, times = [], []
    for step in range(FLAGS.steps):
        tokens = next(data)
        start = time.perf_counter()
        loss = float(train_step(model, optimizer, tokens))
        times.append(time.perf_counter() - start)
        losses.append(loss)
        if step % FLAGS.log_every == 0 or step == FLAGS.steps - 1:
            print(f"step {step:5d}  loss {loss:.6f}")
    print(f"loss {losses[0]:.6f} -> {losses[-1]:.6f}")
    if len(times) > 1:
        print(f"median step time {statistics.median(times[1:]) * 1e3:.2f} ms (after the first, compiling step)")
    if not losses[-1] < 0.9 * losses[0]:
        print("FAIL: the loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    app.run(main)  # exits with main's return value
