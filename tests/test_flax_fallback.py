"""Flax layers with jax_cake's hooks against the same layers without them, over the product
of the layer options: every call that `jc.dot_general` does not route to jax_cake's GEMMs
computes bitwise what plain Flax (its promote_dtype, then `lax.dot_general`) computes,
value and gradients; every routed call agrees with plain Flax within bf16 rounding.

"Routed" is read off the traced forward program (a jax_cake custom_vjp whose output
carries jax_cake's checkpoint name), never assumed from the options. Where the hooked
layer's forward program is plain Flax's, character for character (a float32 layer, say),
its value and gradients are the same computation and are not run; every other call is
run, forward and backward, on both layers. The product runs eagerly (a jit per case
would compile more than it runs)."""

import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_cake as jc
from helpers import rand, rel_err

BF16, F32 = jnp.bfloat16, jnp.float32
BF16_TOL = 1e-2
HIGHEST = lax.Precision.HIGHEST


def _dot_general(hooked, preferred):
    """The layer's dot_general: jax_cake's or lax's, with preferred_element_type set
    (linen's layers have no preferred_element_type field, so it goes in the function)."""
    base = jc.dot_general if hooked else lax.dot_general
    return base if preferred is None else functools.partial(base, preferred_element_type=preferred)


def _linen(make, x_shape):
    """A linen layer: build(hooked, *options) -> (apply(params, x), the parameters' shapes;
    None for the hooked module, which takes the plain module's parameters)."""

    def build(hooked, dtype, param_dtype, precision, preferred, use_bias):
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, use_bias=use_bias)
        kw["dot_general"] = _dot_general(hooked, preferred)
        if hooked:
            return make(**kw, promote_dtype=jc.promote_dtype).apply, None
        module = make(**kw)
        return module.apply, jax.eval_shape(module.init, jax.random.key(0), jax.ShapeDtypeStruct(x_shape, BF16))

    return build, x_shape


def _nnx(make, x_shape, hooks):
    """An nnx layer: build(hooked, *options) -> (apply(state, x), its state)."""

    def build(hooked, dtype, param_dtype, precision, preferred, use_bias):
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, preferred_element_type=preferred)
        kw["kernel_init"] = nnx.initializers.zeros  # cheap; _randomized fills in the values
        graphdef, state = nnx.split(make(nnx.Rngs(0), use_bias, **kw, **(hooks if hooked else {})))
        return (lambda state, x: nnx.merge(graphdef, state)(x)), state

    return build, x_shape


NNX_HOOKS = dict(dot_general=jc.dot_general, promote_dtype=jc.promote_dtype)
# nnx.Einsum takes an einsum_op, not a dot_general: jnp.einsum hands its contraction to
# `_dot_general`. It keeps Flax's promote_dtype: from an uncast float32 kernel jnp.einsum
# would pick a float32 result itself (see jax_cake.promote_dtype).
EINSUM_HOOKS = dict(einsum_op=functools.partial(jnp.einsum, _dot_general=jc.dot_general))

# name -> (builder, input shape): 8 x 16 -> 24 (or (4, 6) features).
LAYERS = {
    "linen_dense": _linen(lambda **kw: nn.Dense(24, **kw), (8, 16)),
    "linen_dense_general": _linen(lambda **kw: nn.DenseGeneral((4, 6), **kw), (8, 16)),
    "nnx_linear": _nnx(lambda rngs, b, **kw: nnx.Linear(16, 24, use_bias=b, rngs=rngs, **kw), (8, 16), NNX_HOOKS),
    "nnx_linear_general": _nnx(
        lambda rngs, b, **kw: nnx.LinearGeneral(16, (4, 6), use_bias=b, rngs=rngs, **kw), (8, 16), NNX_HOOKS
    ),
    "nnx_einsum": _nnx(
        lambda rngs, b, **kw: nnx.Einsum("bd,df->bf", (16, 24), (24,) if b else None, rngs=rngs, **kw),
        (8, 16),
        EINSUM_HOOKS,
    ),
}
# More layouts, over the dtype options only (default precision, with a bias): batch
# dimensions (never routed) and two contracted axes.
MORE_LAYERS = {
    "linen_dense_general_batch": _linen(lambda **kw: nn.DenseGeneral(24, batch_dims=(0,), **kw), (2, 8, 16)),
    "nnx_linear_general_batch": _nnx(
        lambda rngs, b, **kw: nnx.LinearGeneral(16, 24, batch_axis={0: 2}, use_bias=b, rngs=rngs, **kw),
        (2, 8, 16),
        NNX_HOOKS,
    ),
    "nnx_linear_general_axes": _nnx(
        lambda rngs, b, **kw: nnx.LinearGeneral((4, 4), 24, axis=(-2, -1), use_bias=b, rngs=rngs, **kw),
        (8, 4, 4),
        NNX_HOOKS,
    ),
}

