"""The dropless MoE MLP on the GPU: jc.moe_mlp and jc.grouped_gated_projection against
float64 at an MoE-like shape (empty experts, out-of-range ids, k = 2), bitwise repeat, and
that its grouped GEMMs (forward and backward) are the grouped kernels' calls, with no XLA
ragged dot left."""

import functools

import gpu_helpers as h
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import custom_call_lines

import jax_cake as jc
from jax_cake import contract
from jax_cake.planner import device as device_lib
from jax_cake.planner import grouped as grouped_planner
from jax_cake.planner import variants as variant_table
from jax_cake.primitives import grouped as grouped_primitives

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_library")]

BF16, F32 = jnp.bfloat16, jnp.float32
T, D, F, G, K = 1037, 512, 768, 16, 2  # T not a multiple of 128


def _act64(z, activation):
    if activation == "silu":
        return z / (1.0 + np.exp(-z))
    return 0.5 * z * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + 0.044715 * z**3)))


def _operands(w_dtype):
    x = h.rand(41, (T, D))
    wg = h.rand(42, (G, F, D), w_dtype, scale=D**-0.5)
    wu = h.rand(43, (G, F, D), w_dtype, scale=D**-0.5)
    wd = h.rand(44, (G, D, F), w_dtype, scale=F**-0.5)
    key_ids, key_w = jax.random.split(jax.random.key(45))
    ids = jax.random.randint(key_ids, (T, K), -1, G + 1, jnp.int32)  # out-of-range ids included
    ids = jnp.where(ids == 5, 6, ids)  # expert 5 gets nothing
    ew = jax.nn.softmax(jax.random.normal(key_w, (T, K), F32), axis=-1)
    return x, (wg, wu, wd), ids, ew, h.rand(46, (T, D))


@functools.partial(jax.jit, static_argnames=("activation",))
def _moe_vjp(x, wg, wu, wd, ids, ew, dy, activation="silu"):
    fn = lambda x, wg, wu, wd, ew: jc.moe_mlp(x, wg, wu, wd, ids, ew, activation=activation)
    y, pullback = jax.vjp(fn, x, wg, wu, wd, ew)
    return (y, *pullback(dy))


def _route(ids):
    flat = np.asarray(ids).reshape(-1)
    valid = (flat >= 0) & (flat < G)
    perm = np.argsort(np.where(valid, flat, G), kind="stable")
    return perm, [int((flat[valid] == e).sum()) for e in range(G)], valid


