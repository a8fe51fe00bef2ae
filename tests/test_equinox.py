"""jax_cake.equinox.Linear against eqx.nn.Linear on CPU: fields, init, values, gradients,
vmap, "scalar" features, and the CUDA lowering (faked H200)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

eqx = pytest.importorskip("equinox")

from jax_cake.equinox import Linear  # noqa: E402
from helpers import f64, faked_device, rand, rel_err  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32


def test_same_fields_and_init_as_eqx():
    key = jax.random.key(0)
    for args in [(32, 16), (32, 16, False), ("scalar", 8), (8, "scalar"), (16, 8, True, BF16)]:
        ours, theirs = Linear(*args, key=key), eqx.nn.Linear(*args, key=key)
        assert [f.name for f in dataclasses.fields(ours)] == [f.name for f in dataclasses.fields(theirs)]
        for name in ("in_features", "out_features", "use_bias"):
            assert getattr(ours, name) == getattr(theirs, name)
        assert jax.tree.structure(ours.weight) == jax.tree.structure(theirs.weight)
        np.testing.assert_array_equal(np.asarray(ours.weight, F32), np.asarray(theirs.weight, F32))
        assert (ours.bias is None) == (theirs.bias is None)


def test_float32_inputs_compute_as_eqx():
    theirs = eqx.nn.Linear(32, 16, key=jax.random.key(1))
    ours = Linear.from_eqx(theirs)
    x = rand(2, (5, 32), F32)
    np.testing.assert_array_equal(np.asarray(jax.vmap(ours)(x)), np.asarray(jax.vmap(theirs)(x)))
    np.testing.assert_allclose(np.asarray(ours(x)), np.asarray(jax.vmap(theirs)(x)), rtol=1e-6, atol=1e-6)
    g_ours = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(ours)
    g_theirs = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(theirs)
    np.testing.assert_array_equal(np.asarray(g_ours.weight), np.asarray(g_theirs.weight))


@pytest.mark.parametrize("batched_call", [True, False], ids=["batch", "vmap"])
def test_bf16_inputs_run_on_jax_cake_with_an_fp32_master_weight(batched_call):
    layer = Linear(64, 48, key=jax.random.key(3))
    x, g = rand(4, (37, 64), BF16), rand(5, (37, 48), BF16)
    apply = (lambda m, x: m(x)) if batched_call else (lambda m, x: jax.vmap(m)(x))
    y, vjp = jax.vjp(apply, layer, x)
    d_layer, dx = vjp(g)
    w16, b16 = f64(layer.weight.astype(BF16)), f64(layer.bias.astype(BF16))
    assert y.dtype == BF16 and dx.dtype == BF16 and d_layer.weight.dtype == F32
    assert rel_err(y, f64(x) @ w16.T + b16) < 1e-2
    assert rel_err(dx, f64(g) @ w16) < 1e-2
    assert rel_err(d_layer.weight, f64(g).T @ f64(x)) < 1e-5  # from the accumulator
    assert not np.array_equal(np.asarray(d_layer.weight), np.asarray(d_layer.weight.astype(BF16).astype(F32)))
    # eqx.nn.Linear on the bf16-rounded weight gives the same values
    theirs = eqx.nn.Linear(64, 48, key=jax.random.key(3))
    theirs = eqx.tree_at(lambda m: (m.weight, m.bias), theirs, (theirs.weight.astype(BF16), theirs.bias.astype(BF16)))
    assert rel_err(y, f64(jax.vmap(theirs)(x))) < 1e-2


def test_scalar_features():
    key = jax.random.key(6)
    for args, x in [(("scalar", 8), rand(7, (), BF16)), ((8, "scalar"), rand(8, (8,), BF16))]:
        ours, theirs = Linear(*args, key=key), eqx.nn.Linear(*args, key=key)
        y = ours(x)
        assert y.shape == theirs(x.astype(F32)).shape
        assert rel_err(y, f64(theirs(x.astype(F32)))) < 2e-2


def test_lowers_to_jax_cake_custom_calls():
    layer = Linear(128, 64, key=jax.random.key(9))
    x = jax.ShapeDtypeStruct((256, 128), BF16)
    params, static = eqx.partition(layer, eqx.is_array)
    loss = lambda p, x: jnp.sum(eqx.combine(p, static)(x).astype(F32) ** 2)
    with faked_device():
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(params, x).lower(lowering_platforms=("cuda",)).as_text()
    for op in ("fwd", "dgrad", "wgrad"):
        assert f"stablehlo.custom_call @jax_cake_{op}(" in text
    assert "dot_general" not in text and "stablehlo.transpose" not in text
