"""The public ops on the GPU under jit, grad and checkpoint: they lower to the jax_cake
custom calls (one per GEMM), and their values match float64 references (bf16 outputs
within 1e-2, fp32 dw within 1e-5, the router within 5e-6)."""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cake
from jax_cake import contract

import gpu_helpers as h

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_library")]

OPS = ("fwd", "dgrad", "wgrad")


def _errs(outs, refs):
    return [h.rel_err_nonfinite(o, r) for o, r in zip(outs, refs)]


def _assert_values(what, outs, refs, tols):
    errs = _errs(outs, refs)
    detail = " ".join(f"{n}={e:.2e}/nonfinite {b}" for n, (e, b) in zip(("y", "dx", "dw"), errs))
    assert all(b == 0 and e < tol for (e, b), tol in zip(errs, tols)), f"{what}: {detail}"


def _dense_refs(x, w, dy):
    wr = w.astype(h.BF16)  # the op rounds w to bf16 before the GEMMs
    return h.ref64(h.FWD2, x, wr), h.ref64(h.DGRAD2, dy, wr), h.ref64(h.WGRAD2, dy, x)


@pytest.mark.parametrize("cfg", [pytest.param(c, id=c.id) for c in h.DENSE_CASES])
def test_dense_projection(cfg):
    """jit(vjp(dense_projection)): one custom call per GEMM the planner gives a kernel (a
    plan-table xla row sends a GEMM to XLA's dot), y / dx / dw against float64, dw in w's dtype."""
    x, w, dy = h.dense_inputs(cfg)
    step = h.dense_step(cfg.det)
    text = step.lower(x, w, dy).as_text()
    sizes = dict(tokens=cfg.T, d_in=cfg.d_in, d_out=cfg.d_out)
    out = {"fwd": "bfloat16", "dgrad": "bfloat16", "wgrad": cfg.w_dtype}
    planned = [int(jax_cake.plan(op, **sizes, out_dtype=out[op], deterministic=cfg.det).uses_kernel) for op in OPS]
    assert [h.custom_calls(text, f"jax_cake_{op}") for op in OPS] == planned
    y, dx, dw = step(x, w, dy)
    assert dw.dtype == jnp.dtype(cfg.w_dtype)
    dw_tol = h.F32_TOL if cfg.w_dtype == "float32" else h.BF16_TOL
    _assert_values(cfg.id, (y, dx, dw), _dense_refs(x, w, dy), (h.BF16_TOL, h.BF16_TOL, dw_tol))


@pytest.mark.parametrize(
    "B,T,d_in,d_out,w_dtype",
    [(16, 4096, 128, 512, "bfloat16"), (3, 1011, 512, 128, "float32"), (128, 64, 128, 512, "bfloat16")],
    ids=lambda v: str(v),
)
def test_batched_projection(B, T, d_in, d_out, w_dtype):
    shape = (B, T, d_in, d_out, w_dtype)
    x = h.rand(h.seed_of("bx", *shape), (B, T, d_in))
    w = h.rand(h.seed_of("bw", *shape), (B, d_out, d_in), h.dtype_of(w_dtype))
    dy = h.rand(h.seed_of("bdy", *shape), (B, T, d_out))
    step = jax.jit(functools.partial(h.api_vjp, jax_cake.batched_projection))
    text = step.lower(x, w, dy).as_text()
    assert [h.custom_calls(text, f"jax_cake_{op}") for op in OPS] == [1, 1, 1]
    wr = w.astype(h.BF16)
    refs = h.ref64(h.FWD, x, wr), h.ref64(h.DGRAD, dy, wr), h.ref64(h.WGRAD, dy, x)
    dw_tol = h.F32_TOL if w_dtype == "float32" else h.BF16_TOL
    _assert_values(f"B{B}_T{T}_{d_in}to{d_out}", step(x, w, dy), refs, (h.BF16_TOL, h.BF16_TOL, dw_tol))


def _router_kernels_enabled() -> bool:
    """The planner's switch for the router kernels (in the module that defines plan())."""
    return bool(sys.modules[jax_cake.planner.plan.__module__].ROUTER_KERNELS_ENABLED)


@pytest.mark.parametrize("shape", h.ROUTER_API_SHAPES, ids=lambda s: f"T{s[0]}_d{s[1]}")
def test_router_logits(shape):
    """router_logits runs the router kernels (three custom calls) while the planner enables
    them, XLA's BF16x3 (none) otherwise; either way within 5e-6 of float64."""
    x, w, g = h.router_api_inputs(*shape)
    step = h.router_step()
    text = step.lower(x, w, g).as_text()
    calls = [h.custom_calls(text, f"jax_cake_router_{op}") for op in OPS]
    assert calls == ([1, 1, 1] if jax_cake.planner.choose.ROUTER_KERNELS_ENABLED else [0, 0, 0])
    refs = h.ref64(h.FWD2, x, w), h.ref64(h.DGRAD2, g, w), h.ref64(h.WGRAD2, g, x)
    _assert_values(f"T{shape[0]}_d{shape[1]}", step(x, w, g), refs, (h.ROUTER_TOL,) * 3)