def _own_intermediates(x, ws, ids, ew, dy, activation):
    """The op's bf16 intermediates by the same grouped GEMMs (the public ops), sorted: h
    from the gated projection (its epilogue's rounding of the activation), the
    pre-activation's g and u from the plain grouped GEMM (the same bits)."""
    wg, wu, wd = ws
    perm, sizes, valid = _route(ids)
    gs = jnp.asarray(sizes, jnp.int32)
    xs = x[jnp.asarray(perm // K)]
    gu = jc.grouped_projection(xs, jc.pipeline.grouped.stack_gated(wg, wu, 1), gs)
    g, u = jc.reference.deinterleave(gu, -1, 1)
    hh = jax.jit(lambda xs, wg, wu: jc.grouped_gated_projection(xs, wg, wu, gs, activation=activation))(xs, wg, wu)
    out_sorted, pullback = jax.vjp(lambda v: jc.grouped_projection(v, wd, gs), hh)
    ew32 = jnp.where(jnp.asarray(valid.reshape(T, K)), ew.astype(F32), 0.0)
    dout = (ew32[:, :, None] * dy.astype(F32)[:, None, :]).astype(BF16).reshape(T * K, D)[jnp.asarray(perm)]
    (dh,) = pullback(dout)
    dg, du = jc.reference.gate_grad(dh, g, u, activation)
    outs = np.zeros((T * K, D))
    outs[perm] = h.f64(out_sorted)
    return perm, sizes, valid, h.f64(xs), h.f64(hh), outs.reshape(T, K, D), h.f64(dout), h.f64(dg), h.f64(du)


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("w_dtype", ["float32", "bfloat16"])
def test_moe_mlp_against_float64(w_dtype, activation):
    w_dtype = h.dtype_of(w_dtype)
    x, ws, ids, ew, dy = _operands(w_dtype)
    y, dx, dwg, dwu, dwd, dew = _moe_vjp(x, *ws, ids, ew, dy, activation=activation)
    assert (y.dtype, dx.dtype, dew.dtype) == (BF16, BF16, F32) and dwg.dtype == dwu.dtype == dwd.dtype == w_dtype
    perm, sizes, valid, xs, hh, outs, dout, dg, du = _own_intermediates(x, ws, ids, ew, dy, activation)
    wg64, wu64, wd64 = (h.f64(w.astype(BF16)) for w in ws)
    # y against the float64 layer
    y64 = np.zeros((T * K, D))
    start = 0
    for e, s in enumerate(sizes):
        rows = slice(start, start + s)
        z = xs[rows] @ wg64[e].T
        y64[rows] = (_act64(z, activation) * (xs[rows] @ wu64[e].T)) @ wd64[e].T
        start += s
    y_copies = np.zeros((T * K, D))
    y_copies[perm] = y64
    ew64 = np.where(valid.reshape(T, K), h.f64(ew), 0.0)
    h.assert_close(y, np.einsum("tk,tkd->td", ew64, y_copies.reshape(T, K, D)), h.BF16_TOL, "y")
    # d ew: FP32 from the op's own outputs
    h.assert_close(dew, np.where(valid.reshape(T, K), np.einsum("td,tkd->tk", h.f64(dy), outs), 0.0), h.F32_TOL, "dew")
    # weight gradients and dx from the op's own bf16 intermediates
    want = [np.zeros(dwg.shape), np.zeros(dwu.shape), np.zeros(dwd.shape)]
    dxs = np.zeros((T * K, D))
    start = 0
    for e, s in enumerate(sizes):
        rows = slice(start, start + s)
        want[0][e], want[1][e] = dg[rows].T @ xs[rows], du[rows].T @ xs[rows]
        want[2][e] = dout[rows].T @ hh[rows]
        dxs[rows] = dg[rows] @ wg64[e] + du[rows] @ wu64[e]
        start += s
    tol = h.F32_TOL if w_dtype == F32 else h.BF16_TOL
    for got, ref, what in zip((dwg, dwu, dwd), want, ("dw_gate", "dw_up", "dw_down")):
        h.assert_close(got, ref, tol, what)
        assert not np.asarray(got[5].astype(F32)).any(), f"{what} of the empty expert is not exactly 0"
    dx_copies = np.zeros((T * K, D))
    dx_copies[perm] = dxs
    h.assert_close(dx, dx_copies.reshape(T, K, D).sum(1), h.BF16_TOL, "dx")


def test_moe_mlp_runs_the_grouped_kernels():
    """Forward: gate/up (with the SwiGLU epilogue) and down (2); backward: the down's
    dgrad and wgrad, the gate/up dgrad, and at F = 768 (>= WIDE_D_OUT) one wgrad per
    weight (5). Each a grouped kernel on an sm_90a GPU."""
    x, ws, ids, ew, dy = _operands(F32)
    text = _moe_vjp.lower(x, *ws, ids, ew, dy).as_text()
    targets = (
        contract.GROUPED_FWD_GATED_TARGET,
        contract.GROUPED_FWD_TARGET,
        contract.GROUPED_DGRAD_TARGET,
        contract.GROUPED_WGRAD_TARGET,
    )
    assert [len(custom_call_lines(text, t)) for t in targets] == [1, 1, 2, 3]
    assert '"chlo.ragged_dot"(' not in text


def test_moe_mlp_bitwise_repeatable():
    x, ws, ids, ew, dy = _operands(F32)
    first = _moe_vjp(x, *ws, ids, ew, dy)
    for run in range(h.REPEATS - 1):
        again = _moe_vjp(x, *ws, ids, ew, dy)
        for i, (a, b) in enumerate(zip(first, again)):
            assert h.same_bits(a, b), f"result {i} of run {run + 1} differs from the first run"


def test_grouped_gated_projection_against_float64_and_repeatable():
    m = 2053
    sizes = [300, 0, 517, 128, 1, 0, 900, 57]  # 150 rows past the sum
    x, dh = h.rand(51, (m, D)), h.rand(52, (m, F))
    wg, wu = h.rand(53, (8, F, D), F32, scale=D**-0.5), h.rand(54, (8, F, D), F32, scale=D**-0.5)
    gs = jnp.asarray(sizes, jnp.int32)

    @jax.jit
    def run(x, wg, wu, dh):
        out, pullback = jax.vjp(lambda x, wg, wu: jc.grouped_gated_projection(x, wg, wu, gs), x, wg, wu)
        return (out, *pullback(dh))

    hh, dx, dwg, dwu = run(x, wg, wu, dh)
    live = sum(sizes)
    x64, wg64, wu64 = h.f64(x), h.f64(wg.astype(BF16)), h.f64(wu.astype(BF16))
    gu = jc.grouped_projection(x, jc.pipeline.grouped.stack_gated(wg, wu, 1), gs)
    dg, du = (h.f64(a) for a in jc.reference.gate_grad(dh, *jc.reference.deinterleave(gu, -1, 1), "silu"))
    h64, dx64 = np.zeros((m, F)), np.zeros((m, D))
    dwg64, dwu64 = np.zeros(dwg.shape), np.zeros(dwu.shape)
    start = 0
    for e, s in enumerate(sizes):  # float64 of the layer; the gradients of the op's own dg, du
        rows = slice(start, start + s)
        h64[rows] = _act64(x64[rows] @ wg64[e].T, "silu") * (x64[rows] @ wu64[e].T)
        dx64[rows] = dg[rows] @ wg64[e] + du[rows] @ wu64[e]
        dwg64[e], dwu64[e] = dg[rows].T @ x64[rows], du[rows].T @ x64[rows]
        start += s
    h.assert_close(hh[:live], h64[:live], h.BF16_TOL, "h")
    assert not np.asarray(hh[live:].astype(F32)).any() and not np.asarray(dx[live:].astype(F32)).any()
    h.assert_close(dx[:live], dx64[:live], h.BF16_TOL, "dx")
    h.assert_close(dwg, dwg64, h.F32_TOL, "dw_gate")
    h.assert_close(dwu, dwu64, h.F32_TOL, "dw_up")
    for i in range(4):
        h.assert_repeatable(lambda i=i: run(x, wg, wu, dh)[i], 5, f"result {i}")


# The grouped gated variants, each run by the test below (test_gpu_machinery's coverage check).
GROUPED_GATED_VARIANTS = [v for v in variant_table.VARIANTS if v.grouping and v.activation]


@pytest.mark.parametrize("variant", GROUPED_GATED_VARIANTS, ids=lambda v: v.name)
def test_the_gated_epilogue_gives_the_plain_forward_and_its_pass(variant):
    """The gated grouped kernel's gu is the plain grouped forward's, bit for bit, and its h
    is reference.gate of that gu up to the FP32 rounding of the activation (at most one
    bf16 step apart); the rows past the groups are 0."""
    m, groups = 2053, 8
    sizes = [300, 0, 517, 128, 1, 0, 900, 57]  # 150 rows past the sum
    gs = jnp.asarray(sizes, jnp.int32)
    x = h.rand(61, (m, D))
    wg, wu = h.rand(62, (groups, F, D), scale=D**-0.5), h.rand(63, (groups, F, D), scale=D**-0.5)
    w = jc.pipeline.grouped.stack_gated(wg, wu, contract.GATE_BLOCK)
    base = grouped_primitives.plan_for("grouped_fwd", x.shape, w.shape, groups, device_lib.current(x, w))
    activation = variant.activation
    plan = grouped_planner.plan_grouped_gated(base, activation, contract.GATE_BLOCK)
    assert plan.op == grouped_planner.GATED_OP, plan.reason
    assert (plan.tile, plan.cluster, plan.schedule) == (variant.tile, variant.cluster, variant.schedule), plan
    fused = jax.jit(lambda x, w: grouped_primitives.fwd_gated(x, w, gs, plan, activation, contract.GATE_BLOCK))
    text = fused.lower(x, w).as_text()
    assert len(custom_call_lines(text, contract.GROUPED_FWD_GATED_TARGET)) == 1
    assert not custom_call_lines(text, contract.GROUPED_FWD_TARGET)
    hh, gu = fused(x, w)
    plain_gu = jax.jit(lambda x, w: grouped_primitives.fwd(x, w, gs, base))(x, w)
    assert h.same_bits(gu, plain_gu), "the gated kernel's pre-activation differs from the plain grouped forward's"
    want = h.f64(jc.reference.gate(*jc.reference.deinterleave(plain_gu, -1, contract.GATE_BLOCK), activation))
    got, live = h.f64(hh), sum(sizes)
    assert not got[live:].any(), "rows past the groups are not 0"
    assert (np.abs(got - want) <= 2.0**-7 * np.abs(want)).all(), "h is more than one bf16 step from the pass's"
    assert np.mean(got == want) > 0.99
    h.assert_repeatable(lambda: fused(x, w)[0], 5, "h")
