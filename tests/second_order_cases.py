"""Reverse-over-reverse cases shared by the CPU and GPU tests: every op, the same
computation in plain JAX, the Hessian-vector product of both and their comparison."""

import functools

import jax
import jax.numpy as jnp

import jax_cake as jc
from helpers import rand, rel_err

BF16, F32 = jnp.bfloat16, jnp.float32


def _bf16_dot(a, b, dims):
    """A bf16 product as the kernels compute it: FP32 sum, one rounding."""
    return jax.lax.dot_general(a, b, dims, preferred_element_type=F32).astype(BF16)


def plain_dense(x, w):
    return _bf16_dot(x, w.astype(BF16), (((x.ndim - 1,), (1,)), ((), ())))


def _plain_batched(x, w):
    return _bf16_dot(x, w.astype(BF16), (((2,), (2,)), ((0,), (0,))))


def plain_gated(x, w_gate, w_up, activation="silu"):
    g, u = plain_dense(x, w_gate), plain_dense(x, w_up)
    act = jax.nn.silu if activation == "silu" else functools.partial(jax.nn.gelu, approximate=True)
    return (act(g.astype(F32)) * u.astype(F32)).astype(BF16)


def _plain_router(x, w):
    return jnp.dot(x, w.T, precision=jax.lax.Precision.HIGHEST)


# Each case: (jax_cake function, plain-JAX function of the same values, operand builders,
# tolerance of the second-order result). The operands are the differentiated arguments.
def dense_operands():
    return rand(0, (96, 64), BF16), rand(1, (48, 64), F32)


def _residual_operands():
    return rand(0, (96, 64), BF16), rand(1, (48, 64), F32), rand(2, (96, 48), BF16)


def _batched_operands():
    return rand(0, (3, 40, 64), BF16), rand(1, (3, 32, 64), F32)


def _gated_operands():
    return rand(0, (96, 64), BF16), rand(1, (48, 64), F32), rand(2, (48, 64), F32)


def _mlp_operands():
    return (*_gated_operands(), rand(3, (64, 48), F32))


def router_operands():
    return rand(0, (96, 64), F32), rand(1, (16, 64), F32)


def _flax_operands():
    return rand(0, (96, 64), BF16), rand(1, (64, 48), F32)


CASES = {
    "dense": (jc.dense_projection, plain_dense, dense_operands),
    "dense_bf16_w": (jc.dense_projection, plain_dense, lambda: (dense_operands()[0], dense_operands()[1].astype(BF16))),
    "residual": (
        lambda x, w, r: jc.dense_projection(x, w, residual=r),
        lambda x, w, r: (r.astype(F32) + plain_dense(x, w).astype(F32)).astype(BF16),
        _residual_operands,
    ),
    "batched": (jc.batched_projection, _plain_batched, _batched_operands),
    "fused": (
        lambda x, w: jnp.concatenate(jc.fused_projections(x, (w[:16], w[16:])), -1),
        plain_dense,
        dense_operands,
    ),
    "gated_silu": (jc.gated_projection, plain_gated, _gated_operands),
    "gated_gelu": (
        functools.partial(jc.gated_projection, activation="gelu"),
        functools.partial(plain_gated, activation="gelu"),
        _gated_operands,
    ),
    "swiglu_mlp": (
        jc.swiglu_mlp,
        lambda x, wg, wu, wd: plain_dense(plain_gated(x, wg, wu), wd),
        _mlp_operands,
    ),
    "router": (jc.router_logits, _plain_router, router_operands),
    "flax_dot_general": (
        lambda x, k: jc.dot_general(x, k.astype(BF16), (((1,), (0,)), ((), ()))),
        lambda x, k: _bf16_dot(x, k.astype(BF16), (((1,), (0,)), ((), ()))),
        _flax_operands,
    ),
}


def hvp(fn, operands, directions):
    """grad of <grad(loss), v> over every operand: reverse over reverse."""

    def loss(*args):  # well conditioned: the HVP's error is the GEMMs', not the loss's
        return 0.5 * jnp.sum(fn(*args).astype(F32) ** 2)

    def directional(*args):
        grads = jax.grad(loss, argnums=tuple(range(len(args))))(*args)
        return sum(jnp.sum(g.astype(F32) * v) for g, v in zip(grads, directions))

    return jax.grad(directional, argnums=tuple(range(len(operands))))(*operands)


def _directions(operands):
    return tuple(rand(100 + i, a.shape, F32) for i, a in enumerate(operands))


def check(fn, plain, operands, hvp_fn, tolerance=1.5e-2):
    """hvp_fn's HVP of fn equals plain JAX's HVP of the same computation (`plain`) run on
    FP32 operands holding the same values, whose second-order GEMMs are not rounded.
    Tolerance: bf16 results round the first-order gradients and the second-order GEMMs to
    bf16; the router is FP32 (BF16x3) throughout (1e-5)."""
    directions = _directions(operands)
    got = hvp_fn(fn, operands, directions)
    as_given = lambda *a: plain(*(v.astype(o.dtype) for v, o in zip(a, operands)))
    with jax.default_matmul_precision("highest"):  # FP32 dots on a GPU too (not TF32)
        want = hvp(as_given, tuple(o.astype(F32) for o in operands), directions)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == operands[i].dtype, (i, g.dtype)
        assert rel_err(g, w) < tolerance, (i, rel_err(g, w))


def check_case(name, hvp_fn):
    fn, plain, make = CASES[name]
    check(fn, plain, make(), hvp_fn, 1e-5 if name == "router" else 1.5e-2)