@pytest.mark.parametrize("experts", [8, 16])
def test_router_logits_with_few_experts_runs_xlas_bf16x3_dot(experts):
    """At E <= ROUTER_XLA_MAX_EXPERTS router_logits is XLA's BF16x3 dot (no router custom
    call): within 5e-6 of float64 like the kernels, and bitwise repeatable."""
    x, w, g = h.router_api_inputs(16384, 4096, experts)
    step = h.router_step()
    text = step.lower(x, w, g).as_text()
    assert [h.custom_calls(text, f"jax_cake_router_{op}") for op in OPS] == [0, 0, 0]
    refs = h.ref64(h.FWD2, x, w), h.ref64(h.DGRAD2, g, w), h.ref64(h.WGRAD2, g, x)
    first = step(x, w, g)
    _assert_values(f"E{experts}", first, refs, (h.ROUTER_TOL,) * 3)
    for i in range(h.REPEATS - 1):
        for name, a, b in zip(("logits", "dx", "dw"), first, step(x, w, g)):
            assert h.same_bits(a, b), f"{name} of run {i + 2} differs from run 1"


def test_checkpoint():
    """jax.checkpoint: the same gradients, bit for bit, with and without remat; plain remat
    recomputes the first forward custom call, the save_projections policy does not."""
    x = h.rand(h.seed_of("ckpt_x"), (4096, 1024))
    w1 = h.rand(h.seed_of("ckpt_w1"), (2048, 1024), h.F32)
    w2 = h.rand(h.seed_of("ckpt_w2"), (512, 2048), h.F32)

    def loss(policy, x, w1, w2):
        def block(x, w1, w2):
            return jax_cake.dense_projection(jax.nn.gelu(jax_cake.dense_projection(x, w1)), w2)

        if policy != "none":
            block = jax.checkpoint(block, policy=policy)
        return jnp.sum(block(x, w1, w2).astype(h.F32) ** 2)

    results = {}
    for name, policy in [("none", "none"), ("remat", None), ("save_projections", jax_cake.remat.save_projections)]:
        g = jax.jit(jax.grad(functools.partial(loss, policy), argnums=(1, 2)))
        fwd_calls = h.custom_calls(g.lower(x, w1, w2).as_text(), contract.FWD_TARGET)
        results[name] = (fwd_calls, g(x, w1, w2))
    assert {k: v[0] for k, v in results.items()} == {"none": 2, "remat": 3, "save_projections": 2}
    for name in ("remat", "save_projections"):
        for i, (a, b) in enumerate(zip(results[name][1], results["none"][1])):
            assert np.isfinite(np.asarray(a)).all()
            assert h.same_bits(a, b), f"{name}: gradient {i} differs from the un-checkpointed step"


PINGPONG_SHAPE = (16384, 4096, 512)  # T, d_in, d_out
PINGPONG = f"schedule = {contract.SCHEDULE_PINGPONG}"  # the attribute in the lowered text


@functools.cache
def _pingpong_inputs():
    T, d_in, d_out = PINGPONG_SHAPE
    return (
        h.rand(h.seed_of("pp_x", *PINGPONG_SHAPE), (T, d_in)),
        h.rand(h.seed_of("pp_w", *PINGPONG_SHAPE), (d_out, d_in), h.F32),
        h.rand(h.seed_of("pp_dy", *PINGPONG_SHAPE), (T, d_out)),
    )


def _pingpong_forced():
    """(lowered text, (y, dx, dw)) of the vjp step traced under force(det, schedule=pingpong)."""
    x, w, dy = _pingpong_inputs()
    with jax_cake.planner.force("det", schedule="pingpong"):
        step = jax.jit(functools.partial(h.api_vjp, jax_cake.dense_projection))  # traced inside the block
        text = step.lower(x, w, dy).as_text()
        outs = step(x, w, dy)
    return text, outs


def test_pingpong_forced():
    """force(det, schedule=pingpong): fwd and dgrad both on ping-pong, values as float64."""
    x, w, dy = _pingpong_inputs()
    text, outs = _pingpong_forced()
    assert text.count(PINGPONG) == 2
    _assert_values("pingpong forced", outs, _dense_refs(x, w, dy), (h.BF16_TOL, h.BF16_TOL, h.F32_TOL))


def test_pingpong_by_rule():
    """Unforced, the planner's rule puts only dgrad (K = 512) on ping-pong; its dx has the
    same bits as the forced step's."""
    x, w, dy = _pingpong_inputs()
    step = jax.jit(functools.partial(h.api_vjp, jax_cake.dense_projection))
    assert step.lower(x, w, dy).as_text().count(PINGPONG) == 1
    _, forced = _pingpong_forced()
    assert h.same_bits(step(x, w, dy)[1], forced[1])