DTYPES = {"None": None, "bf16": BF16, "f32": F32}
PARAM_DTYPES = {"f32": F32, "bf16": BF16}
PRECISIONS = {"default": None, "highest": HIGHEST}
PREFERRED = {"None": None, "f32": F32, "bf16": BF16}
BIAS = {"bias": True, "nobias": False}


def _product(layers, precisions, biases):
    cases = itertools.product(layers, DTYPES, PARAM_DTYPES, precisions, PREFERRED, biases)
    return [
        pytest.param(*c, id=f"{c[0]}-dtype_{c[1]}-param_{c[2]}-{c[3]}-pet_{c[4]}-{c[5]}") for c in cases
    ]


PRODUCT = _product(LAYERS, PRECISIONS, BIAS) + _product(MORE_LAYERS, ["default"], ["bias"])


def _normal(seed, shape, dtype, scale=1.0):
    """Random normal values rounded to dtype (numpy's generator: cheaper than jax.random
    for the many small arrays here)."""
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def _randomized(params, seed):
    """Nonzero random values for every parameter (Flax initializes biases to zero)."""
    leaves, tree = jax.tree.flatten(params)
    return jax.tree.unflatten(tree, [_normal(seed + i, a.shape, a.dtype, 0.25) for i, a in enumerate(leaves)])


def _value_and_grads(apply):
    """(params, x) -> (y, (dparams, dx)): the layer's value and its vjp of a fixed cotangent."""

    def value_and_grads(params, x):
        y, vjp = jax.vjp(apply, params, x)
        return y, vjp(jax.random.normal(jax.random.key(2), y.shape, F32).astype(y.dtype))

    return value_and_grads


def _program(fn, *args) -> str:
    closed = jax.make_jaxpr(fn)(*args)
    assert not closed.consts  # the printed jaxpr is the whole program
    return str(closed)


def _is_routed(program: str) -> bool:
    """A jax_cake GEMM in a layer's forward program: its custom_vjp and the checkpoint
    name it gives its output."""
    return "custom_vjp_call" in program and f"name={jc.remat.OUTPUT_NAME}" in program


def _assert_bitwise(a, b, name):
    a, b = np.asarray(a), np.asarray(b)
    bits = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    if not np.array_equal(a.view(bits), b.view(bits)):
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
        rel = float(diff.max() / max(np.abs(b.astype(np.float64)).max(), 1e-30))
        pytest.fail(f"{name}: {np.count_nonzero(diff)}/{a.size} elements differ, max |diff| {rel:.2e} of max |plain|")


@pytest.mark.parametrize("layer, dtype, param_dtype, precision, preferred, bias", PRODUCT)
def test_hooked_layer_is_plain_flax_off_the_kernels(layer, dtype, param_dtype, precision, preferred, bias):
    build, x_shape = {**LAYERS, **MORE_LAYERS}[layer]
    options = (DTYPES[dtype], PARAM_DTYPES[param_dtype], PRECISIONS[precision], PREFERRED[preferred], BIAS[bias])
    (apply, _), (plain_apply, params) = build(True, *options), build(False, *options)
    ours, plain = _value_and_grads(apply), _value_and_grads(plain_apply)
    params = _randomized(params, 10)  # the same parameters for both
    x = _normal(1, x_shape, BF16)
    program = _program(apply, params, x)
    routed = _is_routed(program)
    if not routed and program == _program(plain_apply, params, x):
        return  # plain Flax's forward program (e.g. a float32 layer): the same value and gradients

    (y, (dp, dx)), (y_plain, (dp_plain, dx_plain)) = ours(params, x), plain(params, x)
    assert (y.dtype, y.shape, dx.dtype) == (y_plain.dtype, y_plain.shape, dx_plain.dtype)
    pairs = [("y", y, y_plain), ("dx", dx, dx_plain)]
    for (path, a), b in zip(jax.tree.leaves_with_path(dp), jax.tree.leaves(dp_plain), strict=True):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        pairs.append((f"d{jax.tree_util.keystr(path)}", a, b))
    if routed:
        # Only what the module docstring says is routed ...
        assert PRECISIONS[precision] is None and PREFERRED[preferred] in (None, BF16), "routed off the documented rule"
        assert "batch" not in layer, "routed a contraction with batch dimensions"
        # ... and that is plain Flax within bf16 rounding (an FP32 master kernel's gradient
        # is not bf16-rounded here, where plain Flax's is).
        for name, a, b in pairs:
            assert rel_err(a, b) < BF16_TOL, name
    else:
        for name, a, b in pairs:
            _assert_bitwise(a, b, name)


