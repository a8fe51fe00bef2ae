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
from second_order_cases import (
    BF16,
    CASES,
    F32,
    check,
    check_case,
    dense_operands,
    hvp,
    plain_dense,
    plain_gated,
    router_operands,
)


@pytest.mark.parametrize("name", sorted(CASES))
def test_grad_of_grad_jit(name):
    check_case(name, lambda fn, ops, dirs: jax.jit(functools.partial(hvp, fn))(ops, dirs))


@pytest.mark.parametrize("name", ["dense", "gated_silu", "router"])
def test_grad_of_grad_eager(name):
    check_case(name, hvp)


def _planned_for_h200(fn, ops, dirs):
    """The HVP traced (planned) on the faked H200, so the kernel plans' branches are what is
    differentiated, then run on the CPU (each custom call's CPU branch is its reference)."""
    with faked_device():
        exported = jax.export.export(jax.jit(functools.partial(hvp, fn)), platforms=("cpu",))(ops, dirs)
    return exported.call(ops, dirs)


@pytest.mark.parametrize("name", ["dense", "residual", "batched", "gated_silu", "swiglu_mlp", "flax_dot_general"])
def test_grad_of_grad_on_the_kernel_plans(name):
    check_case(name, _planned_for_h200)


def test_grad_of_grad_through_the_fused_gated_epilogue():
    """The forward GEMM with the gated epilogue in the kernel (pinned to its ping-pong tile
    at a small shape): its second-order gradient runs through its unfused form."""
    pin = lambda: jc.planner.force("det", tile=(128, 192, 64), schedule="pingpong", cluster=(1, 1))
    x, wg, wu = rand(0, (256, 128), BF16), rand(1, (96, 128), F32), rand(2, (96, 128), F32)
    with pin():
        text = cuda_text(jc.gated_projection, x, wg, wu)
    assert len(custom_call_lines(text, "jax_cake_fwd_gated")) == 1

    def pinned(fn, ops, dirs):
        with pin():
            return _planned_for_h200(fn, ops, dirs)

    check(jc.gated_projection, plain_gated, (x, wg, wu), pinned)


def test_grad_accumulator_grad_of_grad():
    """The running sum's cotangent is acc + dw; its gradient reaches x and w through dw."""
    x, w = rand(0, (96, 64), BF16), rand(1, (48, 64), F32)
    acc, v = rand(2, (48, 64), F32), rand(3, (48, 64), F32)

    def summed(x, w, acc, fn):
        return jnp.sum(jax.grad(lambda x, w, acc: 0.5 * jnp.sum(fn(x, w, acc).astype(F32) ** 2), argnums=2)(x, w, acc) * v)

    ours = lambda x, w, acc: jc.dense_projection(x, w, grad_accumulator=acc)
    got = jax.jit(jax.grad(functools.partial(summed, fn=ours), argnums=(0, 1)))(x, w, acc)

    def plain_summed(x, w, acc):  # acc + dw, dw of the plain forward
        dw = jax.grad(lambda w: 0.5 * jnp.sum(plain_dense(x, w).astype(F32) ** 2))(w)
        return jnp.sum((acc + dw) * v)

    want = jax.grad(plain_summed, argnums=(0, 1))(x.astype(F32), w, acc)
    for g, ref in zip(got, want):
        assert rel_err(g, ref) < 1.5e-2


def test_second_order_gemms_are_kernel_roles_on_cuda(kernel_rules_only):
    """Lowered for CUDA on a faked H200: every GEMM of the Hessian-vector product is a
    jax_cake custom call (the first-order roles and their own gradients), no XLA dot."""
    x = jax.ShapeDtypeStruct((256, 128), BF16)
    w = jax.ShapeDtypeStruct((256, 128), F32)
    dense_hvp = lambda x, w, vx, vw: hvp(jc.dense_projection, (x, w), (vx, vw))
    text = cuda_text(dense_hvp, x, w, jax.ShapeDtypeStruct(x.shape, F32), w)
    assert "dot_general" not in text
    counts = [len(custom_call_lines(text, f"jax_cake_{op}")) for op in ("fwd", "dgrad", "wgrad")]
    # The forward y; the second-order GEMMs: the dgrad role's gradient fwd(vx, w) and
    # wgrad(y, vx), the wgrad role's fwd(x, vw) and dgrad(y, vw), and the forward role's
    # dgrad and wgrad of the summed cotangent of y. (The first-order dx and dw themselves
    # are dead in an HVP: only their gradients are used.)
    assert counts == [3, 2, 2], counts


def test_forward_mode_stays_the_custom_vjp_error():
    x, w = dense_operands()
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda x: jc.dense_projection(x, w), (x,), (x,))


def test_hessian_vector_product_matches_finite_differences():
    """Not only equal to plain JAX: the HVP is the derivative of the gradient. With the
    quadratic loss the router's gradient is linear in w, so the central difference along v
    is exact up to rounding."""
    x, w = router_operands()
    v = rand(9, w.shape, F32)
    loss = lambda w: 0.5 * jnp.sum(jc.router_logits(x, w) ** 2)
    product = jax.jit(jax.grad(lambda w: jnp.sum(jax.grad(loss)(w) * v)))(w)
    grad = jax.jit(jax.grad(loss))
    fd = (grad(w + 0.5 * v) - grad(w - 0.5 * v)) / 1.0
    assert rel_err(product, np.asarray(fd)) < 1e-5
