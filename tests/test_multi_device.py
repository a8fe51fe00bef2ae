"""Whole training steps on several devices: a projection stack and a Llama-shaped block (GQA
q/k/v and SwiGLU gate/up through fused_projections, an elementwise stand-in for attention)
in three modes (shard_map; jit on Auto axes; Explicit axes) x three shardings (dp: tokens on
the axis; tp: column- then row-parallel projections; fsdp: tokens and the weights' d_out on
the axis, weights gathered). Each jax_cake step's gradients are checked against the same
step on one device, and its compiled collectives for an all-gather of an activation (the
8 fake CPU devices of conftest.py here; every GPU of the host under `pytest -m gpu`'s
machine, where the tests are not marked and run as they are).

Where the sharded forward computes bitwise the one-device activations (the stack under dp
and fsdp), bf16 dx must be within 1e-2 and every FP32 dw within 1e-5 of one device.
Elsewhere an activation is re-rounded to bf16 after a sum in another order (tp's
row-parallel reduction; the block's norms), one bf16 ulp moves every later layer, and
neither jax_cake nor XLA's own sharded step stays within 1e-5 of one device: there no
gradient's error against a float32 truth (the model in float32 on one device) may exceed
1.5 x the one-device bf16 step's own error.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cake

from helpers import rel_err

BF16, F32 = jnp.bfloat16, jnp.float32
AXIS = "d"
DX_TOL, DW_TOL = 1e-2, 1e-5
ACC_FACTOR = 1.5
# Token counts (40 per device, 40 x n in all) differ from every weight width, so an
# all-gather of an activation is told from one of a weight by its token dimension.
TOKENS_PER_DEVICE, D_MODEL, LAYERS, D_Q, D_KV, D_FF = 40, 64, 2, 64, 16, 96


@dataclasses.dataclass(frozen=True)
class Ops:
    """How one step runs the model's pieces in one mode and sharding."""

    proj: Callable  # (x, w, kind) -> y; kind "col", "row" (tp) or "full"
    fused: Callable  # (x, ws) -> tuple of y_i
    gather: Callable = lambda w: w  # a weight before use (FSDP under shard_map: all_gather)
    reduce: Callable = lambda y: y  # after a row-parallel projection (tp under shard_map: psum)
    act: Any = BF16  # the activations' dtype (float32 only in the float32 truth)


def truth_ops() -> Ops:
    hi = jax.lax.Precision.HIGHEST
    proj = lambda x, w, kind: jnp.dot(x.astype(F32), w.T, precision=hi)
    return Ops(proj, lambda x, ws: tuple(proj(x, w, "full") for w in ws), act=F32)


def jax_cake_ops(mode: str, sharding: str) -> Ops:
    proj = lambda x, w, kind: jax_cake.dense_projection(x, w)
    ops = Ops(proj, lambda x, ws: jax_cake.fused_projections(x, tuple(ws)))
    if mode == "shard_map" and sharding == "fsdp":
        ops = dataclasses.replace(ops, gather=lambda w: jax.lax.all_gather(w, AXIS, axis=0, tiled=True))
    if mode == "shard_map" and sharding == "tp":
        ops = dataclasses.replace(ops, reduce=lambda y: jax.lax.psum(y, AXIS))
    return ops


@dataclasses.dataclass(frozen=True)
class Dims:
    d: int
    q: int = 0
    kv: int = 0
    ff: int = 0
    groups: int = 1  # tp's device blocks in the fused weights (1: separate weights)
    tp: bool = False


def stack_apply(params, x, ops: Ops, dims: Dims):
    h, ws = x, params["w"]
    for i, w in enumerate(ws):
        kind = ("col", "row")[i % 2] if dims.tp else "full"
        h = ops.proj(h, ops.gather(w), kind)
        if kind == "row":
            h = ops.reduce(h)
        if i < len(ws) - 1:
            h = jax.nn.gelu(h)
    return h


