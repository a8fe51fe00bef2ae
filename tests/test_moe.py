"""The dropless MoE expert MLP: jc.grouped_gated_projection and jc.moe_mlp (on the XLA path).

Values and gradients against float64 (y within bf16 rounding; FP32 weight gradients within
1e-5 of float64 weight gradients of the op's own bf16 intermediates; the routing weights'
gradient against float64), empty experts, one expert taking every copy, k = 1 and k > 1,
f32 and bf16 weights, out-of-range expert ids, validation, JAX_CAKE_DISABLE, jit / vmap /
sharding / expert parallelism under shard_map, determinism, grad of grad and remat."""

import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

import jax_cake as jc
from jax_cake import logs
from jax_cake.pipeline import moe as moe_pipeline
from jax_cake.pipeline.fused import WIDE_D_OUT
from helpers import (
    H200,
    assert_raises_naming,
    assert_same_values,
    cuda_text,
    f64,
    faked_device,
    grouped_gemms,
    rand,
    rel_err,
)
from second_order_cases import check, hvp

BF16, F32 = jnp.bfloat16, jnp.float32
T, D, F, G = 48, 32, 24, 6  # tokens, d_model, d_ff (not a multiple of 16), experts


def _weights(w_dtype=F32, g=G, f=F, d=D):
    return (
        rand(10, (g, f, d), F32) * d**-0.5,
        rand(11, (g, f, d), F32) * d**-0.5,
        rand(12, (g, d, f), F32) * f**-0.5,
    )


def _cast(ws, dtype):
    return tuple(w.astype(dtype) for w in ws)


def _routing(kind: str, k: int, t=T, g=G, seed=20):
    """(expert_ids int32 [t, k], expert_weights f32 [t, k]): random top-k-like routings."""
    key_ids, key_w = jax.random.split(jax.random.key(seed))
    if kind == "random":
        ids = jax.random.randint(key_ids, (t, k), 0, g, jnp.int32)
    elif kind == "empty_experts":  # experts 1 and 4 get nothing
        ids = jnp.asarray([0, 2, 3, 5], jnp.int32)[jax.random.randint(key_ids, (t, k), 0, 4)]
    elif kind == "one_expert":  # every copy to expert 3
        ids = jnp.full((t, k), 3, jnp.int32)
    elif kind == "out_of_range":  # some ids below 0 or at / past G
        ids = jax.random.randint(key_ids, (t, k), -2, g + 3, jnp.int32)
        ids = ids.at[0].set(jnp.asarray([2**31 - 1, -(2**31), 1, 0][:k], jnp.int32))
    else:
        raise ValueError(kind)
    weights = jax.nn.softmax(jax.random.normal(key_w, (t, k), F32), axis=-1)
    return ids, weights


def _x(t=T, d=D, seed=0):
    return rand(seed, (t, d), BF16)


def _dy(t=T, d=D, seed=30):
    return rand(seed, (t, d), BF16)


# --- float64 references --------------------------------------------------------------------


def _act64(z, activation):
    if activation == "silu":
        return z / (1.0 + np.exp(-z))
    return 0.5 * z * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + 0.044715 * z**3)))


def _route_np(ids, g):
    """(perm, sizes, valid [T k]) as the op routes: a stable sort of the copies by expert,
    out-of-range ids last."""
    flat = np.asarray(ids).reshape(-1).astype(np.int64)
    valid = (flat >= 0) & (flat < g)
    key = np.where(valid, flat, g)
    perm = np.argsort(key, kind="stable")
    return perm, [int((key == e).sum()) for e in range(g)], valid


