"""jax_cake.dot_general and jax_cake.promote_dtype on CPU: values and gradients against
float64 references, which contractions take the jax_cake path (the CUDA lowering for a
faked H200) and which stay `lax.dot_general` unchanged, and JAX_CAKE_DISABLE."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_cake as jc
from helpers import f64, faked_device, rand, rel_err, cuda_text

BF16, F32 = jnp.bfloat16, jnp.float32
BF16_TOL = 1e-2
FP32_WGRAD_TOL = 1e-5


def _calls(text: str) -> list[str]:
    return [line.split("@")[1].split("(")[0] for line in text.splitlines() if "stablehlo.custom_call @jax_cake" in line]


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _grad_step(dimension_numbers, **kw):
    def step(x, w):
        loss = lambda x, w: jnp.sum(jc.dot_general(x, w, dimension_numbers, **kw).astype(F32) ** 2)
        return jax.grad(loss, argnums=(0, 1))(x, w)

    return step


# (lhs shape, rhs shape, dimension numbers, layout): Flax's [d_in, d_out], DenseGeneral's
# multiple output axes and multiple contracting axes, jax_cake's [d_out, d_in], a vector.
KN = (((2,), (0,)), ((), ()))
KN2 = (((1,), (0,)), ((), ()))
CASES = {
    "dense_kn": ((3, 37, 64), (64, 48), KN),
    "dense_general_features": ((2, 19, 64), (64, 4, 16), KN),
    "dense_general_axes": ((2, 11, 4, 16), (4, 16, 40), (((2, 3), (0, 1)), ((), ()))),
    "dense_nk": ((3, 37, 64), (48, 64), (((2,), (1,)), ((), ()))),
    "nk_multi": ((5, 4, 16), (6, 8, 4, 16), (((1, 2), (2, 3)), ((), ()))),
    "vector_lhs": ((64,), (64, 32), (((0,), (0,)), ((), ()))),
    "unaligned": ((7, 20), (20, 12), (((1,), (0,)), ((), ()))),
}


def _reference(x, w, dy, dimension_numbers):
    """float64 lax.dot_general of the same bf16 operands: value, dx, dw."""
    with jax.enable_x64(True):
        operands = jnp.asarray(f64(x)), jnp.asarray(f64(w))
        y, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, dimension_numbers), *operands)
        return (np.asarray(y),) + tuple(np.asarray(g) for g in vjp(jnp.asarray(f64(dy))))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("w_dtype", [F32, BF16])
def test_values_and_gradients_match_float64(case, w_dtype):
    x_shape, w_shape, dn = CASES[case]
    x, w = rand(1, x_shape, BF16), rand(2, w_shape, w_dtype)
    y_ref_shape = lax.dot_general(x, w.astype(BF16), dn).shape
    dy = rand(3, y_ref_shape, BF16)
    y, vjp = jax.vjp(jax.jit(lambda x, w: jc.dot_general(x, w, dn)), x, w)
    dx, dw = vjp(dy)

    assert y.dtype == BF16 and y.shape == y_ref_shape
    assert dx.dtype == BF16 and dw.dtype == w_dtype and dw.shape == w.shape
    y_ref, dx_ref, dw_ref = _reference(x, w.astype(BF16), dy, dn)
    assert rel_err(y, y_ref) < BF16_TOL
    assert rel_err(dx, dx_ref) < BF16_TOL
    assert rel_err(dw, dw_ref) < (FP32_WGRAD_TOL if w_dtype == F32 else BF16_TOL)


def test_fp32_kernel_gradient_comes_from_the_accumulator():
    """An FP32 [d_in, d_out] kernel's gradient is not bf16-rounded (lax on a cast kernel's is)."""
    x, w, dy = rand(4, (333, 128), BF16), rand(5, (128, 64), F32), rand(6, (333, 64), BF16)
    dn = (((1,), (0,)), ((), ()))
    _, vjp = jax.vjp(lambda w: jc.dot_general(x, w, dn), w)
    (dw,) = vjp(dy)
    dw_ref = f64(x).T @ f64(dy)
    assert dw.dtype == F32 and rel_err(dw, dw_ref) < FP32_WGRAD_TOL
    assert not np.array_equal(np.asarray(dw), np.asarray(dw.astype(BF16).astype(F32)))
    # The trap it avoids: the gradient through a bf16 cast is float32 in dtype only.
    _, vjp_cast = jax.vjp(lambda w: lax.dot_general(x, w.astype(BF16), dn), w)
    (dw_cast,) = vjp_cast(dy)
    assert dw_cast.dtype == F32 and rel_err(dw_cast, dw_ref) > 10 * FP32_WGRAD_TOL


def test_forward_equals_lax_on_the_bf16_kernel():
    x, w = rand(7, (16, 32), BF16), rand(8, (32, 24), F32)
    dn = (((1,), (0,)), ((), ()))
    y = jc.dot_general(x, w, dn)
    ref = lax.dot_general(x, w.astype(BF16), dn, preferred_element_type=F32).astype(BF16)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(ref, np.float32))


def test_einsum_hook_routes_projections():
    x, w = rand(9, (2, 8, 32), BF16), rand(10, (32, 16), BF16)
    y = jnp.einsum("btd,df->btf", x, w, _dot_general=jc.dot_general)
    assert rel_err(y, np.einsum("btd,df->btf", f64(x), f64(w))) < BF16_TOL
    text = cuda_text(lambda x, w: jnp.einsum("btd,df->btf", x, w, _dot_general=jc.dot_general), x, w)
    assert _calls(text) == ["jax_cake_dgrad"]


def test_deterministic_flag():
    x, w = rand(11, (64, 128), BF16), rand(12, (128, 32), F32)
    dn = (((1,), (0,)), ((), ()))
    loose = functools.partial(jc.dot_general, deterministic=False)
    g = jax.grad(lambda w: jnp.sum(loose(x, w, dn).astype(F32)))(w)
    assert rel_err(g, f64(x).T @ np.ones((64, 32))) < FP32_WGRAD_TOL
    with pytest.raises(TypeError, match="deterministic"):
        jc.dot_general(x, w, dn, deterministic=1)


def test_output_carries_the_checkpoint_name():
    x, w = rand(13, (8, 32), BF16), rand(14, (32, 16), F32)
    for dn in ((((1,), (0,)), ((), ())), (((1,), (1,)), ((), ()))):
        w_ = w if dn[0][1] == (0,) else w.T
        jaxpr = str(jax.make_jaxpr(lambda x, w: jc.dot_general(x, w, dn))(x, w_))
        assert f"name={jc.remat.OUTPUT_NAME}" in jaxpr


# --- the CUDA lowering: which GEMMs, no transpose of the weight --------------------------------


@pytest.mark.parametrize("w_dtype", [F32, BF16])
def test_flax_layout_lowers_to_the_three_gemms_without_a_transpose(w_dtype):
    text = cuda_text(_grad_step(KN), _spec((4, 256, 128), BF16), _spec((128, 64), w_dtype))
    # forward = dgrad GEMM, dx = fwd GEMM, dw = wgrad GEMM with swapped operands
    assert sorted(_calls(text)) == ["jax_cake_dgrad", "jax_cake_fwd", "jax_cake_wgrad"], text
    assert "stablehlo.transpose" not in text and "dot_general" not in text
    dtype = "f32" if w_dtype == F32 else "bf16"
    wgrad = next(line for line in text.splitlines() if "custom_call @jax_cake_wgrad" in line)
    assert f"-> (tensor<1x128x64x{dtype}>" in wgrad  # dw in the kernel's own [d_in, d_out] layout


def test_dense_general_lowers_to_the_gemms_without_a_transpose():
    dn = (((2, 3), (0, 1)), ((), ()))
    text = cuda_text(_grad_step(dn), _spec((2, 64, 4, 32), BF16), _spec((4, 32, 96), F32))
    assert sorted(_calls(text)) == ["jax_cake_dgrad", "jax_cake_fwd", "jax_cake_wgrad"], text
    assert "stablehlo.transpose" not in text


def test_jax_cake_layout_lowers_to_dense_projection():
    text = cuda_text(_grad_step((((1,), (1,)), ((), ()))), _spec((256, 128), BF16), _spec((64, 128), F32))
    assert sorted(_calls(text)) == ["jax_cake_dgrad", "jax_cake_fwd", "jax_cake_wgrad"], text
    assert "stablehlo.transpose" not in text


def test_disable_env_sends_everything_to_xla(monkeypatch):
    x, w = rand(15, (64, 128), BF16), rand(16, (128, 32), F32)
    monkeypatch.setenv("JAX_CAKE_DISABLE", "1")
    specs = (_spec(x.shape, BF16), _spec(w.shape, F32))
    text = cuda_text(_grad_step(KN2), *specs)
    assert "custom_call @jax_cake" not in text and "dot_general" in text
    text = cuda_text(lambda x, w: jc.dense_projection(x, w.T), *specs)
    assert "custom_call @jax_cake" not in text
    with faked_device():
        assert not jc.plan("fwd", tokens=4096, d_in=4096, d_out=4096).uses_kernel
    # the same function: loss = sum(y^2), y = x w (bf16 operands), so dx = 2 y w^T, dw = 2 x^T y
    dx, dw = jax.jit(_grad_step(KN2))(x, w)
    y = f64(x) @ f64(w.astype(BF16))
    assert rel_err(dx, 2 * y @ f64(w.astype(BF16)).T) < 1e-2 and rel_err(dw, 2 * f64(x).T @ y) < 1e-2
    monkeypatch.setenv("JAX_CAKE_DISABLE", "0")
    assert _calls(cuda_text(_grad_step(KN2), *specs))


# --- what stays lax.dot_general --------------------------------------------------------------


def _jaxpr(fn, *args, **kw) -> str:
    return str(jax.make_jaxpr(lambda *a: fn(*a, **kw))(*args))


LAX_CASES = {
    # attention QK^T / PV: batch dimensions on both sides
    "attention_qk_bf16": ((2, 4, 16, 32), BF16, (2, 4, 16, 32), BF16, (((3,), (3,)), ((0, 1), (0, 1))), {}),
    "attention_pv_bf16": ((2, 4, 16, 16), BF16, (2, 4, 16, 32), BF16, (((3,), (2,)), ((0, 1), (0, 1))), {}),
    "fp32_activations": ((8, 32), F32, (32, 16), F32, (((1,), (0,)), ((), ())), {}),
    "fp16": ((8, 32), jnp.float16, (32, 16), jnp.float16, (((1,), (0,)), ((), ())), {}),
    "int8": ((8, 32), jnp.int8, (32, 16), jnp.int8, (((1,), (0,)), ((), ())), {}),
    "preferred_f32": ((8, 32), BF16, (32, 16), BF16, (((1,), (0,)), ((), ())), {"preferred_element_type": F32}),
    "precision_highest": ((8, 32), BF16, (32, 16), BF16, (((1,), (0,)), ((), ())), {"precision": "highest"}),
    "lhs_contract_not_trailing": ((32, 8), BF16, (32, 16), BF16, (((0,), (0,)), ((), ())), {}),
    "axes_out_of_order": ((8, 4, 16), BF16, (16, 4, 8), BF16, (((1, 2), (1, 0)), ((), ())), {}),
    "rhs_contract_middle": ((8, 16), BF16, (4, 16, 8), BF16, (((1,), (1,)), ((), ())), {}),
    "empty": ((0, 32), BF16, (32, 16), BF16, (((1,), (0,)), ((), ())), {}),
}


@pytest.mark.parametrize("case", LAX_CASES)
def test_non_projections_are_lax_dot_general_unchanged(case):
    x_shape, x_dtype, w_shape, w_dtype, dn, kw = LAX_CASES[case]
    x, w = jnp.ones(x_shape, x_dtype), jnp.ones(w_shape, w_dtype)
    assert _jaxpr(jc.dot_general, x, w, dimension_numbers=dn, **kw) == _jaxpr(
        lax.dot_general, x, w, dimension_numbers=dn, **kw
    )
    text = cuda_text(lambda x, w: jc.dot_general(x, w, dn, **kw), x, w)
    assert "custom_call @jax_cake" not in text


def test_attention_einsum_stays_on_lax():
    """QK^T and PV through jnp.einsum with the hook: fp32 and bf16, no jax_cake call."""

    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, _dot_general=jc.dot_general)
        p = jax.nn.softmax(s.astype(F32), axis=-1).astype(q.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v, _dot_general=jc.dot_general)

    for dtype in (F32, BF16):
        q, k, v = (rand(i, (2, 16, 4, 32), dtype) for i in (20, 21, 22))
        text = cuda_text(attention, q, k, v)
        assert "custom_call @jax_cake" not in text and text.count("dot_general") == 2
        plain = _jaxpr(lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k), q, k)
        assert _jaxpr(lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k, _dot_general=jc.dot_general), q, k) == plain


def test_master_weight_off_the_kernel_path_is_rounded_like_flax():
    """bf16 x float32 not routed (batch dims): the rhs is rounded to bf16, result bf16."""
    x, w = rand(23, (2, 8, 32), BF16), rand(24, (2, 32, 16), F32)
    dn = (((2,), (1,)), ((0,), (0,)))
    y = jc.dot_general(x, w, dn)
    np.testing.assert_array_equal(np.asarray(y, F32), np.asarray(lax.dot_general(x, w.astype(BF16), dn), F32))


BAD = {
    "contract_sizes_differ": ((8, 32), (16, 24), (((1,), (0,)), ((), ()))),
    "axis_out_of_range": ((8, 32), (32, 24), (((2,), (0,)), ((), ()))),
    "contract_counts_differ": ((8, 32), (32, 24), (((1,), ()), ((), ()))),
    "not_a_pair": ((8, 32), (32, 24), ((1,), (0,))),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_dimension_numbers_raise_as_lax_does(case):
    x_shape, w_shape, dn = BAD[case]
    x, w = jnp.ones(x_shape, BF16), jnp.ones(w_shape, BF16)
    with pytest.raises(Exception) as lax_error:
        lax.dot_general(x, w, dn)
    with pytest.raises(type(lax_error.value)) as ours:
        jc.dot_general(x, w, dn)
    assert str(ours.value) == str(lax_error.value)


# --- promote_dtype ------------------------------------------------------------------------------


def test_promote_dtype_keeps_the_fp32_kernel_under_bf16():
    x, k, b = jnp.ones((2, 4), F32), jnp.ones((4, 3), F32), jnp.ones((3,), F32)
    linen = jc.promote_dtype(x, k, b, dtype=BF16)  # flax.linen: variadic, a list
    nnx = jc.promote_dtype((x, k, b), dtype=BF16)  # flax.nnx: one tuple, a tuple
    assert isinstance(linen, list) and isinstance(nnx, tuple)
    for out in (linen, nnx):
        assert [a.dtype for a in out] == [BF16, F32, BF16]
    assert jc.promote_dtype(x, k, None, dtype=BF16)[2] is None
    assert jc.promote_dtype((x, k, None), dtype=BF16)[1].dtype == F32


def test_promote_dtype_is_flax_elsewhere():
    from flax.linen.dtypes import promote_dtype as linen_promote
    from flax.nnx.nn.dtypes import promote_dtype as nnx_promote

    f32, bf16, i32 = jnp.ones((4,), F32), jnp.ones((4,), BF16), jnp.ones((4,), jnp.int32)
    cases = [
        ((f32, f32, f32), None),
        ((bf16, f32, bf16), None),
        ((f32, f32, f32), F32),
        ((bf16, bf16, bf16), BF16),
        ((f32, bf16, f32), F32),
        ((f32, f32), BF16),  # not an (inputs, kernel, bias) triple
        ((f32,), BF16),
        ((i32, i32, i32), None),
        ((f32, f32, f32, f32), BF16),
    ]
    for args, dtype in cases:
        expected = [a.dtype for a in linen_promote(*args, dtype=dtype)]
        assert [a.dtype for a in jc.promote_dtype(*args, dtype=dtype)] == expected, (args, dtype)
        expected = [a.dtype for a in nnx_promote(args, dtype=dtype)]
        assert [a.dtype for a in jc.promote_dtype(args, dtype=dtype)] == expected, (args, dtype)
    with pytest.raises(ValueError, match="inexact"):
        jc.promote_dtype(i32, i32, i32, dtype=jnp.int32)


# --- sharded inputs (8 fake CPU devices) ---------------------------------------------------


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("w_spec", [(), (None, "d"), ("d", None)], ids=["w_replicated", "w_by_n", "w_by_k"])
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_sharded_tokens_match_the_unsharded_step(explicit, w_spec, layout):
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    dn = (((1,), (0 if layout == "kn" else 1,)), ((), ()))
    x, g = rand(31, (64, 128), BF16), rand(33, (64, 32), BF16)
    w = rand(32, (128, 32) if layout == "kn" else (32, 128), F32)

    def step(x, w, g):
        y, vjp = jax.vjp(lambda x, w: jc.dot_general(x, w, dn), x, w)
        return (y,) + vjp(g)

    expected = jax.jit(step)(x, w, g)
    kind = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh((8,), ("d",), axis_types=(kind,))
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, NamedSharding(mesh, P(*s))) for a, s in ((x, ("d", None)), (w, w_spec), (g, ("d",)))]
        got = jax.jit(step)(*args)
    for name, a, b in zip(("y", "dx", "dw"), got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, f64(b)) < 1e-6, name
