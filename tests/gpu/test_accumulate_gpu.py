"""Gradient accumulation in the wgrad kernel (jax_cake_wgrad_accumulate) on the GPU.

The running sum is an input here, so instead of NaN-poisoned output memory it starts from
random FP32 values (an unwritten or doubly added tile is then off by a whole tile's sum):
  - the in-place result against the float64 sum acc + dy^T x (1e-5 relative), on the
    one-pass reduce-add program and on the ordered-split program (skinny d_out);
  - bitwise the same over 20 runs, and bit for bit acc + the plain wgrad of the same tile
    and splits (the kernel adds its finished FP32 total once, as XLA's add would);
  - a 4-micro-batch scan step through the public API against the float64 sum of the
    micro-batch gradients, and its compiled module holds the accumulating custom call
    and no elementwise add or copy over the sum.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cake
from jax_cake import primitives
from jax_cake.planner.accumulate import plan_accumulate

import gpu_helpers as h

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_library")]

MICRO = 4
# (B, T, d_in, d_out): the bench's square and skinny rows, an odd T with edge tiles, a batch.
CASES = [(1, 8192, 4096, 4096), (1, 8192, 4096, 48), (1, 1000, 512, 264), (3, 2048, 512, 128)]


def _inputs(b, t, d_in, d_out):
    key = ("acc", b, t, d_in, d_out)
    x = h.rand(h.seed_of("x", *key), (b, t, d_in))
    dy = h.rand(h.seed_of("dy", *key), (b, t, d_out))
    # The size of a micro-batch's gradient, so a missing or doubled add shows.
    acc = h.rand(h.seed_of("acc", *key), (b, d_out, d_in), h.F32, scale=float(np.sqrt(t)))
    return x, dy, acc


def _plan(b, t, d_in, d_out):
    p = plan_accumulate(tokens=t, d_in=d_in, d_out=d_out, batch=b)
    assert p.op == "wgrad_accumulate" and p.uses_kernel, jax_cake.explain(p)
    return p


@jax.jit
def _ref64_sum(acc, dy, x):
    return acc.astype(h.F64) + jnp.einsum(
        h.WGRAD, dy.astype(h.F64), x.astype(h.F64), precision=jax.lax.Precision.HIGHEST
    )


def _reference(acc, dy, x):
    with jax.enable_x64(True):
        return _ref64_sum(acc, dy, x)


def _accumulate_fn(plan):
    # Donates the sum: the custom call writes it in place.
    return jax.jit(lambda dy, x, acc: primitives.wgrad(dy, x, plan, add_to=acc), donate_argnums=2)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}_T{}_{}to{}".format(*c))
def test_values_against_float64(case):
    b, t, d_in, d_out = case
    x, dy, acc = _inputs(*case)
    plan = _plan(*case)
    ref = _reference(acc, dy, x)
    fn = _accumulate_fn(plan)
    assert "jax_cake_wgrad_accumulate" in fn.lower(dy, x, acc).compile().as_text()
    out = fn(dy, x, jnp.copy(acc))
    h.assert_close(out, ref, h.F32_TOL, f"{case} {plan.tile} splits {plan.splits}")


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: "B{}_T{}_{}to{}".format(*c))
def test_bitwise_reproducible_and_equal_to_acc_plus_wgrad(case):
    x, dy, acc = _inputs(*case)
    plan = _plan(*case)
    fn = _accumulate_fn(plan)
    first = h.assert_repeatable(lambda: fn(dy, x, jnp.copy(acc)), h.REPEATS, f"{case}")
    # The same tile and splits on the plain wgrad program, then XLA's add.
    plain = dataclasses.replace(plan, op="wgrad")
    separate = jax.jit(lambda dy, x, acc: acc + primitives.wgrad(dy, x, plain))(dy, x, acc)
    assert h.same_bits(first, separate), f"{case}: fused sum differs from acc + wgrad of the same program"


def _loss(w, acc, x, dy):
    y = jax_cake.dense_projection(x, w, grad_accumulator=acc)
    return jnp.sum(y.astype(h.F32) * dy.astype(h.F32))


def _scan_step(w, acc, xs, dys):
    def micro(acc, mb):
        return jax.grad(_loss, argnums=1)(w, acc, *mb), None

    return jax.lax.scan(micro, acc, (xs, dys))[0]


@pytest.mark.parametrize("d_out", [4096, 48])
def test_scan_step_in_place_against_float64(d_out):
    t, d_in = 8192, 4096
    key = ("scan", t, d_in, d_out)
    xs = h.rand(h.seed_of("x", *key), (MICRO, t, d_in))
    dys = h.rand(h.seed_of("dy", *key), (MICRO, t, d_out))
    w = h.rand(h.seed_of("w", *key), (d_out, d_in), h.F32, scale=0.02)
    acc0 = h.rand(h.seed_of("acc", *key), (d_out, d_in), h.F32, scale=float(np.sqrt(t)))
    step = jax.jit(_scan_step, donate_argnums=1)
    compiled = step.lower(w, acc0, xs, dys).compile()
    text = compiled.as_text()
    assert "jax_cake_wgrad_accumulate" in text
    assert 'custom_call_target="jax_cake_wgrad"' not in text
    # An instruction of the sum's shape that is an add (in any fusion) or a copy.
    shape = rf"f32\[(1,)?{d_out},{d_in}\]"
    adds = [line for line in text.splitlines() if re.search(r"=\s*" + shape + r"\S*\s+add\(", line)]
    assert adds == [], "separate add over the sum:\n" + "\n".join(adds)
    copies = [line for line in text.splitlines() if re.search(r"=\s*" + shape + r"\S*\s+copy\(", line)]
    assert copies == [], "the donated sum is copied:\n" + "\n".join(copies)
    out = compiled(w, jnp.copy(acc0), xs, dys)
    with jax.enable_x64(True):
        ref = acc0.astype(h.F64) + sum(
            jnp.einsum(h.WGRAD2, dys[i].astype(h.F64), xs[i].astype(h.F64), precision=jax.lax.Precision.HIGHEST)
            for i in range(MICRO)
        )
    h.assert_close(out, ref, h.F32_TOL, f"scan of {MICRO} micro-batches, {d_in} -> {d_out}")