def _mlp64(x, wg, wu, wd, ids, ew, activation="silu"):
    """float64 y [T, d] and the per-copy outputs [T, k, d] (the weights rounded to bf16)."""
    t, k = ids.shape
    x64 = f64(x)
    wg64, wu64, wd64 = (f64(jnp.asarray(w).astype(BF16)) for w in (wg, wu, wd))
    _, _, valid = _route_np(ids, wg64.shape[0])
    ids_np = np.asarray(ids).reshape(-1)
    outs = np.zeros((t * k, x64.shape[1]))
    for c in range(t * k):
        if valid[c]:
            e, v = int(ids_np[c]), x64[c // k]
            outs[c] = (_act64(wg64[e] @ v, activation) * (wu64[e] @ v)) @ wd64[e].T
    outs = outs.reshape(t, k, -1)
    ew64 = np.where(valid.reshape(t, k), f64(ew), 0.0)
    return np.einsum("tk,tkd->td", ew64, outs), outs


def _own_intermediates(x, wg, wu, wd, ids, ew, dy, activation="silu"):
    """The op's own bf16 intermediates, by the same grouped GEMMs (the public ops): the
    sorted copies xs, the pre-activation halves g, u, h, the outputs in copy order [T, k,
    d], the down projection's cotangent dout, dh and dg, du (all in sorted order)."""
    t, k = ids.shape
    g_count = wg.shape[0]
    perm, sizes, valid = _route_np(ids, g_count)
    gs = jnp.asarray(sizes, jnp.int32)
    xs = x[perm // k]
    gu = jc.grouped_projection(xs, jc.pipeline.grouped.stack_gated(wg, wu, 1), gs)
    g, u = jc.reference.deinterleave(gu, -1, 1)
    h = jc.reference.gate(g, u, activation)
    out_sorted, pullback = jax.vjp(lambda h: jc.grouped_projection(h, wd, gs), h)
    ew32 = jnp.where(jnp.asarray(valid.reshape(t, k)), ew.astype(F32), 0.0)
    dout = (ew32[:, :, None] * dy.astype(F32)[:, None, :]).astype(BF16).reshape(t * k, -1)[perm]
    (dh,) = pullback(dout)
    dg, du = jc.reference.gate_grad(dh, g, u, activation)
    outs = np.zeros((t * k, wd.shape[1]))
    outs[perm] = f64(out_sorted)
    return dict(
        perm=perm,
        sizes=sizes,
        valid=valid,
        xs=f64(xs),
        h=f64(h),
        outs=outs.reshape(t, k, -1),
        dout=f64(dout),
        dg=f64(dg),
        du=f64(du),
    )


def _wgrads64(inter, g_count):
    """float64 dW_gate, dW_up, dW_down of the op's own bf16 intermediates."""
    xs, h, dout, dg, du = (inter[n] for n in ("xs", "h", "dout", "dg", "du"))
    f, d = dg.shape[1], xs.shape[1]
    dwg, dwu, dwd = np.zeros((g_count, f, d)), np.zeros((g_count, f, d)), np.zeros((g_count, d, f))
    start = 0
    for e, s in enumerate(inter["sizes"]):
        rows = slice(start, start + s)
        dwg[e], dwu[e], dwd[e] = dg[rows].T @ xs[rows], du[rows].T @ xs[rows], dout[rows].T @ h[rows]
        start += s
    return dwg, dwu, dwd


def _dx64(inter, wg, wu, ids):
    """float64 dx of the op's own dg, du: each copy's dg Wg + du Wu, summed per token."""
    t, k = ids.shape
    wg64, wu64 = f64(jnp.asarray(wg).astype(BF16)), f64(jnp.asarray(wu).astype(BF16))
    ids_sorted = np.asarray(ids).reshape(-1)[inter["perm"]]
    dx = np.zeros((t, wg64.shape[2]))
    for i, c in enumerate(inter["perm"]):
        if inter["valid"][c]:
            e = int(ids_sorted[i])
            dx[c // k] += inter["dg"][i] @ wg64[e] + inter["du"][i] @ wu64[e]
    return dx


def _moe_vjp(x, wg, wu, wd, ids, ew, dy, laid_out=None, **kw):
    """moe_mlp's y and its gradients; laid_out (not None): the pipeline's, on the experts'
    rows in expert order (False) or in the grouped kernels' row layout (True)."""
    if laid_out is None:
        layer = lambda x, wg, wu, wd, ew: jc.moe_mlp(x, wg, wu, wd, ids, ew, **kw)
    else:
        kw = dict(activation="silu", deterministic=True) | kw
        layer = lambda x, wg, wu, wd, ew: moe_pipeline.moe_mlp(x, wg, wu, wd, ids, ew, laid_out=laid_out, **kw)
    y, pullback = jax.vjp(layer, x, wg, wu, wd, ew)
    return (y, *pullback(dy))


_moe_vjp_jit = jax.jit(_moe_vjp, static_argnames=("laid_out", "activation", "deterministic"))


# --- moe_mlp against float64 ---------------------------------------------------------------

CASES = [("random", 2), ("empty_experts", 2), ("one_expert", 2), ("random", 1), ("out_of_range", 3)]


@pytest.mark.parametrize("laid_out", [None, True])
@pytest.mark.parametrize("w_dtype", [F32, BF16])
@pytest.mark.parametrize("kind,k", CASES)
def test_moe_mlp_against_float64(kind, k, w_dtype, laid_out):
    """The public op (on CPU: its experts' rows in expert order) and the pipeline on the
    grouped kernels' row layout (what the kernel path runs; here XLA's ragged dot over the
    padded groups) against float64."""
    x, dy = _x(), _dy()
    wg, wu, wd = _cast(_weights(), w_dtype)
    ids, ew = _routing(kind, k)
    y, dx, dwg, dwu, dwd, dew = _moe_vjp_jit(x, wg, wu, wd, ids, ew, dy, laid_out=laid_out)
    assert (y.dtype, dx.dtype, dew.dtype) == (BF16, BF16, F32)
    assert dwg.dtype == dwu.dtype == dwd.dtype == w_dtype

    y64, outs64 = _mlp64(x, wg, wu, wd, ids, ew)
    assert rel_err(y, y64) < 1e-2  # bf16 g, u, h and outputs, then y rounded once
    inter = _own_intermediates(x, wg, wu, wd, ids, ew, dy)
    valid = inter["valid"].reshape(T, k)
    # y: the op's own outputs weighted and summed in FP32, rounded once (one bf16 step)
    y_own = np.einsum("tk,tkd->td", np.where(valid, f64(ew), 0.0), inter["outs"])
    assert np.all(np.abs(f64(y) - y_own) <= np.abs(y_own) * 2.0**-8 + 1e-30)
    # d ew[t, j] = <dy[t], MLP_j(x[t])>: FP32 from the op's outputs; float64 of the layer
    dew_own = np.where(valid, np.einsum("td,tkd->tk", f64(dy), inter["outs"]), 0.0)
    assert rel_err(dew, dew_own) < 1e-5
    assert rel_err(dew, np.where(valid, np.einsum("td,tkd->tk", f64(dy), outs64), 0.0)) < 2e-2
    assert not np.asarray(dew)[~valid].any()  # out-of-range copies: 0
    # weight gradients: float64 wgrads of the op's own bf16 intermediates
    tol = 1e-5 if w_dtype == F32 else 4e-3
    for got, want in zip((dwg, dwu, dwd), _wgrads64(inter, G)):
        assert rel_err(got, want) < tol
    for e, s in enumerate(inter["sizes"]):
        if s == 0:  # an empty expert's gradients are exactly 0
            assert not any(np.asarray(a[e]).any() for a in (dwg, dwu, dwd)), e
    assert rel_err(dx, _dx64(inter, wg, wu, ids)) < 8e-3  # bf16 per copy, FP32 sum, rounded once


def test_moe_mlp_gelu_and_bf16_routing_weights():
    x, dy = _x(), _dy()
    wg, wu, wd = _weights()
    ids, ew = _routing("random", 2)
    ew = ew.astype(BF16)
    y, dx, dwg, dwu, dwd, dew = _moe_vjp_jit(x, wg, wu, wd, ids, ew, dy, activation="gelu")
    assert dew.dtype == BF16
    y64, outs64 = _mlp64(x, wg, wu, wd, ids, ew, "gelu")
    assert rel_err(y, y64) < 1e-2
    inter = _own_intermediates(x, wg, wu, wd, ids, ew, dy, "gelu")
    assert rel_err(dew, np.einsum("td,tkd->tk", f64(dy), inter["outs"])) < 4e-3  # FP32 rounded once to bf16
    for got, want in zip((dwg, dwu, dwd), _wgrads64(inter, G)):
        assert rel_err(got, want) < 1e-5


def test_fp32_master_gradients_are_not_rounded_to_bf16():
    ids, ew = _routing("random", 2)
    grads = _moe_vjp_jit(_x(), *_weights(), ids, ew, _dy())[2:5]
    for dw in grads:
        assert dw.dtype == F32 and not np.array_equal(np.asarray(dw), np.asarray(dw.astype(BF16).astype(F32)))


# --- out-of-range expert ids ------------------------------------------------------------------


def test_out_of_range_copies_contribute_nothing():
    """Copies routed outside [0, G) (any integer dtype, any value, any routing weight, NaN
    included) give the results of the call without them, and a zero weight gradient."""
    x, dy = _x(), _dy()
    ws = _weights()
    ids, ew = _routing("random", 1)
    want = _moe_vjp_jit(x, *ws, ids, ew, dy)
    bad = jnp.asarray(np.resize([-1, G, G + 7, 2**31 - 1, -(2**31)], (T, 1)), jnp.int32)
    got = _moe_vjp_jit(x, *ws, jnp.concatenate([ids, bad], 1), jnp.concatenate([ew, jnp.full((T, 1), jnp.nan)], 1), dy)
    for a, b in zip(got[:5], want[:5]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # d ew: the same FP32 dot over d, reduced by XLA in another shape's order
    np.testing.assert_allclose(np.asarray(got[5][:, 0]), np.asarray(want[5][:, 0]), rtol=1e-5, atol=1e-6)
    assert not np.asarray(got[5][:, 1]).any()
    # narrow and unsigned id dtypes, compared in their own dtype (255 is out of range, never wrapped)
    for dtype, bad_id in ((jnp.uint8, 255), (jnp.int8, -128), (jnp.int16, 300), (jnp.uint32, 2**32 - 1)):
        both = jnp.concatenate([ids.astype(dtype), jnp.full((T, 1), bad_id, dtype)], 1)
        y = jc.moe_mlp(x, *ws, both, jnp.concatenate([ew, jnp.ones((T, 1), F32)], 1))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(want[0]), err_msg=str(dtype))


def test_every_copy_out_of_range_gives_zeros():
    x, ws = _x(), _weights()
    ids = jnp.full((T, 2), -3, jnp.int32)
    y, dx, dwg, dwu, dwd, dew = _moe_vjp_jit(x, *ws, ids, jnp.ones((T, 2), F32), _dy())
    for a in (y, dx, dwg, dwu, dwd, dew):
        assert not np.asarray(a).any()


# --- grouped_gated_projection ------------------------------------------------------------------

GATED_SIZES = [10, 0, 25, 1, 0, 40]  # empty groups, 20 rows past the sum (M = 96)


def _gated_vjp(x, wg, wu, gs, dh, **kw):
    h, pullback = jax.vjp(lambda x, wg, wu: jc.grouped_gated_projection(x, wg, wu, gs, **kw), x, wg, wu)
    return (h, *pullback(dh))


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("w_dtypes", [(F32, F32), (BF16, BF16), (F32, BF16)])
@pytest.mark.parametrize("f", [F, WIDE_D_OUT], ids=["narrow", "wide"])  # one wgrad over 2F, or one per weight
def test_grouped_gated_projection_against_float64(activation, w_dtypes, f):
    m = 96
    x, dh = rand(0, (m, D), BF16), rand(1, (m, f), BF16)
    wg, wu = _weights(f=f)[0].astype(w_dtypes[0]), _weights(f=f)[1].astype(w_dtypes[1])
    x = x.at[76:].set(jnp.nan)  # rows past the groups never reach a result
    gs = jnp.asarray(GATED_SIZES, jnp.int32)
    h, dx, dwg, dwu = jax.jit(functools.partial(_gated_vjp, activation=activation))(x, wg, wu, gs, dh)
    assert (h.dtype, dx.dtype, dwg.dtype, dwu.dtype) == (BF16, BF16) + w_dtypes
    assert not np.asarray(h[76:]).any() and not np.asarray(dx[76:]).any()
    # float64 of the layer; and the weight gradients from the op's own bf16 dg, du
    x64 = f64(x[:76])
    wg64, wu64 = f64(wg.astype(BF16)), f64(wu.astype(BF16))
    group = np.repeat(np.arange(G), GATED_SIZES)
    zg, zu = np.einsum("md,mfd->mf", x64, wg64[group]), np.einsum("md,mfd->mf", x64, wu64[group])
    assert rel_err(h[:76], _act64(zg, activation) * zu) < 1e-2
    gu = jc.grouped_projection(x, jc.pipeline.grouped.stack_gated(wg, wu, 1), gs)
    dg, du = (f64(a)[:76] for a in jc.reference.gate_grad(dh, *jc.reference.deinterleave(gu, -1, 1), activation))
    dx64 = np.einsum("mf,mfd->md", dg, wg64[group]) + np.einsum("mf,mfd->md", du, wu64[group])
    assert rel_err(dx[:76], dx64) < 4e-3
    for got, d, dtype in ((dwg, dg, w_dtypes[0]), (dwu, du, w_dtypes[1])):
        want = np.zeros(got.shape)
        np.add.at(want, group, np.einsum("mf,md->mfd", d, x64))
        assert rel_err(got, want) < (1e-5 if dtype == F32 else 4e-3)
        for e in (1, 4):  # empty groups: exactly 0
            assert not np.asarray(got[e]).any()


def test_interleave_block_does_not_change_the_values():
    """The gated kernel's block of 16 (one device, or inside shard_map) and the row-by-row
    interleave give the same bits."""
    m, f = 96, 32
    x, dh = rand(0, (m, D), BF16), rand(1, (m, f), BF16)
    wg, wu, _ = _weights(f=f)
    gs = jnp.asarray(GATED_SIZES, jnp.int32)

    def run(block):
        fn = lambda x, wg, wu: jc.pipeline.grouped.project_grouped_gated(
            x, wg, wu, gs, activation="silu", deterministic=True, block=block
        )
        h, pullback = jax.vjp(fn, x, wg, wu)
        return (h, *pullback(dh))

    for a, b in zip(jax.jit(functools.partial(run, 16))(), jax.jit(functools.partial(run, 1))()):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --- validation ------------------------------------------------------------------------------


def _moe_kwargs():
    return dict(
        x=jnp.ones((8, 16), BF16),
        w_gate=jnp.ones((3, 4, 16), F32),
        w_up=jnp.ones((3, 4, 16), F32),
        w_down=jnp.ones((3, 16, 4), F32),
        expert_ids=jnp.zeros((8, 2), jnp.int32),
        expert_weights=jnp.ones((8, 2), F32),
    )


@pytest.mark.parametrize(
    "args,error,words",
    [
        (dict(x=jnp.ones((8, 16), F32)), TypeError, ["x must be bfloat16", "float32"]),
        (dict(x=jnp.ones((2, 8, 16), BF16)), ValueError, ["x must have rank 2", "[T, d]"]),
        (dict(x="x"), TypeError, ["x must be an array"]),
        (dict(w_gate=jnp.ones((3, 4, 16), jnp.float16)), TypeError, ["w_gate must be bfloat16 or float32"]),
        (dict(w_up=jnp.ones((4, 16), F32)), ValueError, ["w_up must have rank 3", "[G, d_ff, d_in]"]),
        (dict(w_gate=jnp.ones((3, 4, 8), F32)), ValueError, ["w_gate.shape[2] (d_in=8)", "(d_in=16)"]),
        (dict(w_up=jnp.ones((3, 5, 16), F32)), ValueError, ["w_gate and w_up must have the same shape"]),
        (dict(w_gate=jnp.ones((0, 4, 16)), w_up=jnp.ones((0, 4, 16))), ValueError, ["at least one expert"]),
        (dict(w_down=jnp.ones((3, 16, 4), jnp.int32)), TypeError, ["w_down must be bfloat16 or float32"]),
        (dict(w_down=jnp.ones((16, 4), F32)), ValueError, ["w_down must have rank 3", "[G, d, d_ff]"]),
        (dict(w_down=jnp.ones((2, 16, 4), F32)), ValueError, ["w_down must have shape [G, d, d_ff] = (3, 16, 4)"]),
        (dict(w_down=jnp.ones((3, 4, 16), F32)), ValueError, ["w_down must have shape", "got (3, 4, 16)"]),
        (dict(expert_ids=jnp.zeros((8, 2), F32)), TypeError, ["expert_ids must have an integer dtype", "float32"]),
        (dict(expert_ids=jnp.zeros((8, 2), bool)), TypeError, ["expert_ids must have an integer dtype", "bool"]),
        (dict(expert_ids=jnp.zeros((8,), jnp.int32)), ValueError, ["expert_ids must have rank 2", "[T, k]"]),
        (dict(expert_ids=jnp.zeros((7, 2), jnp.int32)), ValueError, ["one row per token", "T=8", "(7, 2)"]),
        (dict(expert_ids=jnp.zeros((8, 0), jnp.int32), expert_weights=jnp.ones((8, 0))), ValueError, ["k >= 1"]),
        (dict(expert_ids=[[0]]), TypeError, ["expert_ids must be an array"]),
        (dict(expert_weights=jnp.ones((8, 2), jnp.float16)), TypeError, ["expert_weights must be float32 or bfloat16"]),
        (dict(expert_weights=jnp.ones((8, 3), F32)), ValueError, ["expert_weights must have expert_ids' shape (8, 2)"]),
        (dict(activation="relu"), ValueError, ["activation must be 'silu' or 'gelu'", "'relu'"]),
        (dict(deterministic=None), TypeError, ["deterministic must be a Python bool"]),
    ],
)
def test_moe_mlp_validation_names_the_argument(args, error, words):
    kw = _moe_kwargs()
    kw.update(args)
    call = lambda: jc.moe_mlp(**kw)
    assert_raises_naming(error, "moe_mlp: ", words, call)
    assert_raises_naming(error, "moe_mlp: ", words, lambda: jax.jit(lambda: call())())  # at trace time


@pytest.mark.parametrize(
    "args,error,words",
    [
        (dict(x=jnp.ones((8, 16), F32)), TypeError, ["x must be bfloat16"]),
        (dict(x=jnp.ones((1, 8, 16), BF16)), ValueError, ["x must have rank 2", "[M, d_in]"]),
        (dict(w_gate=jnp.ones((3, 4, 12), F32)), ValueError, ["w_gate.shape[2] (d_in=12)"]),
        (dict(w_up=jnp.ones((2, 4, 16), F32)), ValueError, ["w_gate and w_up must have the same shape"]),
        (dict(gs=jnp.ones((3,), jnp.int64 if jax.config.x64_enabled else jnp.int16)), TypeError, ["int32"]),
        (dict(gs=jnp.ones((4,), jnp.int32)), ValueError, ["one size per group", "G=3", "(4,)"]),
        (dict(gs=jnp.ones((3, 1), jnp.int32)), ValueError, ["group_sizes must have rank 1"]),
        (dict(activation=None), ValueError, ["activation must be"]),
        (dict(deterministic="yes"), TypeError, ["deterministic must be a Python bool"]),
    ],
)
def test_grouped_gated_validation_names_the_argument(args, error, words):
    kw = dict(x=jnp.ones((8, 16), BF16), w_gate=jnp.ones((3, 4, 16), F32), w_up=jnp.ones((3, 4, 16), BF16))
    kw.update(gs=jnp.ones((3,), jnp.int32), activation="silu", deterministic=True)
    kw.update(args)
    call = lambda: jc.grouped_gated_projection(
        kw["x"], kw["w_gate"], kw["w_up"], kw["gs"], activation=kw["activation"], deterministic=kw["deterministic"]
    )
    assert_raises_naming(error, "grouped_gated_projection: ", words, call)


# --- determinism, JAX_CAKE_DISABLE, jit / vmap ----------------------------------------------------


def test_bitwise_repeatable_and_eager_equals_jit():
    x, dy, ws = _x(), _dy(), _weights()
    ids, ew = _routing("empty_experts", 2)
    first = _moe_vjp_jit(x, *ws, ids, ew, dy)
    args = (x, *ws, ids, ew, dy)
    for again in (_moe_vjp_jit(*args), jax.jit(_moe_vjp)(*args), _moe_vjp(*args)):
        for a, b in zip(first, again):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_disable_env_gives_the_same_values(monkeypatch):
    x, dy, ws = _x(), _dy(), _weights()
    ids, ew = _routing("random", 2)
    want = _moe_vjp_jit(x, *ws, ids, ew, dy)
    monkeypatch.setenv("JAX_CAKE_DISABLE", "1")
    got = jax.jit(lambda *a: _moe_vjp(*a))(x, *ws, ids, ew, dy)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_routing_changes_without_recompiling():
    x, dy, ws = _x(), _dy(), _weights()
    traces = []
    step = jax.jit(lambda *a: (traces.append(1), _moe_vjp(*a))[1])
    for kind in ("random", "one_expert", "out_of_range"):
        ids, ew = _routing(kind, 2)
        y = step(x, *ws, ids, ew, dy)[0]
        assert rel_err(y, _mlp64(x, *ws, ids, ew)[0]) < 1e-2
    assert len(traces) == 1


def test_vmap_gives_the_per_call_results():
    xs, dys = jnp.stack([_x(seed=0), _x(seed=1)]), jnp.stack([_dy(seed=30), _dy(seed=31)])
    routings = [_routing("random", 2, seed=20), _routing("empty_experts", 2, seed=21)]
    ids, ews = jnp.stack([r[0] for r in routings]), jnp.stack([r[1] for r in routings])
    ws = _weights()
    mapped = jax.jit(jax.vmap(_moe_vjp, in_axes=(0, None, None, None, 0, 0, 0)))(xs, *ws, ids, ews, dys)
    for i in range(2):
        want = _moe_vjp_jit(xs[i], *ws, ids[i], ews[i], dys[i])
        for j in range(6):  # y, dx, each mapped call's own weight gradients, d ew
            assert_same_values(mapped[j][i], want[j])


# --- sharding --------------------------------------------------------------------------------


def _mesh(axis="data"):
    return jax.make_mesh((8,), (axis,), axis_types=(AxisType.Auto,))


def test_jit_with_tokens_sharded_equals_the_unsharded_call():
    """Tokens (x, ids, weights, dy) data-parallel over 8 devices, weights replicated."""
    x, dy, ws = _x(), _dy(), _weights()
    ids, ew = _routing("empty_experts", 2)
    want = _moe_vjp_jit(x, *ws, ids, ew, dy)
    mesh = _mesh()
    rows, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    put = lambda a, s: jax.device_put(a, s)
    got = _moe_vjp_jit(put(x, rows), *(put(w, whole) for w in ws), put(ids, rows), put(ew, rows), put(dy, rows))
    for a, b in zip((got[0], got[1], got[5]), (want[0], want[1], want[5])):  # per-token results: bitwise
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(got[2:5], want[2:5]):  # FP32 weight gradients: FP32 reassociation at most
        np.testing.assert_allclose(f64(a), f64(b), rtol=1e-6, atol=1e-6 * float(np.max(np.abs(f64(b)))))


def test_expert_parallel_under_shard_map():
    """Each of 8 devices holds G / 8 experts and runs moe_mlp on every token with the ids
    shifted to its experts (the others are out of range: they contribute 0); the psum of
    the partial outputs is the layer. dW per device: its experts' gradients, the unsharded
    call's (up to XLA's FP32 summation order on CPU); d ew: exact (zeros added); y and dx:
    one bf16 rounding per partial."""
    g = 16
    x, dy = _x(), _dy()
    ws = _weights(g=g, f=32)  # d_ff a multiple of 16: the gated kernel's interleave inside shard_map
    ids, ew = _routing("random", 2, g=g)
    want = _moe_vjp_jit(x, *ws, ids, ew, dy)
    mesh = _mesh("expert")

    def local(x, wg, wu, wd, ids, ew):
        first = jax.lax.axis_index("expert") * wg.shape[0]
        y = jc.moe_mlp(x, wg, wu, wd, ids - first, ew).astype(F32)
        return jax.lax.psum(y, "expert").astype(BF16)

    layer = jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P("expert"), P("expert"), P("expert"), P(), P()), out_specs=P()
    )
    got = jax.jit(_moe_vjp_via(layer))(x, *ws, ids, ew, dy)
    tol = 2.0**-7
    for a, b in zip((got[0], got[1]), (want[0], want[1])):
        np.testing.assert_allclose(f64(a), f64(b), rtol=tol, atol=tol * float(np.max(np.abs(f64(b)))))
    for a, b in zip(got[2:], want[2:]):
        assert_same_values(a, b)


def _moe_vjp_via(layer):
    def run(x, wg, wu, wd, ids, ew, dy):
        y, pullback = jax.vjp(lambda x, wg, wu, wd, ew: layer(x, wg, wu, wd, ids, ew), x, wg, wu, wd, ew)
        return (y, *pullback(dy))

    return run


# --- grad of grad, remat, lowering --------------------------------------------------------------


def _plain_moe(ids, activation="silu"):
    """The same layer in plain JAX: every copy's expert weights gathered, the same roundings."""
    act = jax.nn.silu if activation == "silu" else functools.partial(jax.nn.gelu, approximate=True)

    def plain(x, wg, wu, wd, ew):
        dot = lambda spec, a, b: jnp.einsum(spec, a, b.astype(BF16), preferred_element_type=F32).astype(BF16)
        g, u = dot("td,tkfd->tkf", x, wg[ids]), dot("td,tkfd->tkf", x, wu[ids])
        h = (act(g.astype(F32)) * u.astype(F32)).astype(BF16)
        out = dot("tkf,tkdf->tkd", h, wd[ids])
        return jnp.einsum("tk,tkd->td", ew.astype(F32), out.astype(F32)).astype(BF16)

    return plain


def test_grad_of_grad():
    ids, ew = _routing("empty_experts", 2)
    operands = (_x(), *_weights(), ew)
    fn = lambda x, wg, wu, wd, ew: jc.moe_mlp(x, wg, wu, wd, ids, ew)
    check(fn, _plain_moe(ids), operands, lambda f, ops, dirs: jax.jit(functools.partial(hvp, f))(ops, dirs))


@pytest.mark.parametrize("f", [F, WIDE_D_OUT], ids=["narrow", "wide"])
def test_grouped_gated_grad_of_grad(f):
    gs = jnp.asarray(GATED_SIZES, jnp.int32)
    group = np.repeat(np.arange(G), GATED_SIZES)

    def plain(x, wg, wu):
        dot = lambda a, b: jnp.einsum("md,mfd->mf", a, b.astype(BF16), preferred_element_type=F32).astype(BF16)
        g, u = dot(x[:76], wg[group]), dot(x[:76], wu[group])
        h = (jax.nn.silu(g.astype(F32)) * u.astype(F32)).astype(BF16)
        return jnp.concatenate([h, jnp.zeros((20, h.shape[1]), BF16)])

    operands = (rand(0, (96, D), BF16), *_weights(f=f)[:2])
    fn = lambda x, wg, wu: jc.grouped_gated_projection(x, wg, wu, gs)
    check(fn, plain, operands, lambda f, ops, dirs: jax.jit(functools.partial(hvp, f))(ops, dirs))


@pytest.mark.parametrize(
    "policy,gemms",
    [(None, 8), (jc.remat.save_projections, 6), (jc.remat.save_gated_preactivation, 7)],
)
def test_remat_policies_save_by_name(policy, gemms):
    """2 forward GEMMs, 2 dgrads, 2 wgrads; a checkpoint without a policy runs both
    forwards again (the routing weights' gradient needs the outputs), save_projections
    none, save_gated_preactivation the down projection (from h, saved where the gated
    kernel wrote it, else recomputed elementwise from the saved pre-activation)."""
    x, ws = _x(), _weights()
    ids, ew = _routing("random", 2)
    block = jax.checkpoint(lambda x, wg, wu, wd, ew: jc.moe_mlp(x, wg, wu, wd, ids, ew), policy=policy)
    grad = jax.grad(lambda *a: jnp.sum(block(*a).astype(F32) ** 2), argnums=(0, 1, 2, 3, 4))
    assert grouped_gemms(cuda_text(grad, x, *ws, ew)) == gemms


def test_cuda_lowering_runs_the_grouped_gemms_on_the_xla_path():
    x, ws = _x(), _weights()
    ids, ew = _routing("random", 2)
    loss = lambda x, *ws: jnp.sum(jc.moe_mlp(x, *ws[:3], ids, ws[3]).astype(F32) ** 2)
    with jc.planner.force("xla"):
        text = cuda_text(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), x, *ws, ew)
    assert grouped_gemms(text) == 6 and "custom_call @jax_cake" not in text


