"""Flax layers with `dot_general=jax_cake.dot_general, promote_dtype=jax_cake.promote_dtype`
on CPU: values and gradients against float64 references of the same bf16 operands, an
optax training trajectory against the plain Flax model, the CUDA lowering (faked H200),
and examples/flax_train.py."""

import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_cake as jc
from helpers import REPO, child_env, f64, rand, rel_err, cuda_text

BF16, F32 = jnp.bfloat16, jnp.float32
BF16_TOL = 1e-2
FP32_WGRAD_TOL = 1e-5
HOOKS = dict(dot_general=jc.dot_general, promote_dtype=jc.promote_dtype)
MIXED = dict(dtype=BF16, param_dtype=F32)

# name -> (linen module factory, nnx module factory, input shape, contracted input axes)
LAYERS = {
    "dense": (
        lambda **kw: nn.Dense(48, **kw),
        lambda rngs, **kw: nnx.Linear(64, 48, rngs=rngs, **kw),
        (2, 24, 64),
        1,
    ),
    "dense_general_heads": (
        lambda **kw: nn.DenseGeneral(features=(4, 16), **kw),
        lambda rngs, **kw: nnx.LinearGeneral(64, (4, 16), rngs=rngs, **kw),
        (2, 24, 64),
        1,
    ),
    "dense_general_axes": (
        lambda **kw: nn.DenseGeneral(features=40, axis=(-2, -1), **kw),
        lambda rngs, **kw: nnx.LinearGeneral((4, 16), 40, axis=(-2, -1), rngs=rngs, **kw),
        (2, 24, 4, 16),
        2,
    ),
}


def _references(x, kernel, bias, g, n_contract):
    """float64 value (before the bf16 bias add), dx and the kernel gradient, for the
    bf16 operands (the kernel rounded to bf16) and the bf16 output cotangent g."""
    xr, kr, gr = f64(x), f64(kernel.astype(BF16)), f64(g)
    lead = xr.ndim - n_contract
    y = np.tensordot(xr, kr, axes=n_contract) + f64(bias.astype(BF16))
    dx = np.tensordot(gr, kr, axes=(list(range(lead, gr.ndim)), list(range(n_contract, kr.ndim))))
    dk = np.tensordot(xr, gr, axes=(list(range(lead)), list(range(lead))))
    return y, dx, dk


def _check(y, dx, dk, refs, plain_dk):
    y_ref, dx_ref, dk_ref = refs
    assert y.dtype == BF16 and dx.dtype == BF16 and dk.dtype == F32
    assert rel_err(y, y_ref) < BF16_TOL
    assert rel_err(dx, dx_ref) < BF16_TOL
    # The FP32 kernel gradient from the accumulator, not bf16-rounded ...
    assert rel_err(dk, dk_ref) < FP32_WGRAD_TOL
    assert not np.array_equal(np.asarray(dk), np.asarray(dk.astype(BF16).astype(F32)))
    # ... where plain Flax's (float32 in dtype) is bf16-rounded in value.
    np.testing.assert_array_equal(np.asarray(plain_dk), np.asarray(plain_dk.astype(BF16).astype(F32)))
    assert rel_err(plain_dk, dk_ref) > 10 * FP32_WGRAD_TOL


def _random_params(params, seed):
    leaves, tree = jax.tree.flatten(params)
    return jax.tree.unflatten(tree, [rand(seed + i, a.shape, a.dtype) * 0.1 for i, a in enumerate(leaves)])


@pytest.mark.parametrize("name", LAYERS)
def test_linen_layer_matches_float64(name):
    make, _, x_shape, n_contract = LAYERS[name]
    ours, plain = make(**MIXED, **HOOKS), make(**MIXED)
    x = rand(1, x_shape, BF16)
    params = _random_params(plain.init(jax.random.key(0), x), 10)  # a nonzero bias too
    g = rand(2, jax.eval_shape(plain.apply, params, x).shape, BF16)

    def value_and_grads(module):
        y, vjp = jax.vjp(jax.jit(module.apply), params, x)
        dparams, dx = vjp(g)
        return y, dx, dparams["params"]["kernel"]

    y, dx, dk = value_and_grads(ours)
    _, _, plain_dk = value_and_grads(plain)
    kernel, bias = params["params"]["kernel"], params["params"]["bias"]
    _check(y, dx, dk, _references(x, kernel, bias, g, n_contract), plain_dk)


