"""Bad input raises TypeError / ValueError at trace time, naming the argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cake as jc

BF, F32 = jnp.bfloat16, jnp.float32


def _zeros(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


CASES = [
    # (op, x, w, kwargs, error, words that must appear)
    (jc.dense_projection, _zeros((8, 64), F32), _zeros((32, 64), BF), {}, TypeError, ["x must be bfloat16", "float32"]),
    (
        jc.dense_projection,
        _zeros((8, 64), jnp.float16),
        _zeros((32, 64), BF),
        {},
        TypeError,
        ["x must be bfloat16", "float16"],
    ),
    (
        jc.dense_projection,
        _zeros((8, 64), BF),
        _zeros((32, 64), jnp.float16),
        {},
        TypeError,
        ["w must be bfloat16 or float32", "float16"],
    ),
    (
        jc.dense_projection,
        _zeros((8, 64), BF),
        _zeros((2, 32, 64), BF),
        {},
        ValueError,
        ["w must have rank 2", "[d_out, d_in]"],
    ),
    (jc.dense_projection, _zeros((8, 64), BF), _zeros((32, 48), BF), {}, ValueError, ["d_in=64", "d_in=48"]),
    (
        jc.dense_projection,
        _zeros((8, 64), BF),
        _zeros((32, 64), BF),
        {"deterministic": 1},
        TypeError,
        ["deterministic must be a Python bool", "int"],
    ),
    (
        jc.dense_projection,
        _zeros((8, 64), BF),
        _zeros((32, 64), BF),
        {"deterministic": "yes"},
        TypeError,
        ["deterministic", "str"],
    ),
    (
        jc.batched_projection,
        _zeros((8, 64), BF),
        _zeros((2, 32, 64), BF),
        {},
        ValueError,
        ["x must have rank 3", "[B, T, d_in]"],
    ),
    (
        jc.batched_projection,
        _zeros((2, 8, 64), BF),
        _zeros((3, 32, 64), BF),
        {},
        ValueError,
        ["same batch size", "x.shape[0]=2", "w.shape[0]=3"],
    ),
    (jc.batched_projection, _zeros((2, 8, 64), BF), _zeros((2, 32, 16), BF), {}, ValueError, ["d_in=64", "d_in=16"]),
    (jc.batched_projection, _zeros((2, 8, 64), F32), _zeros((2, 32, 64), BF), {}, TypeError, ["x must be bfloat16"]),
    (
        jc.router_logits,
        _zeros((8, 64), BF),
        _zeros((256, 64), F32),
        {},
        TypeError,
        ["x must be float32", "bfloat16", "FP32 inputs"],
    ),
    (
        jc.router_logits,
        _zeros((8, 64), jnp.float16),
        _zeros((256, 64), F32),
        {},
        TypeError,
        ["x must be float32", "float16"],
    ),
    (jc.router_logits, _zeros((8, 64), F32), _zeros((256, 64), BF), {}, TypeError, ["w must be float32", "bfloat16"]),
    (jc.router_logits, _zeros((8, 64), F32), _zeros((256, 32), F32), {}, ValueError, ["d=64", "d=32"]),
    (
        jc.router_logits,
        _zeros((2, 8, 64), F32),
        _zeros((256, 64), F32),
        {},
        ValueError,
        ["x must have rank 2", "[T, d]"],
    ),
    (
        jc.router_logits,
        _zeros((8, 64), F32),
        _zeros((256, 64), F32),
        {"deterministic": None},
        TypeError,
        ["deterministic", "NoneType"],
    ),
]


@pytest.mark.parametrize("op,x,w,kwargs,error,words", CASES)
def test_bad_input_raises_at_trace_time(op, x, w, kwargs, error, words):
    # eval_shape traces without running: the error must come from tracing.
    with pytest.raises(error) as info:
        jax.eval_shape(lambda x, w: op(x, w, **kwargs), x, w)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert op.__name__ in str(info.value)


def test_non_array_argument_is_a_type_error():
    with pytest.raises(TypeError, match="dense_projection: x must be an array, got list"):
        jc.dense_projection([[1.0]], jnp.ones((1, 1), BF))


def test_deterministic_is_keyword_only():
    with pytest.raises(TypeError):
        jc.dense_projection(jnp.ones((2, 8), BF), jnp.ones((4, 8), BF), True)


def test_numpy_bool_is_accepted():
    y = jc.dense_projection(jnp.ones((2, 8), BF), jnp.ones((4, 8), BF), deterministic=np.bool_(False))
    assert y.shape == (2, 4)


def test_plan_rejects_unknown_op_and_non_bool():
    with pytest.raises(ValueError, match="op must be one of"):
        jc.plan("matmul", tokens=8, d_in=8, d_out=8)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        jc.plan("wgrad", tokens=8, d_in=8, d_out=8, deterministic=0)