@pytest.mark.parametrize("kind,k", CASES)
def test_the_row_layout_gives_the_expert_order_values(kind, k):
    """The experts on the grouped kernels' row layout (the kernel path's) and in expert order
    give the same values (each row's products and sums are the same; the FP32 weight
    gradients within XLA's CPU summation order, assert_same_values)."""
    x, dy, ws = _x(), _dy(), _weights()
    ids, ew = _routing(kind, k)
    ordered = _moe_vjp_jit(x, *ws, ids, ew, dy, laid_out=False)
    laid = _moe_vjp_jit(x, *ws, ids, ew, dy, laid_out=True)
    for a, b in zip(ordered, laid):
        assert_same_values(b, a)


def test_the_kernel_path_gathers_rows_only_at_the_dispatch_and_the_combine():
    """Lowered for the faked H200 (grouped kernels planned), the layer's rows are gathered at
    the dispatch and back for the combine (and the transposes of both in the backward), not
    around each grouped GEMM as in expert order."""
    x, ws = _x(), _weights()
    ids, ew = _routing("random", 2)

    def bf16_row_gathers(laid_out):
        loss = lambda x, wg, wu, wd, ew: jnp.sum(
            moe_pipeline.moe_mlp(
                x, wg, wu, wd, ids, ew, activation="silu", deterministic=True, laid_out=laid_out
            ).astype(F32)
            ** 2
        )
        text = cuda_text(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), x, *ws, ew)
        assert grouped_gemms(text) == 6
        lines = [line for line in text.splitlines() if "stablehlo.gather" in line]
        return sum(bool(re.search(r"-> tensor<\d+x\d+xbf16>", line)) for line in lines)

    assert bf16_row_gathers(None) == bf16_row_gathers(True) <= 4 < bf16_row_gathers(False)