@pytest.mark.parametrize("name", LAYERS)
def test_nnx_layer_matches_float64(name):
    _, make, x_shape, n_contract = LAYERS[name]
    ours, plain = make(nnx.Rngs(0), **MIXED, **HOOKS), make(nnx.Rngs(0), **MIXED)
    for model in (ours, plain):
        model.bias[...] = rand(11, model.bias[...].shape, F32) * 0.1
    x = rand(1, x_shape, BF16)
    g = rand(2, ours(x).shape, BF16)

    def value_and_grads(model):
        y = model(x)
        dx = jax.grad(lambda x: jnp.sum(model(x).astype(F32) * g.astype(F32)))(x)
        grads = nnx.grad(lambda m: jnp.sum(m(x).astype(F32) * g.astype(F32)))(model)
        return y, dx, grads["kernel"][...]

    y, dx, dk = value_and_grads(ours)
    _, _, plain_dk = value_and_grads(plain)
    _check(y, dx, dk, _references(x, ours.kernel[...], ours.bias[...], g, n_contract), plain_dk)


class MLP(nn.Module):
    """Dense -> GELU -> DenseGeneral (heads) -> DenseGeneral (two contracted axes)."""

    use_jax_cake: bool

    @nn.compact
    def __call__(self, x):
        kw = dict(MIXED, **(HOOKS if self.use_jax_cake else {}))
        h = jax.nn.gelu(nn.Dense(64, **kw)(x))
        h = jax.nn.gelu(nn.DenseGeneral((4, 16), **kw)(h))
        return nn.DenseGeneral(16, axis=(-2, -1), **kw)(h)


def _adamw_losses(use_jax_cake, steps=8):
    model = MLP(use_jax_cake)
    x = rand(20, (128, 32), BF16)
    target = jnp.tanh(f64(x)[:, :16] @ np.asarray(rand(21, (16, 16), F32)))
    params = MLP(False).init(jax.random.key(0), x)
    tx = optax.adamw(1e-2)

    def loss_fn(params):
        return jnp.mean((model.apply(params, x).astype(F32) - target) ** 2)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = tx.init(params), []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    return np.array(losses)


def test_adamw_trajectory_matches_plain_flax():
    ours, plain = _adamw_losses(True), _adamw_losses(False)
    assert ours[-1] < 0.8 * ours[0], ours
    np.testing.assert_allclose(ours, plain, rtol=2e-2)


# --- the CUDA lowering of a Flax model ------------------------------------------------------


def _specs(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _count(text, target):
    return sum(f"stablehlo.custom_call @{target}(" in line for line in text.splitlines())


def test_linen_train_step_lowers_every_dense_to_jax_cake_without_transposes():
    model = MLP(True)
    x = jax.ShapeDtypeStruct((256, 32), BF16)
    params = _specs(jax.eval_shape(MLP(False).init, jax.random.key(0), x))
    grad = jax.grad(lambda p, x: jnp.sum(model.apply(p, x).astype(F32) ** 2))
    text = cuda_text(grad, params, x)
    # three layers: forward on the dgrad GEMM, weight gradient on wgrad, dx on fwd
    assert (_count(text, "jax_cake_dgrad"), _count(text, "jax_cake_wgrad")) == (3, 3), text
    assert _count(text, "jax_cake_fwd") >= 2
    assert "stablehlo.transpose" not in text and "dot_general" not in text


def test_nnx_model_lowers_to_jax_cake_and_attention_to_lax():
    """q/k/v/o and MLP projections on jax_cake; fp32 attention einsums through the same
    hook stay lax.dot_general."""

    class Attention(nnx.Module):
        def __init__(self, rngs):
            self.qkv = nnx.LinearGeneral(64, (3, 4, 16), use_bias=False, rngs=rngs, **MIXED, **HOOKS)
            self.o = nnx.LinearGeneral((4, 16), 64, axis=(-2, -1), rngs=rngs, **MIXED, **HOOKS)
            self.up = nnx.Linear(64, 128, rngs=rngs, **MIXED, **HOOKS)

        def __call__(self, x):
            q, k, v = (a.astype(F32) for a in jnp.moveaxis(self.qkv(x), -3, 0))
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k, _dot_general=jc.dot_general)
            o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v, _dot_general=jc.dot_general)
            return self.up(self.o(o.astype(BF16)))

    graphdef, state = nnx.split(Attention(nnx.Rngs(0)))
    forward = lambda state, x: nnx.merge(graphdef, state)(x)
    text = cuda_text(forward, _specs(state), jax.ShapeDtypeStruct((2, 32, 64), BF16))
    assert _count(text, "jax_cake_dgrad") == 3 and text.count("stablehlo.custom_call @jax_cake") == 3, text
    assert text.count("stablehlo.dot_general") == 2  # QK^T and PV


