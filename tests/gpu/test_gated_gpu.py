"""gated_projection and swiglu_mlp on the GPU: their GEMMs lower to the jax_cake custom
calls (the gated kernel where d_ff is a multiple of 16), and their values match float64
references of the defined semantics (h and dx within bf16 rounding, FP32 dW within 1e-5 of
float64 wgrads of the op's dg, du); each compiled gated kernel, forced; each compiled
gradient-epilogue kernel (the down projection's dgrad writing d[gate|up]), forced, and
swiglu_mlp's backward through it; each compiled dx kernel that reads the cotangent's
halves and the weight's gate and up rows in place (jax_cake_dgrad_gate_up), forced."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gpu_helpers as h
import jax_cake
import jax_cake.planner.variants
from jax_cake import contract, reference
from jax_cake.planner import force
from jax_cake.planner import gated as gated_planner
from jax_cake.pipeline import gated as gated_pipeline
from jax_cake.planner.gated import plan_gate_grad, plan_gated
from jax_cake.primitives import gemm
from test_gated import _act64 as _act_and_slope64, _reference64

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_library")]

# (T, d_in, F): one wgrad per weight (F >= 512) and one over the interleaved 2F (ragged).
CASES = [(2048, 1024, 1024), (1000, 512, 264)]


def _inputs(t, d_in, f):
    key = ("gated", t, d_in, f)
    x = h.rand(h.seed_of("x", *key), (t, d_in))
    wg = h.rand(h.seed_of("wg", *key), (f, d_in), h.F32, scale=0.05)
    wu = h.rand(h.seed_of("wu", *key), (f, d_in), h.F32, scale=0.05)
    dh = h.rand(h.seed_of("dh", *key), (t, f))
    return x, wg, wu, dh


def _within(out, ref, tol):
    err, nonfinite = h.rel_err_nonfinite(out, ref)
    return nonfinite == 0 and err < tol


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}_{}x{}".format(*c))
def test_gated_projection_on_the_kernels(case, activation):
    x, wg, wu, dh = _inputs(*case)

    def step(x, wg, wu, dh):
        out, vjp = jax.vjp(lambda *a: jax_cake.gated_projection(*a, activation=activation), x, wg, wu)
        return (out, *vjp(dh))

    step = jax.jit(step)
    text = step.lower(x, wg, wu, dh).as_text()
    t, d_in, f = case
    fused = plan_gated(tokens=t, d_in=d_in, d_out=2 * f, activation=activation).op == "fwd_gated"
    assert h.custom_calls(text, "jax_cake_fwd_gated" if fused else "jax_cake_fwd") == 1
    # dx: from dg, du in place where the planner says so (F a multiple of the interleave's
    # block, a gate_up_halves variant of the dgrad's tile), else over them interleaved.
    block = contract.GATE_BLOCK if f % contract.GATE_BLOCK == 0 else 1
    dx_plan = gated_planner.plan_gate_up_dgrad(jax_cake.plan("dgrad", tokens=t, d_in=d_in, d_out=2 * f), block)
    halves = dx_plan.op == "dgrad_gate_up"
    assert halves == (block == contract.GATE_BLOCK), dx_plan  # both CASES shapes
    assert h.custom_calls(text, "jax_cake_dgrad_gate_up") == int(halves)
    assert h.custom_calls(text, "jax_cake_dgrad") == int(not halves)
    assert h.custom_calls(text, "jax_cake_wgrad") >= 1 and "dot_general" not in text
    out, dx, dwg, dwu = step(x, wg, wu, dh)
    assert (dwg.dtype, dwu.dtype) == (jnp.float32, jnp.float32)
    ref_h, ref_dx, _, _ = _reference64(x, wg, wu, dh, activation)
    assert _within(out, ref_h, h.BF16_TOL)
    assert _within(dx, ref_dx, h.BF16_TOL)
    # dW against float64 wgrads of the op's own dg, du: the pre-activation from the same
    # forward kernel (fused_projections: the same K loop, so the same bits) and the
    # defined activation gradient, so only the wgrad's FP32 sum is left.
    g, u = jax.jit(lambda x, wg, wu: jax_cake.fused_projections(x, (wg, wu)))(x, wg, wu)
    dg, du = jax.jit(lambda dh, g, u: reference.gate_grad(dh, g, u, activation))(dh, g, u)
    x64 = h.f64(x)
    assert _within(dwg, h.f64(dg).T @ x64, h.F32_TOL)
    assert _within(dwu, h.f64(du).T @ x64, h.F32_TOL)


def test_swiglu_mlp_on_the_kernels_with_the_fused_residual():
    t, d, f = 2048, 1024, 1024
    x, wg, wu, _ = _inputs(t, d, f)
    wd = h.rand(h.seed_of("wd", t, d, f), (d, f), h.F32, scale=0.03)
    r = h.rand(h.seed_of("r", t, d, f), (t, d))

    def mlp(x, wg, wu, wd, r):
        return jax_cake.swiglu_mlp(x, wg, wu, wd, residual=r)

    text = jax.jit(mlp).lower(x, wg, wu, wd, r).as_text()
    fused = plan_gated(tokens=t, d_in=d, d_out=2 * f, activation="silu").op == "fwd_gated"
    gate_up = "jax_cake_fwd_gated" if fused else "jax_cake_fwd"
    assert h.custom_calls(text, gate_up) == 1 and h.custom_calls(text, "jax_cake_fwd_residual") == 1
    y = jax.jit(mlp)(x, wg, wu, wd, r)
    hidden = jax.jit(jax_cake.gated_projection)(x, wg, wu)
    ref = h.f64(r) + h.f64(hidden) @ h.f64(wd.astype(jnp.bfloat16)).T
    assert _within(y, ref, h.BF16_TOL)


# --- the gated kernel epilogue, each compiled variant forced -------------------------------------

# The dense ones (the grouped gated variants: tests/gpu/test_moe_gpu.py).
GATED_VARIANTS = [v for v in jax_cake.planner.variants.VARIANTS if v.activation is not None and v.grouping is None]
# (T, d_in, F): whole tiles; ragged T, d_in and 2F (2F = 2080 is not a multiple of any tile_n).
KERNEL_SHAPES = [(2048, 1024, 2048), (1000, 520, 1040)]


def _exp_argument(g, activation):
    """The argument a of the activation's exp(-a) (silu: g, gelu: 2 y), in float64."""
    if activation == "silu":
        return g
    return 2.0 * 0.7978845608028654 * (g + 0.044715 * g**3)