def test_the_product_has_routed_and_unrouted_calls():
    """The bitwise branch above is not vacuous, nor is the routed one."""
    routed = {}
    for layer in ("linen_dense", "nnx_linear", "nnx_einsum"):
        build, x_shape = LAYERS[layer]
        for dtype, preferred in (("bf16", "None"), ("bf16", "f32"), ("None", "None")):
            options = (DTYPES[dtype], F32, None, PREFERRED[preferred], True)
            apply, params = build(True, *options)[0], build(False, *options)[1]
            routed[layer, dtype, preferred] = _is_routed(_program(apply, params, jnp.zeros(x_shape, BF16)))
    assert any(routed.values()) and not all(routed.values()), routed


# --- out_sharding: never routed, so Flax's values bitwise (8 fake CPU devices) ---------------


@pytest.mark.parametrize("preferred", [None, F32], ids=["pet_None", "pet_f32"])
def test_out_sharding_is_plain_flax(preferred):
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    kw = dict(dtype=BF16, param_dtype=F32, preferred_element_type=preferred)
    ours = nnx.Linear(16, 24, rngs=nnx.Rngs(0), **kw, **NNX_HOOKS)
    plain = nnx.Linear(16, 24, rngs=nnx.Rngs(0), **kw)
    with jax.set_mesh(mesh):
        x = jax.device_put(rand(1, (8, 16), BF16), NamedSharding(mesh, P("d", None)))
        y = jax.jit(lambda x: ours(x, out_sharding=P("d", None)))(x)
        y_plain = jax.jit(lambda x: plain(x, out_sharding=P("d", None)))(x)
    assert y.dtype == y_plain.dtype
    _assert_bitwise(y, y_plain, "y")


# --- jc.dot_general called directly with a bf16 lhs and a float32 rhs ------------------------

DIRECT = {
    "preferred_f32": ((8, 16), (16, 24), (((1,), (0,)), ((), ())), dict(preferred_element_type=F32)),
    "preferred_f32_nk": ((8, 16), (24, 16), (((1,), (1,)), ((), ())), dict(preferred_element_type=F32)),
    "precision_highest": ((8, 16), (16, 24), (((1,), (0,)), ((), ())), dict(precision=HIGHEST)),
    "highest_preferred_f32": (
        (8, 16),
        (16, 24),
        (((1,), (0,)), ((), ())),
        dict(precision=HIGHEST, preferred_element_type=F32),
    ),
    "batch_dims_preferred_f32": (
        (2, 8, 16),
        (2, 16, 24),
        (((2,), (1,)), ((0,), (0,))),
        dict(preferred_element_type=F32),
    ),
    "lhs_contract_not_trailing": ((16, 8), (16, 24), (((0,), (0,)), ((), ())), {}),
}


@pytest.mark.parametrize("case", DIRECT)
def test_unrouted_master_weight_is_lax_on_the_bf16_rhs(case):
    """Not routed: exactly lax.dot_general of the rhs rounded to bf16 (the program and its
    bits), whatever preferred_element_type; a float32 lhs is lax unchanged."""
    x_shape, w_shape, dn, kw = DIRECT[case]
    x, w = _normal(1, x_shape, BF16), _normal(2, w_shape, F32)
    ours = lambda x, w: jc.dot_general(x, w, dn, **kw)
    cast = lambda x, w: lax.dot_general(x, w.astype(BF16), dn, **kw)
    assert _program(ours, x, w) == _program(cast, x, w)
    _assert_bitwise(ours(x, w), cast(x, w), "y")
    x32 = x.astype(F32)
    assert _program(ours, x32, w) == _program(lambda x, w: lax.dot_general(x, w, dn, **kw), x32, w)
