"""Reverse-over-reverse autodiff through every op: the gradient of a gradient (a
Hessian-vector product) equals the same computation written in plain JAX, and on a GPU it
runs on the kernels' GEMM roles (the CUDA lowering has no XLA dot)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cake as jc
from helpers import cuda_text, custom_call_lines, faked_device, rand, rel_err

_BF16, _F32 = jnp.bfloat16, jnp.float32


def _bf16_dot(a, b, dims):
    """A bf16 product as the kernels compute it: FP32 sum, one rounding."""
    return jax.lax.dot_general(a, b, dims, preferred_element_type=_F32).astype(_BF16)


def _plain_dense(x, w):
    return _bf16_dot(x, w.astype(_BF16), (((x.ndim - 1,), (1,)), ((), ())))


def _plain_batched(x, w):
    return _bf16_dot(x, w.astype(_BF16), (((2,), (2,)), ((0,), (0,))))


def _plain_gated(x, w_gate, w_up, activation="silu"):
    g, u = _plain_dense(x, w_gate), _plain_dense(x, w_up)
    act = jax.nn.silu if activation == "silu" else functools.partial(jax.nn.gelu, approximate=True)
    return (act(g.astype(_F32)) * u.astype(_F32)).astype(_BF16)


def _plain_router(x, w):
    return jnp.dot(x, w.T, precision=jax.lax.Precision.HIGHEST)


# Each case: (jax_cake function, plain-JAX function of the same values, operand builders,
# tolerance of the second-order result). The operands are the differentiated arguments.
def _dense_operands():
    return rand(0, (96, 64), _BF16), rand(1, (48, 64), _F32)


def _residual_operands():
    return rand(0, (96, 64), _BF16), rand(1, (48, 64), _F32), rand(2, (96, 48), _BF16)


def _batched_operands():
    return rand(0, (3, 40, 64), _BF16), rand(1, (3, 32, 64), _F32)


def _gated_operands():
    return rand(0, (96, 64), _BF16), rand(1, (48, 64), _F32), rand(2, (48, 64), _F32)


def _mlp_operands():
    return (*_gated_operands(), rand(3, (64, 48), _F32))


def _router_operands():
    return rand(0, (96, 64), _F32), rand(1, (16, 64), _F32)


def _flax_operands():
    return rand(0, (96, 64), _BF16), rand(1, (64, 48), _F32)


CASES = {
    "dense": (jc.dense_projection, _plain_dense, _dense_operands),
    "dense_bf16_w": (jc.dense_projection, _plain_dense, lambda: (_dense_operands()[0], _dense_operands()[1].astype(_BF16))),
    "residual": (
        lambda x, w, r: jc.dense_projection(x, w, residual=r),
        lambda x, w, r: (r.astype(_F32) + _plain_dense(x, w).astype(_F32)).astype(_BF16),
        _residual_operands,
    ),
    "batched": (jc.batched_projection, _plain_batched, _batched_operands),
    "fused": (
        lambda x, w: jnp.concatenate(jc.fused_projections(x, (w[:16], w[16:])), -1),
        _plain_dense,
        _dense_operands,
    ),
    "gated_silu": (jc.gated_projection, _plain_gated, _gated_operands),
    "gated_gelu": (
        functools.partial(jc.gated_projection, activation="gelu"),
        functools.partial(_plain_gated, activation="gelu"),
        _gated_operands,
    ),
    "swiglu_mlp": (
        jc.swiglu_mlp,
        lambda x, wg, wu, wd: _plain_dense(_plain_gated(x, wg, wu), wd),
        _mlp_operands,
    ),
    "router": (jc.router_logits, _plain_router, _router_operands),
    "flax_dot_general": (
        lambda x, k: jc.dot_general(x, k.astype(_BF16), (((1,), (0,)), ((), ()))),
        lambda x, k: _bf16_dot(x, k.astype(_BF16), (((1,), (0,)), ((), ()))),
        _flax_operands,
    ),
}


def _hvp(fn, operands, directions):
    """grad of <grad(loss), v> over every operand: reverse over reverse."""

    def loss(*args):  # well conditioned: the HVP's error is the GEMMs', not the loss's
        return 0.5 * jnp.sum(fn(*args).astype(_F32) ** 2)

    def directional(*args):
        grads = jax.grad(loss, argnums=tuple(range(len(args))))(*args)
        return sum(jnp.sum(g.astype(_F32) * v) for g, v in zip(grads, directions))

    return jax.grad(directional, argnums=tuple(range(len(operands))))(*operands)


def _directions(operands):
    return tuple(rand(100 + i, a.shape, _F32) for i, a in enumerate(operands))


def _check(fn, plain, operands, hvp_fn, tolerance=1.5e-2):
    """hvp_fn's HVP of fn equals plain JAX's HVP of the same computation (`plain`) run on
    FP32 operands holding the same values, whose second-order GEMMs are not rounded.
    Tolerance: bf16 results round the first-order gradients and the second-order GEMMs to
    bf16; the router is FP32 (BF16x3) throughout (1e-5)."""
    directions = _directions(operands)
    got = hvp_fn(fn, operands, directions)
    as_given = lambda *a: plain(*(v.astype(o.dtype) for v, o in zip(a, operands)))
    want = _hvp(as_given, tuple(o.astype(_F32) for o in operands), directions)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == operands[i].dtype, (i, g.dtype)
        assert rel_err(g, w) < tolerance, (i, rel_err(g, w))


def _check_case(name, hvp_fn):
    fn, plain, make = CASES[name]
    _check(fn, plain, make(), hvp_fn, 1e-5 if name == "router" else 1.5e-2)


@pytest.mark.parametrize("name", sorted(CASES))
def test_grad_of_grad_jit(name):
    _check_case(name, lambda fn, ops, dirs: jax.jit(functools.partial(_hvp, fn))(ops, dirs))


@pytest.mark.parametrize("name", ["dense", "gated_silu", "router"])
def test_grad_of_grad_eager(name):
    _check_case(name, _hvp)


def _planned_for_h200(fn, ops, dirs):
    """The HVP traced (planned) on the faked H200, so the kernel plans' branches are what is
    differentiated, then run on the CPU (each custom call's CPU branch is its reference)."""
    with faked_device():
        exported = jax.export.export(jax.jit(functools.partial(_hvp, fn)), platforms=("cpu",))(ops, dirs)
    return exported.call(ops, dirs)


@pytest.mark.parametrize("name", ["dense", "residual", "batched", "gated_silu", "swiglu_mlp", "flax_dot_general"])
def test_grad_of_grad_on_the_kernel_plans(name):
    _check_case(name, _planned_for_h200)


def test_grad_of_grad_through_the_fused_gated_epilogue():
    """The forward GEMM with the gated epilogue in the kernel (pinned to its ping-pong tile
    at a small shape): its second-order gradient runs through its unfused form."""
    pin = lambda: jc.planner.force("det", tile=(128, 192, 64), schedule="pingpong", cluster=(1, 1))
    x, wg, wu = rand(0, (256, 128), _BF16), rand(1, (96, 128), _F32), rand(2, (96, 128), _F32)
    with pin():
        text = cuda_text(jc.gated_projection, x, wg, wu)
    assert len(custom_call_lines(text, "jax_cake_fwd_gated")) == 1

    def pinned(fn, ops, dirs):
        with pin():
            return _planned_for_h200(fn, ops, dirs)

    _check(jc.gated_projection, _plain_gated, (x, wg, wu), pinned)


def test_grad_accumulator_grad_of_grad():
    """The running sum's cotangent is acc + dw; its gradient reaches x and w through dw."""
    x, w = rand(0, (96, 64), _BF16), rand(1, (48, 64), _F32)
    acc, v = rand(2, (48, 64), _F32), rand(3, (48, 64), _F32)

    def summed(x, w, acc, fn):
        return jnp.sum(jax.grad(lambda x, w, acc: 0.5 * jnp.sum(fn(x, w, acc).astype(_F32) ** 2), argnums=2)(x, w, acc) * v)

    ours = lambda x, w, acc: jc.dense_projection(x, w, grad_accumulator=acc)
    got = jax.jit(jax.grad(functools.partial(summed, fn=ours), argnums=(0, 1)))(x, w, acc)

    def plain_summed(x, w, acc):  # acc + dw, dw of the plain forward
        dw = jax.grad(lambda w: 0.5 * jnp.sum(_plain_dense(x, w).astype(_F32) ** 2))(w)
        return jnp.sum((acc + dw) * v)

    want = jax.grad(plain_summed, argnums=(0, 1))(x.astype(_F32), w, acc)
    for g, ref in zip(got, want):
        assert rel_err(g, ref) < 1.5e-2


def test_second_order_gemms_are_kernel_roles_on_cuda(kernel_rules_only):
    """Lowered for CUDA on a faked H200: every GEMM of the Hessian-vector product is a
    jax_cake custom call (the first-order roles and their own gradients), no XLA dot."""
    x = jax.ShapeDtypeStruct((256, 128), _BF16)
    w = jax.ShapeDtypeStruct((256, 128), _F32)
    hvp = lambda x, w, vx, vw: _hvp(jc.dense_projection, (x, w), (vx, vw))
    text = cuda_text(hvp, x, w, jax.ShapeDtypeStruct(x.shape, _F32), w)
    assert "dot_general" not in text
    counts = [len(custom_call_lines(text, f"jax_cake_{op}")) for op in ("fwd", "dgrad", "wgrad")]
    # forward, backward (dgrad + wgrad), and the backward's gradient (each role's two others)
    assert sum(counts) >= 7 and min(counts) >= 2, counts


def test_forward_mode_stays_the_custom_vjp_error():
    x, w = _dense_operands()
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda x: jc.dense_projection(x, w), (x,), (x,))


def test_hessian_vector_product_matches_finite_differences():
    """Not only equal to plain JAX: the HVP is the derivative of the gradient. With the
    quadratic loss the router's gradient is linear in w, so the central difference along v
    is exact up to rounding."""
    x, w = _router_operands()
    v = rand(9, w.shape, _F32)
    loss = lambda w: 0.5 * jnp.sum(jc.router_logits(x, w) ** 2)
    hvp = jax.jit(jax.grad(lambda w: jnp.sum(jax.grad(loss)(w) * v)))(w)
    grad = jax.jit(jax.grad(loss))
    fd = (grad(w + 0.5 * v) - grad(w - 0.5 * v)) / 1.0
    assert rel_err(hvp, np.asarray(fd)) < 1e-5