def _gated_call(variant, x, w):
    """(h, gu) of the gated kernel `variant` on x [T, d_in], w [2F, d_in] (interleaved in
    blocks of contract.GATE_BLOCK), and gu of the plain forward of the same tile."""
    t, d_in = x.shape
    with force("det", tile=variant.tile, cluster=variant.cluster, schedule=variant.schedule):
        plan = plan_gated(tokens=t, d_in=d_in, d_out=w.shape[0], activation=variant.activation)
    assert plan.op == "fwd_gated", plan
    assert (plan.tile, plan.cluster, plan.schedule) == (variant.tile, variant.cluster, variant.schedule), plan
    gated = jax.jit(lambda x, w: gemm.fwd_gated(x[None], w[None], plan, variant.activation))
    plain = jax.jit(lambda x, w: gemm.fwd(x[None], w[None], plan.unfused()))
    text = gated.lower(x, w).as_text()
    assert h.custom_calls(text, "jax_cake_fwd_gated") == 1 and "dot_general" not in text
    return gated, plain


@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=lambda s: "T{}_{}x{}".format(*s))
@pytest.mark.parametrize("variant", GATED_VARIANTS, ids=lambda v: v.name)
def test_gated_kernel_epilogue(variant, shape, monkeypatch):
    """gu is bit for bit the plain forward of the same tile; h is bf16(act(g) * u) of that
    gu within half a bf16 step of float64, plus the FP32 error of the activation; every
    element written; bitwise repeatable.

    That FP32 error: act(g) = g / (1 + exp(-a)) with a rounded a few times in FP32 (a few
    units of 2^-24 relative), so exp(-a) and act carry |a| times that, plus a few units of
    their own rounding: (16 + 8 |a|) 2^-24 relative. gelu's |a| reaches ~50 at g = -8."""
    monkeypatch.setattr(gated_planner, "GATED_EPILOGUE_ENABLED", True)
    t, d_in, f = shape
    key = ("gated_kernel", variant.name, *shape)
    x = h.rand(h.seed_of("x", *key), (t, d_in))
    w = h.rand(h.seed_of("w", *key), (2 * f, d_in), scale=0.05)
    gated, plain = _gated_call(variant, x, w)
    out, gu = gated(x, w)
    assert out.shape == (1, t, f) and gu.shape == (1, t, 2 * f)
    np.testing.assert_array_equal(np.asarray(gu), np.asarray(plain(x, w)))
    ref_gu = h.f64(x) @ h.f64(w).T
    assert _within(gu[0], ref_gu, h.BF16_TOL)
    g, u = (h.f64(v[0]) for v in reference.deinterleave(gu, -1, contract.GATE_BLOCK))
    ref = _act_and_slope64(g, variant.activation)[0] * u
    got = h.f64(out[0])
    assert np.all(np.isfinite(got))
    fp32_error = (16.0 + 8.0 * np.abs(_exp_argument(g, variant.activation))) * 2.0**-24
    bound = (2.0**-8 + fp32_error) * np.abs(ref) + 1e-30
    worst = np.max(np.abs(got - ref) / bound)
    assert worst <= 1.0, f"|h - act(g) u| reaches {worst:.2f} of half a bf16 step"
    for _ in range(3):
        again, gu_again = gated(x, w)
        np.testing.assert_array_equal(np.asarray(again), np.asarray(out))
        np.testing.assert_array_equal(np.asarray(gu_again), np.asarray(gu))


