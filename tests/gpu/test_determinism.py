"""Deterministic programs give the same bits run after run (REPEATS = 20 runs, each on
fresh NaN-poisoned output memory): ordered split-K, the split-free programs, split tails,
fp32 chains promoted into dw, ping-pong, CTA pairs, the router, and the public API with
deterministic=True. Arrival-order (atomic) split-K is not bitwise: it stays within 1e-5
of its ordered twin."""

import functools

import jax
import jax.numpy as jnp
import pytest

from jax_cake import contract

import kernel_cases as cases
import gpu_helpers as h

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_library")]


@pytest.mark.parametrize("case", cases.params(cases.REPEAT_CASES))
def test_program_bitwise_repeatable(case):
    h.assert_repeatable(case.run, h.REPEATS, case.id)


@pytest.mark.parametrize("case", cases.params(cases.ATOMIC_CASES))
def test_arrival_split_k_close_to_ordered(case):
    a, b, _ = case.operands()
    run = functools.partial(
        h.call, case.target, a, b, tile=case.tile, out_dtype=h.F32, splits=case.splits, cluster=case.cluster
    )
    ordered = run(reduction=contract.REDUCTION_ORDERED)
    with jax.enable_x64(True):
        ordered64 = ordered.astype(jnp.float64)
    for i in range(5):
        h.assert_close(run(reduction=contract.REDUCTION_ARRIVAL), ordered64, 1e-5, f"{case.id} run {i} against ordered")


ROUTER_SHAPE = (16231, 4096, 256)  # T, d, E


@pytest.mark.parametrize("program", ["fwd", "dgrad", "wgrad_s4_ordered"])
def test_router_bitwise_repeatable(program):
    x, w, g = h.router_inputs(*ROUTER_SHAPE)
    run = {
        "fwd": lambda: h.router_call(contract.ROUTER_FWD_TARGET, x, w),
        "dgrad": lambda: h.router_call(contract.ROUTER_DGRAD_TARGET, g, w),
        "wgrad_s4_ordered": lambda: h.router_call(contract.ROUTER_WGRAD_TARGET, g, x, splits=4, reduction=1),
    }[program]
    h.assert_repeatable(run, h.REPEATS, f"router {program}")


@pytest.mark.parametrize("cfg", [pytest.param(c, id=c.id) for c in h.DENSE_CASES if c.det])
def test_dense_projection_bitwise_repeatable(cfg):
    """dense_projection(deterministic=True): y, dx and dw of the jitted vjp step."""
    x, w, dy = h.dense_inputs(cfg)
    step = h.dense_step(cfg.det)
    first = step(x, w, dy)
    for i in range(h.REPEATS - 1):
        again = step(x, w, dy)
        for name, a, b in zip(("y", "dx", "dw"), first, again):
            assert h.same_bits(a, b), f"{cfg.id}: {name} of run {i + 2} differs from run 1"


@pytest.mark.parametrize("shape", h.ROUTER_API_SHAPES, ids=lambda s: f"T{s[0]}_d{s[1]}")
def test_router_logits_bitwise_repeatable(shape):
    """router_logits under jit + grad: logits, dx and dw the same bits over REPEATS runs."""
    x, w, g = h.router_api_inputs(*shape)
    step = h.router_step()
    first = step(x, w, g)
    for i in range(h.REPEATS - 1):
        again = step(x, w, g)
        for name, a, b in zip(("logits", "dx", "dw"), first, again):
            assert h.same_bits(a, b), f"{name} of run {i + 2} differs from run 1"
