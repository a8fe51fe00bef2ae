"""Reverse-over-reverse autodiff on the GPU: every op's Hessian-vector product runs on the
kernels' GEMM roles (the compiled program's GEMMs are jax_cake custom calls) and equals
the same computation in plain JAX (tests/second_order_cases.py)."""

import functools

import jax
import jax.numpy as jnp
import pytest

import jax_cake as jc
from second_order_cases import CASES, check_case, dense_operands, hvp

import gpu_helpers as h

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_library")]


@pytest.mark.parametrize("name", sorted(CASES))
def test_grad_of_grad_on_the_kernels(name):
    check_case(name, lambda fn, ops, dirs: jax.jit(functools.partial(hvp, fn))(ops, dirs))


def test_the_hvp_gemms_are_kernel_roles():
    """The dense HVP's compiled program: the first-order roles and their own gradients are
    jax_cake custom calls, each role at least twice, and bitwise repeatable."""
    x, w = dense_operands()
    directions = (h.rand(7, x.shape, jnp.float32), h.rand(8, w.shape, jnp.float32))
    step = jax.jit(functools.partial(hvp, jc.dense_projection))
    text = step.lower((x, w), directions).as_text()
    counts = [h.custom_calls(text, f"jax_cake_{op}") for op in ("fwd", "dgrad", "wgrad")]
    assert min(counts) >= 2 and sum(counts) >= 7, counts
    first = step((x, w), directions)
    for _ in range(5):
        again = step((x, w), directions)
        assert all(bool((a == b).all()) for a, b in zip(first, again))