# --- the gradient epilogue (jax_cake_dgrad_gated), each compiled variant forced ------------------

GATE_GRAD_VARIANTS = [v for v in jax_cake.planner.variants.VARIANTS if v.gate_grad is not None]
# (B, T, d_out, F): whole M tiles; ragged T, K = d_out and F (no multiple of 192); two
# batches (d_gu's planes are [2, B, T, F]); 465 tiles (3-4 per CTA, so each warpgroup takes
# the shared epilogue ring more than once and the gu loads' mbarriers go through several
# phases) with an odd number of M tiles (the last cluster of a 2x1 one has a CTA past T).
GATE_GRAD_SHAPES = [(1, 2048, 1024, 2048), (1, 1000, 520, 1040), (2, 512, 256, 400), (1, 3968, 512, 2704)]


@functools.lru_cache(maxsize=None)
def _ffi_body(target: str, attrs_key: tuple):
    """body(result type, *operands): one call of `target` with the attributes of attrs_key
    (sorted (name, value) pairs: hashable, so h.run_poisoned caches its program)."""
    attrs = dict(attrs_key)

    def body(result, *operands):
        return jax.ffi.ffi_call(target, result)(*operands, **attrs)

    return body


@pytest.mark.parametrize("shape", GATE_GRAD_SHAPES, ids=lambda s: "B{}_T{}_{}x{}".format(*s))
@pytest.mark.parametrize("variant", GATE_GRAD_VARIANTS, ids=lambda v: v.name)
def test_gate_grad_kernel_epilogue(variant, shape):
    """d_gu's planes (dg, du) = gate_grad(dh, g, u) within half a bf16 step (plus the FP32
    rounding of the activation) of float64, dh the plain dgrad of the same tile (the same K
    loop: the bf16 dh the kernel rounds its accumulator to, which never leaves the kernel;
    a dh one bf16 step off would break the bound); every element of both planes written
    (NaN-poisoned output); the planner's plan lowers to the call; bitwise repeatable."""
    b, t, d_out, f = shape
    key = ("gate_grad_kernel", variant.name, *shape)
    dy = h.rand(h.seed_of("dy", *key), (b, t, d_out))
    wd = h.rand(h.seed_of("wd", *key), (b, d_out, f), scale=0.05)
    gu = h.rand(h.seed_of("gu", *key), (b, t, 2 * f), scale=2.0)
    with force("det", tile=variant.tile, cluster=variant.cluster, schedule=variant.schedule):
        plan = plan_gate_grad(tokens=t, d_ff=f, d_out=d_out, activation=variant.gate_grad, batch=b, epilogue=True)
    assert plan.op == "dgrad_gated", plan
    assert (plan.tile, plan.cluster, plan.schedule) == (variant.tile, variant.cluster, variant.schedule), plan
    text = jax.jit(lambda *a: gemm.dgrad_gated(*a, plan, variant.gate_grad)).lower(dy, wd, gu).as_text()
    assert h.custom_calls(text, "jax_cake_dgrad_gated") == 1 and "dot_general" not in text
    attrs = h.ffi_attrs(variant.tile, cluster=variant.cluster, schedule=variant.schedule)
    attrs["activation"] = np.int64(contract.ACTIVATION_CODES[variant.gate_grad])
    body = _ffi_body(contract.DGRAD_GATED_TARGET, tuple(sorted((k, int(v)) for k, v in attrs.items())))
    run = lambda: h.run_poisoned(body, (2, b, t, f), jnp.bfloat16, dy, wd, gu)
    d_gu = h.assert_repeatable(run, what=variant.name)
    dh = jax.jit(lambda dy, wd: gemm.dgrad(dy, wd, plan.unfused()))(dy, wd)
    for i in range(b):
        assert _within(dh[i], h.f64(dy[i]) @ h.f64(wd[i]), h.BF16_TOL)
        g, u = (h.f64(v[i]) for v in reference.deinterleave(gu, -1, contract.GATE_BLOCK))
        value, slope = _act_and_slope64(g, variant.gate_grad)
        dh64 = h.f64(dh[i])
        got_dg, got_du = h.f64(d_gu[0, i]), h.f64(d_gu[1, i])
        assert np.all(np.isfinite(got_dg)) and np.all(np.isfinite(got_du)), f"unwritten (NaN) elements in batch {i}"
        for name, got, ref in (("dg", got_dg, dh64 * u * slope), ("du", got_du, dh64 * value)):
            bound = (2.0**-8 + 2.0**-20) * np.abs(ref) + 1e-30
            worst = np.max(np.abs(got - ref) / bound)
            assert worst <= 1.0, f"|{name} - ref| reaches {worst:.2f} of half a bf16 step in batch {i}"