class MLP32(nn.Module):
    """MLP's layers in FP32 throughout: the reference for its bf16 gradients."""

    @nn.compact
    def __call__(self, x):
        kw = dict(dtype=F32, param_dtype=F32)
        h = jax.nn.gelu(nn.Dense(64, **kw)(x))
        h = jax.nn.gelu(nn.DenseGeneral((4, 16), **kw)(h))
        return nn.DenseGeneral(16, axis=(-2, -1), **kw)(h)


def test_disable_env_lowers_the_flax_model_to_xla_with_its_values(monkeypatch):
    """JAX_CAKE_DISABLE: no jax_cake call in the CUDA lowering, and every gradient is the
    FP32 model's to bf16 accuracy: the three layers' bf16 activations put plain Flax 4-10e-3
    and jax_cake 4-7e-3 from it here (CPU, 2026-12-05), so 2e-2 passes both and fails any
    wrong GEMM."""
    x = rand(30, (64, 32), BF16)
    params = MLP(False).init(jax.random.key(0), x)

    def grad_of(model, x):
        return jax.jit(lambda p, x: jax.grad(lambda p: jnp.sum(model.apply(p, x).astype(F32) ** 2))(p))(params, x)

    monkeypatch.setenv("JAX_CAKE_DISABLE", "1")
    loss_grad = lambda p, x: jax.grad(lambda p: jnp.sum(MLP(True).apply(p, x).astype(F32) ** 2))(p)
    text = cuda_text(loss_grad, _specs(params), x)
    assert "custom_call @jax_cake" not in text and "dot_general" in text
    got, ref = grad_of(MLP(True), x), grad_of(MLP32(), x.astype(F32))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        assert g.dtype == F32 and rel_err(g, r) < 2 * BF16_TOL


# --- the example ----------------------------------------------------------------------------

STEP_LOSS = re.compile(r"^step\s+(\d+)\s+loss\s+([0-9.eE+-]+)", re.MULTILINE)


def run_flax_example(*flags, platform="cpu"):
    env = child_env(drop=("XLA_FLAGS",), JAX_PLATFORMS=platform)
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "flax_train.py"), *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"flax_train.py exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    losses = [float(loss) for _, loss in STEP_LOSS.findall(proc.stdout)]
    assert len(losses) >= 2 and losses[-1] < 0.9 * losses[0], proc.stdout
    assert "median step time" in proc.stdout
    return proc.stdout


def test_flax_train_example():
    stdout = run_flax_example("--steps=15", "--log_every=1", "--layers=1")
    assert stdout.startswith("backend cpu") and "projections on jax_cake" in stdout


def test_flax_train_example_fails_when_the_loss_does_not_fall():
    env = child_env(drop=("XLA_FLAGS",), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "flax_train.py"), "--steps=3", "--lr=0", "--layers=1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and "did not fall" in proc.stderr, proc.stdout + proc.stderr