def _norm(x, act):
    xf = x.astype(F32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)).astype(act)


def _split(outs, widths, groups):
    """The fused outputs as [T, groups, width / groups] each."""
    t = outs[0].shape[0]
    if len(outs) == len(widths):
        return [y.reshape(t, 1, y.shape[-1]) for y in outs]
    (y,) = outs
    y = y.reshape(t, groups, sum(widths) // groups)
    parts, start = [], 0
    for w in widths:
        parts.append(y[:, :, start : start + w // groups])
        start += w // groups
    return parts


def llama_apply(params, x, ops: Ops, dims: Dims):
    t, g = x.shape[0], dims.groups
    for blk in params["blocks"]:
        h = _norm(x, ops.act)
        q, k, v = _split(ops.fused(h, [ops.gather(w) for w in blk["qkv"]]), (dims.q, dims.kv, dims.kv), g)
        kv = (jax.nn.sigmoid(k.astype(F32)) * v.astype(F32))[:, :, None, :]  # the attention stand-in
        a = (q.astype(F32).reshape(t, g, dims.q // dims.kv, dims.kv // g) * kv).astype(ops.act).reshape(t, dims.q)
        x = x + ops.reduce(ops.proj(a, ops.gather(blk["o"]), "row" if dims.tp else "full"))
        h = _norm(x, ops.act)
        gate, up = _split(ops.fused(h, [ops.gather(w) for w in blk["gu"]]), (dims.ff, dims.ff), g)
        m = (jax.nn.silu(gate.astype(F32)) * up.astype(F32)).astype(ops.act).reshape(t, dims.ff)
        x = x + ops.reduce(ops.proj(m, ops.gather(blk["down"]), "row" if dims.tp else "full"))
    return x


APPLY = {"stack": stack_apply, "llama": llama_apply}


def init_params(model: str, dims: Dims, key):
    def w(key, d_out, d_in):
        return jax.random.normal(key, (d_out, d_in), F32) * d_in**-0.5

    keys = iter(jax.random.split(key, 64))
    if model == "stack":
        return {"w": [w(next(keys), dims.d, dims.d) for _ in range(LAYERS)]}

    def fuse(parts):  # tp: one device-blocked weight, so each device's rows are its own q, k, v
        if dims.groups == 1 and not dims.tp:
            return tuple(parts)
        blocks = [p.reshape(dims.groups, p.shape[0] // dims.groups, p.shape[1]) for p in parts]
        return (jnp.concatenate(blocks, axis=1).reshape(-1, dims.d),)

    qkv = fuse([w(next(keys), dims.q, dims.d), w(next(keys), dims.kv, dims.d), w(next(keys), dims.kv, dims.d)])
    gu = fuse([w(next(keys), dims.ff, dims.d), w(next(keys), dims.ff, dims.d)])
    o, down = w(next(keys), dims.d, dims.q), w(next(keys), dims.d, dims.ff)
    return {"blocks": [{"qkv": qkv, "o": o, "gu": gu, "down": down}]}


def param_specs(model: str, sharding: str, params):
    """PartitionSpecs of the params, and of x and the target."""
    col, row = P(AXIS), P(None, AXIS)

    def spec(path: str, i: int = 0):
        if sharding == "dp":
            return P()
        if sharding == "fsdp":
            return P(AXIS)
        if model == "stack":
            return (col, row)[i % 2]
        return col if path in ("qkv", "gu") else row

    data = P() if sharding == "tp" else P(AXIS)
    if model == "stack":
        return {"w": [spec("w", i) for i in range(len(params["w"]))]}, data
    one = lambda k, v: tuple(spec(k) for _ in v) if isinstance(v, tuple) else spec(k)
    blocks = [{k: one(k, v) for k, v in b.items()} for b in params["blocks"]]
    return {"blocks": blocks}, data


def loss_fn(apply, ops, dims, psum_tokens: bool):
    def loss(x, params, t):
        value = jnp.sum((apply(params, x, ops, dims).astype(F32) - t) ** 2)
        return jax.lax.psum(value, AXIS) if psum_tokens else value

    return loss


def dims_for(model: str, sharding: str, n: int, local: bool) -> Dims:
    if model == "stack":
        return Dims(D_MODEL, tp=sharding == "tp")
    if sharding == "tp" and local:  # one device's slices: its own q, k, v (groups 1)
        return Dims(D_MODEL, D_Q // n, D_KV // n, D_FF // n, 1, tp=True)
    return Dims(D_MODEL, D_Q, D_KV, D_FF, n if sharding == "tp" else 1, tp=sharding == "tp")


def build_step(model, mode, sharding, mesh, params, n):
    """The jitted jax_cake step (x, params, t) -> (loss, (dx, dparams)) of one case."""
    pspecs, data_spec = param_specs(model, sharding, params)
    ops, apply = jax_cake_ops(mode, sharding), APPLY[model]
    if mode == "shard_map":
        local = dims_for(model, sharding, n, local=True) if sharding == "tp" else dims_for(model, sharding, n, False)
        body = jax.value_and_grad(loss_fn(apply, ops, local, psum_tokens=sharding != "tp"), argnums=(0, 1))
        specs = (data_spec, pspecs, data_spec)
        step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), (data_spec, pspecs))))
        return step, pspecs, data_spec
    step = jax.value_and_grad(loss_fn(apply, ops, dims_for(model, sharding, n, False), False), argnums=(0, 1))
    if mode == "auto":  # gradients placed as their primals, as an optimizer update wants them
        named = lambda s: NamedSharding(mesh, s)
        outs = (named(P()), (named(data_spec), jax.tree.map(named, pspecs, is_leaf=lambda s: isinstance(s, P))))
        return jax.jit(step, out_shardings=outs), pspecs, data_spec
    return jax.jit(step), pspecs, data_spec


_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COLLECTIVE = re.compile(r"= (.*?) (" + "|".join(_KINDS) + r")(-start)?\(")
_SHAPE = re.compile(r"[a-z0-9]+\[[0-9,]*\]")


def collectives(text: str) -> list[tuple[str, str]]:
    """(kind, result shape) of every non-scalar collective in compiled HLO text: one entry
    per array of a combined (tuple) collective; an async all-gather / collective-permute
    start lists its operands before its results, and only the results are kept."""
    out = []
    for line in text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        shapes = _SHAPE.findall(m.group(1))
        if m.group(3) and m.group(2) in ("all-gather", "collective-permute"):
            shapes = [s for s in shapes if not s.endswith("[]")]
            shapes = shapes[len(shapes) // 2 :]
        out += [(m.group(2), s) for s in shapes if not s.endswith("[]")]
    return out


def activation_gathers(calls, token_dims) -> list[str]:
    dims = lambda s: {int(d) for d in s[s.index("[") + 1 : -1].split(",") if d}
    return [f"{k} {s}" for k, s in calls if k == "all-gather" and dims(s) & set(token_dims)]


@functools.cache
def inputs(model: str, sharding: str):
    n = len(jax.devices())
    t = TOKENS_PER_DEVICE if sharding == "tp" else n * TOKENS_PER_DEVICE
    params = init_params(model, dims_for(model, sharding, n, local=False), jax.random.key(1))
    kx, kt = jax.random.split(jax.random.key(2))
    return jax.random.normal(kx, (t, D_MODEL), F32).astype(BF16), params, jax.random.normal(kt, (t, D_MODEL), F32)


@functools.cache
def one_device(model: str, sharding: str, truth: bool):
    """The same step on one device: jax_cake's bf16 step, or the float32 truth."""
    x, params, t = inputs(model, sharding)
    dims = dims_for(model, sharding, len(jax.devices()), local=False)
    ops = truth_ops() if truth else jax_cake_ops("one", sharding)
    step = jax.jit(jax.value_and_grad(loss_fn(APPLY[model], ops, dims, False), argnums=(0, 1)))
    one = functools.partial(jax.device_put, device=jax.devices()[0])
    return jax.device_get(step(one(x.astype(F32) if truth else x), one(params), one(t)))


@pytest.mark.parametrize("sharding", ["dp", "tp", "fsdp"])
@pytest.mark.parametrize("mode", ["shard_map", "auto", "explicit"])
@pytest.mark.parametrize("model", ["stack", "llama"])
def test_sharded_step_matches_one_device_and_gathers_no_activation(model, mode, sharding):
    n = len(jax.devices())
    if n < 2:
        pytest.skip("needs at least 2 devices")
    x, params, t = inputs(model, sharding)
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit if mode == "explicit" else AxisType.Auto,))
    with jax.set_mesh(mesh):
        step, pspecs, data_spec = build_step(model, mode, sharding, mesh, params, n)
        place = lambda tree, specs: jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs)
        args = (place(x, data_spec), place(params, pspecs), place(t, data_spec))
        compiled = step.lower(*args).compile()
        calls = collectives(compiled.as_text())
        assert not activation_gathers(calls, (TOKENS_PER_DEVICE, x.shape[0])), calls
        loss, (dx, dparams) = jax.device_get(compiled(*args))
    _, (rdx, rdparams) = one_device(model, sharding, truth=False)
    dws, rdws = jax.tree.leaves(dparams), jax.tree.leaves(rdparams)
    assert dx.dtype == BF16 and all(a.dtype == F32 for a in dws)
    if model == "stack" and sharding != "tp":  # bitwise the one-device activations
        assert rel_err(dx, rdx) <= DX_TOL
        assert max(rel_err(a, b) for a, b in zip(dws, rdws)) <= DW_TOL
    else:
        _, (tdx, tdparams) = one_device(model, sharding, truth=True)
        for got, ref, truth in zip([dx, *dws], [rdx, *rdws], [tdx, *jax.tree.leaves(tdparams)]):
            assert rel_err(got, truth) <= ACC_FACTOR * max(rel_err(ref, truth), 1e-12)
    if model == "stack" and mode == "auto":  # the one reduction each sharding needs
        kinds = {(k, s) for k, s in calls}
        want = {
            "dp": {("all-reduce", f"f32[1,{D_MODEL},{D_MODEL}]")},  # dw
            "tp": {("all-reduce", f"f32[1,{TOKENS_PER_DEVICE},{D_MODEL}]")},  # y and dx
            "fsdp": {
                ("all-gather", f"f32[1,{D_MODEL},{D_MODEL}]"),
                ("reduce-scatter", f"f32[1,{D_MODEL // n},{D_MODEL}]"),
            },
        }[sharding]
        assert want <= kinds, calls


def test_collectives_parses_tuples_and_async_starts():
    lines = (
        "  %a = (f32[], f32[1,64,64]{2,1,0}, f32[1,64,64]{2,1,0}) all-reduce(%r, %b), channel_id=1",
        "  %g = (bf16[64,64]{1,0}, bf16[128,64]{1,0}) all-gather-start(%p), dimensions={0}",
        "  %d = bf16[128,64]{1,0} all-gather-done(%g)",
        "  %s = f32[8,64]{1,0} reduce-scatter(%y), dimensions={0}",
    )
    calls = collectives("\n".join(lines))
    assert calls == [
        ("all-reduce", "f32[1,64,64]"),
        ("all-reduce", "f32[1,64,64]"),
        ("all-gather", "bf16[128,64]"),
        ("reduce-scatter", "f32[8,64]"),
    ]
    assert activation_gathers(calls, (128, 1024)) == ["all-gather bf16[128,64]"]
    assert activation_gathers(calls, (40, 320)) == []