def test_swiglu_mlp_backward_through_the_gradient_epilogue(monkeypatch):
    """Where the planner runs it (enabled here: it is held back by default), swiglu_mlp's
    backward lowers to ONE jax_cake_dgrad_gated call, no dgrad for dh, and dx from dg and du
    as that call leaves them (jax_cake_dgrad_gate_up); its gradients
    match the composed MLP's (gated_projection, then dense_projection: dx within bf16
    rounding, dW within 1e-5) and float64 (dWd from the op's h)."""
    t, d, f = 2048, 1024, 2048
    x, wg, wu, _ = _inputs(t, d, f)
    wd = h.rand(h.seed_of("wd", t, d, f), (d, f), h.F32, scale=0.03)
    dy = h.rand(h.seed_of("dy", t, d, f), (t, d))

    def step():  # a new function per trace: the MLP's form is chosen at trace time
        def vjp_step(x, wg, wu, wd, dy):
            y, vjp = jax.vjp(jax_cake.swiglu_mlp, x, wg, wu, wd)
            return (y, *vjp(dy))

        return jax.jit(vjp_step)

    args = (x, wg, wu, wd, dy)
    monkeypatch.setattr(gated_planner, "GATE_GRAD_EPILOGUE_ENABLED", True)
    assert plan_gate_grad(tokens=t, d_ff=f, d_out=d, activation="silu").op == "dgrad_gated"
    text = step().lower(*args).as_text()
    assert h.custom_calls(text, "jax_cake_dgrad_gated") == 1 and h.custom_calls(text, "jax_cake_dgrad") == 0
    assert h.custom_calls(text, "jax_cake_dgrad_gate_up") == 1  # dx from the planes, in place
    fused = step()(*args)
    monkeypatch.setattr(gated_pipeline, "fused_mlp_plan", lambda *a, **k: None)
    assert h.custom_calls(step().lower(*args).as_text(), "jax_cake_dgrad_gated") == 0
    composed = step()(*args)
    np.testing.assert_array_equal(np.asarray(fused[0]), np.asarray(composed[0]))  # y: the same forward
    assert _within(fused[1], h.f64(composed[1]), h.BF16_TOL)  # dx
    for got, ref in zip(fused[2:], composed[2:]):  # dWg, dWu, dWd
        assert got.dtype == ref.dtype == jnp.float32
        assert _within(got, h.f64(ref), h.F32_TOL)
    hidden = jax.jit(jax_cake.gated_projection)(x, wg, wu)
    assert _within(fused[4], h.f64(dy).T @ h.f64(hidden), h.F32_TOL)