def test_the_row_layout_is_chosen_only_where_the_kernels_run():
    """laid_out=None lays the rows out where the grouped kernels run: planned for the device
    (the faked H200, not the CPU) on operands that need no partitioning (a one-device mesh,
    not an eight-device one under plain jit, where the GEMMs run XLA's ragged dot)."""
    x, (wg, _, _) = _x(), _weights()
    assert not moe_pipeline.uses_kernels(x, wg, 2)
    with faked_device():
        assert moe_pipeline.uses_kernels(x, wg, 2)
    with jax.sharding.use_abstract_mesh(AbstractMesh((8,), ("data",), abstract_device=H200)):
        assert not moe_pipeline.uses_kernels(x, wg, 2)


def test_exported_from_the_package():
    assert jc.moe_mlp is jc.api.moe_mlp and jc.grouped_gated_projection is jc.api.grouped_gated_projection
    assert {"moe_mlp", "grouped_gated_projection"} <= set(jc.__all__)


# --- sharding of the gated grouped projection; Explicit axes ------------------------------------


@pytest.mark.parametrize(
    "x_spec,w_spec",
    [
        (P("data"), P()),  # tokens data-parallel, weights replicated
        (P(), P(None, "data")),  # w_gate, w_up column-parallel on d_ff (the interleave row by row)
        (P(None, "data"), P(None, None, "data")),  # x and the weights sharded on d_in
        (P(), (P(None, "data"), P())),  # w_gate column-parallel, w_up replicated
    ],
)
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("f", [32, WIDE_D_OUT], ids=["narrow", "wide"])  # one wgrad over 2F, or one per weight
def test_grouped_gated_with_sharded_inputs_equals_the_unsharded_call(x_spec, w_spec, axis_type, f):
    x, (wg, wu, _) = rand(0, (96, D), BF16), _weights(f=f)
    gs = jnp.asarray(GATED_SIZES, jnp.int32)

    def step(x, wg, wu):
        loss = lambda x, wg, wu: jnp.sum(jnp.sin(jc.grouped_gated_projection(x, wg, wu, gs).astype(F32)))
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, wg, wu)

    want = jax.jit(step)(x, wg, wu)
    mesh = _mesh()
    wg_spec, wu_spec = (w_spec, w_spec) if isinstance(w_spec, P) else w_spec
    if axis_type == AxisType.Auto:
        put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
        got = jax.jit(step)(put(x, x_spec), put(wg, wg_spec), put(wu, wu_spec))
    else:
        with jax.set_mesh(jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))):
            operands = (jax.device_put(x, x_spec), jax.device_put(wg, wg_spec), jax.device_put(wu, wu_spec))
            got = jax.jit(step)(*operands)
            for grad, operand in zip(got[1], operands):  # each gradient in its primal's sharding
                assert jax.typeof(grad).sharding.spec == jax.typeof(operand).sharding.spec
    assert abs(float(got[0]) - float(want[0])) <= 1e-5 * abs(float(want[0]))
    for a, b in zip(got[1], want[1]):
        tol = 1e-5 if a.dtype == F32 else 2.0**-7
        np.testing.assert_allclose(f64(a), f64(b), rtol=tol, atol=tol * float(np.max(np.abs(f64(b)))))


