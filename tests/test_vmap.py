"""vmap of the jax_cake ops: equal to the unbatched loop, and one kernel call, never a loop.

A weight shared across the vmapped axis folds the batch into the tokens; per-batch
weights use the batched program. The CUDA lowering (faked H200, checked on CPU) has no
`while` and one custom call per GEMM.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cake as jc
from helpers import f64, rand, rel_err, cuda_text

BF16, F32 = jnp.bfloat16, jnp.float32
V, T, K, O = 3, 24, 32, 16


def _loop(f, in_axes, *args, out_axes=0):
    """f over the mapped axis one entry at a time, stacked: what vmap must equal."""
    size = next(a.shape[ax] for a, ax in zip(args, in_axes) if ax is not None)
    outs = [f(*(a if ax is None else jnp.take(a, i, axis=ax) for a, ax in zip(args, in_axes))) for i in range(size)]
    return jax.tree.map(lambda *o: jnp.stack(o, axis=out_axes), *outs)


def _equal(a, b, tol=0.0):
    if tol == 0.0:
        a, b = f64(a), f64(b)
        assert a.shape == b.shape, (a.shape, b.shape)
        np.testing.assert_array_equal(a, b)
    else:
        assert rel_err(a, b) <= tol


@pytest.mark.parametrize(
    "x_shape,w_shape,in_axes,out_axes",
    [
        ((V, T, K), (O, K), (0, None), 0),  # shared weight: folded into the tokens
        ((V, T, K), (V, O, K), (0, 0), 0),  # per-batch weights: the batched program
        ((T, V, K), (O, K), (1, None), 1),  # the mapped axis elsewhere, in and out
        ((T, K), (V, O, K), (None, 0), 0),  # only the weight mapped
        ((V, 2, 5, K), (O, K), (0, None), 0),  # x with several token dimensions
    ],
)
@pytest.mark.parametrize("w_dtype", [F32, BF16])
def test_vmap_of_dense_projection_equals_the_loop(x_shape, w_shape, in_axes, out_axes, w_dtype):
    x, w = rand(1, x_shape, BF16), rand(2, w_shape, w_dtype)
    got = jax.jit(jax.vmap(jc.dense_projection, in_axes=in_axes, out_axes=out_axes))(x, w)
    _equal(got, jax.jit(lambda x, w: _loop(jc.dense_projection, in_axes, x, w, out_axes=out_axes))(x, w))


def test_nested_vmap_equals_the_loop():
    x, w = rand(3, (2, V, T, K), BF16), rand(4, (2, O, K), F32)
    inner = jax.vmap(jc.dense_projection, in_axes=(0, None))  # over V, w shared
    got = jax.jit(jax.vmap(inner, in_axes=(0, 0)))(x, w)  # over the 2, w per entry
    want = jax.jit(
        lambda x, w: jnp.stack([jnp.stack([jc.dense_projection(x[i, j], w[i]) for j in range(V)]) for i in range(2)])
    )(x, w)
    _equal(got, want)


def _loss(y):
    return jnp.sum(jnp.sin(y.astype(F32)))


@pytest.mark.parametrize("in_axes", [(0, None), (0, 0)])
def test_grad_of_vmap_and_vmap_of_grad_equal_the_loop(in_axes):
    x = rand(5, (V, T, K), BF16)
    w = rand(6, (V, O, K) if in_axes[1] == 0 else (O, K), F32)
    vmapped = jax.vmap(jc.dense_projection, in_axes=in_axes)

    # grad of vmap: one loss over the batch
    dx, dw = jax.jit(jax.grad(lambda x, w: _loss(vmapped(x, w)), argnums=(0, 1)))(x, w)
    loop = lambda x, w: _loss(_loop(jc.dense_projection, in_axes, x, w))
    rdx, rdw = jax.jit(jax.grad(loop, argnums=(0, 1)))(x, w)
    _equal(dx, rdx)
    _equal(dw, rdw, 1e-6)  # per-entry FP32 sums added in another order

    # vmap of grad: per-entry gradients
    per_entry = jax.grad(lambda x, w: _loss(jc.dense_projection(x, w)), argnums=(0, 1))
    gx, gw = jax.jit(jax.vmap(per_entry, in_axes=in_axes))(x, w)
    want = jax.jit(lambda x, w: _loop(per_entry, in_axes, x, w))(x, w)
    _equal(gx, want[0])
    _equal(gw, want[1])


def test_vmap_of_batched_projection_and_router_equals_the_loop():
    x, w = rand(7, (V, 2, T, K), BF16), rand(8, (V, 2, O, K), F32)
    loop = jax.jit(_loop, static_argnums=(0, 1))
    _equal(jax.jit(jax.vmap(jc.batched_projection))(x, w), loop(jc.batched_projection, (0, 0), x, w))
    w_shared = rand(9, (2, O, K), F32)
    got = jax.jit(jax.vmap(jc.batched_projection, in_axes=(0, None)))(x, w_shared)
    _equal(got, loop(jc.batched_projection, (0, None), x, w_shared))

    xr, wr = rand(10, (V, T, K), F32), 0.1 * rand(11, (O, K), F32)
    for in_axes, w_ in (((0, None), wr), ((0, 0), jnp.stack([wr, 2 * wr, -wr]))):
        f = lambda x, w: jnp.sum(jnp.tanh(jax.vmap(jc.router_logits, in_axes=in_axes)(x, w)))
        g = lambda x, w: jnp.sum(jnp.tanh(_loop(jc.router_logits, in_axes, x, w)))
        _equal(jax.jit(jax.vmap(jc.router_logits, in_axes=in_axes))(xr, w_), loop(jc.router_logits, in_axes, xr, w_), 1e-6)
        for a, b in zip(jax.jit(jax.grad(f, argnums=(0, 1)))(xr, w_), jax.jit(jax.grad(g, argnums=(0, 1)))(xr, w_)):
            _equal(a, b, 1e-5)


# --- the CUDA lowering: no loop, one custom call per GEMM ------------------------------------


def _calls(text, op):
    return [line for line in text.splitlines() if f"stablehlo.custom_call @jax_cake_{op}(" in line]


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_vmap_with_a_shared_weight_lowers_to_one_call_on_the_folded_tokens():
    f = jax.vmap(jc.dense_projection, in_axes=(0, None))
    text = cuda_text(f, _spec((8, 512, 256), BF16), _spec((128, 256), F32))
    assert "while" not in text
    (call,) = _calls(text, "fwd")
    assert "(tensor<1x4096x256xbf16>, tensor<1x128x256xbf16>) -> tensor<1x4096x128xbf16>" in call


def test_vmap_with_per_batch_weights_lowers_to_the_batched_program():
    f = jax.vmap(jc.dense_projection)
    text = cuda_text(f, _spec((8, 512, 256), BF16), _spec((8, 128, 256), F32))
    assert "while" not in text
    (call,) = _calls(text, "fwd")
    assert "(tensor<8x512x256xbf16>, tensor<8x128x256xbf16>) -> tensor<8x512x128xbf16>" in call


@pytest.mark.parametrize("in_axes", [(0, None), (0, 0)])
def test_grad_of_vmap_and_vmap_of_grad_lower_without_a_loop(in_axes):
    w_shape = (128, 256) if in_axes[1] is None else (8, 128, 256)
    args = (_spec((8, 512, 256), BF16), _spec(w_shape, F32))
    per_entry = jax.grad(lambda x, w: jnp.sum(jc.dense_projection(x, w).astype(F32) ** 2), argnums=(0, 1))
    vmapped = jax.vmap(jc.dense_projection, in_axes=in_axes)
    whole = jax.grad(lambda x, w: jnp.sum(vmapped(x, w).astype(F32) ** 2), argnums=(0, 1))
    for fn in (jax.vmap(per_entry, in_axes=in_axes), whole):
        text = cuda_text(fn, *args)
        assert "while" not in text
        assert [len(_calls(text, op)) for op in ("fwd", "dgrad", "wgrad")] == [1, 1, 1], text


def test_vmap_of_the_router_lowers_without_a_loop():
    f = jax.vmap(jax.grad(lambda x, w: jnp.sum(jc.router_logits(x, w) ** 2), argnums=(0, 1)), in_axes=(0, None))
    text = cuda_text(f, _spec((4, 1024, 512), F32), _spec((256, 512), F32))
    assert "while" not in text
    (fwd,) = _calls(text, "router_fwd")
    assert "tensor<4096x512xf32>" in fwd  # the vmapped tokens folded into one call
    assert len(_calls(text, "router_dgrad")) == 1
    # per-entry router weight gradients have no batched router program: XLA, batched
    assert not _calls(text, "router_wgrad") and "dot_general" in text