# --- dx from the cotangent's halves (jax_cake_dgrad_gate_up), each compiled variant forced ----

GATE_UP_VARIANTS = [v for v in jax_cake.planner.variants.VARIANTS if v.store == "gate_up_halves"]
# (T, d_in, F): whole tiles, several per CTA; ragged T, d_in and F (1040: the gate half's
# last K tile is a quarter full, so the up half starts on a fresh tile).
GATE_UP_SHAPES = [(4096, 2048, 2048), (1000, 520, 1040)]


@pytest.mark.parametrize("shape", GATE_UP_SHAPES, ids=lambda s: "T{}_{}x{}".format(*s))
@pytest.mark.parametrize("variant", GATE_UP_VARIANTS, ids=lambda v: v.name)
def test_gate_up_dgrad_kernel(variant, shape):
    """dx = dg Wg + du Wu within bf16 rounding of float64, Wg and Wu the gate and up rows
    the kernel reads in place from the interleaved weight; every element written
    (NaN-poisoned output); the planner's plan lowers to the call; bitwise repeatable."""
    t, d_in, f = shape
    key = ("gate_up_kernel", variant.name, *shape)
    dg = h.rand(h.seed_of("dg", *key), (1, t, f))
    du = h.rand(h.seed_of("du", *key), (1, t, f))
    w = h.rand(h.seed_of("w", *key), (1, 2 * f, d_in), scale=0.05)
    with force("det", tile=variant.tile, cluster=variant.cluster, schedule=variant.schedule):
        base = jax_cake.plan("dgrad", tokens=t, d_in=d_in, d_out=2 * f)
    plan = gated_planner.plan_gate_up_dgrad(base, contract.GATE_BLOCK)
    assert plan.op == "dgrad_gate_up", plan
    assert (plan.tile, plan.cluster, plan.schedule) == (variant.tile, variant.cluster, variant.schedule), plan
    text = jax.jit(lambda *a: gemm.dgrad_gate_up(*a, plan)).lower(dg, du, w).as_text()
    assert h.custom_calls(text, "jax_cake_dgrad_gate_up") == 1 and "dot_general" not in text
    attrs = h.ffi_attrs(variant.tile, cluster=variant.cluster, schedule=variant.schedule, raster=8)
    body = _ffi_body(contract.DGRAD_GATE_UP_TARGET, tuple(sorted((k, int(v)) for k, v in attrs.items())))
    run = lambda: h.run_poisoned(body, (1, t, d_in), jnp.bfloat16, dg, du, w)
    dx = h.assert_repeatable(run, what=variant.name)
    wg, wu = (h.f64(v[0]) for v in reference.deinterleave(w, 1, contract.GATE_BLOCK))
    assert np.all(np.isfinite(h.f64(dx[0]))), "unwritten (NaN) elements"
    assert _within(dx[0], h.f64(dg[0]) @ wg + h.f64(du[0]) @ wu, h.BF16_TOL)