@pytest.mark.parametrize("w_spec", [P(), P(None, "data")])
def test_moe_mlp_under_explicit_axes(w_spec, caplog):
    """Tokens sharded on an Explicit mesh: the routing gathers them (a global sort, said in a
    log line), y and every gradient come back in their primal's sharding, with the
    unsharded call's values."""
    logs.forget()
    x, ws = _x(), _weights(f=32)
    ids, ew = _routing("random", 2)

    def step(x, wg, wu, wd, ew):
        loss = lambda *a: jnp.sum(jnp.sin(jc.moe_mlp(*a[:4], ids, a[4]).astype(F32)))
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(x, wg, wu, wd, ew)

    want = jax.jit(step)(x, *ws, ew)
    with jax.set_mesh(jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))):
        d_spec = P(None, None, "data") if w_spec != P() else P()  # w_down's d_ff
        operands = (
            jax.device_put(x, P("data")),
            jax.device_put(ws[0], w_spec),
            jax.device_put(ws[1], w_spec),
            jax.device_put(ws[2], d_spec),
            jax.device_put(ew, P("data")),
        )
        with caplog.at_level(logging.INFO, logger="jax_cake"):
            got = jax.jit(step)(*operands)
        for grad, operand in zip(got[1], operands):
            assert jax.typeof(grad).sharding.spec == jax.typeof(operand).sharding.spec
    assert any("moe_mlp under Explicit axes gathers its tokens" in r.getMessage() for r in caplog.records)
    assert abs(float(got[0]) - float(want[0])) <= 1e-5 * abs(float(want[0]))
    for a, b in zip(got[1], want[1]):
        tol = 1e-5 if a.dtype == F32 else 2.0**-7
        np.testing.assert_allclose(f64(a), f64(b), rtol=tol, atol=tol * float(np.max(np.abs(f64(b)))))
