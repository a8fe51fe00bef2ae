"""Multi-device check: `python -m jax_cake.tools.multi_gpu_check`.

Every device of the host in one mesh axis "d". Each case trains one step of a model,
once with jax_cake and once with XLA's own dot written idiomatically in the same mode
(`jnp.dot(x, w.astype(bf16).T)`, the same shardings), in three modes:

- shard_map: `jax.shard_map` over per-device code (psum after a row-parallel
  projection, all_gather of FSDP weights written out);
- auto: `jax.jit` on inputs placed with NamedSharding on an Auto mesh axis (jax_cake's
  custom_partitioning / Shardy rules; XLA's sharding propagation);
- explicit: `jax.set_mesh` with AxisType.Explicit, the shardings in the types (XLA's dot
  with `out_sharding=P()` after a row-parallel projection, FSDP weights resharded to P()).

and three shardings: dp (tokens on "d", weights replicated), tp (Megatron-style:
column-parallel then row-parallel projections, tokens replicated), fsdp (tokens and the
weights' d_out on "d", weights gathered). Two models:

- stack: --layers projections of [d_model, d_model] with gelu between (tp: pairs of a
  column- then a row-parallel projection);
- llama: --blocks pre-norm blocks, d_model -> q/k/v (GQA, jax_cake.fused_projections)
  -> an elementwise stand-in for attention (q * sigmoid(k) * v, k and v broadcast over
  each query group) -> o -> residual; SwiGLU gate/up (fused_projections) -> down ->
  residual. Under tp the fused weights are stored device-blocked ([q_0 k_0 v_0 | q_1 ...]
  rows, one weight) so that each device's column slice is its own q, k and v: splitting
  separately sharded weights would move activations between devices.

Checks (PASS/FAIL lines; exit status 1 if any fails):
- gradients of the jax_cake step against the same step on one device. Where the sharded
  forward computes bitwise the one-device activations (the stack under dp and fsdp):
  bf16 dx within 1e-2 relative (Frobenius), every fp32 dw within 1e-5. Elsewhere an
  activation is re-rounded to bf16 after a sum in another order (tp's row-parallel
  reduction; the llama norms' row sums, which XLA's reduction code may order differently
  in another program), one bf16 ulp moves every later layer, and neither jax_cake nor
  XLA's own sharded step stays within 1e-5 of one device (both print their numbers).
  There the check is against a float32 truth (the same model in float32 on one device):
  no gradient's error may exceed 1.5 x the one-device bf16 step's own error;
- the compiled HLO's collectives (kind and shape, listed per case and arm) hold no
  all-gather of an activation (a shape with the token dimension; the tool refuses sizes
  where a weight width equals a token count). XLA's arm is listed (INFO), not failed:
  it is the reference, not the code under test.

Times: per-device step time of both arms, and of one device running the same
per-device shapes (dp/fsdp: the local tokens and whole weights; tp: all tokens and one
device's weight slices). On GPU these are wall times of one step
(`block_until_ready`, which waits for every device; median of --reps, the two arms
interleaved), labelled so: bench.py's DeviceTimer splits ONE device's CUPTI timeline
by L2-flush markers, and an SPMD step puts its steps on every device's timeline, so it
does not fit here. On CPU the times are host wall time (fake devices, not a GPU number).

--overlap chooses XLA scheduling options (latency-hiding scheduler, async / pipelined
collectives); each choice runs in a child process with its XLA_FLAGS, and the table
records the choice per row. --deadline_s starts no case after that many seconds (shared
between the choices) and lists the cases it skipped; --md is rewritten after each choice.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cake
from jax_cake.tools import markdown as md

FLAGS = flags.FLAGS
flags.DEFINE_list("modes", ["shard_map", "auto", "explicit"], "Modes: shard_map, auto, explicit.")
flags.DEFINE_list("shardings", ["dp", "tp", "fsdp"], "Shardings: dp, tp, fsdp.")
flags.DEFINE_list("models", ["stack", "llama"], "Models: stack, llama.")
flags.DEFINE_list("overlap", ["default"], "XLA scheduling choices (see OVERLAP), one child process each.")
flags.DEFINE_integer("tokens_per_device", 8192, "Tokens per device (dp/fsdp: the local batch; tp: the whole batch).")
flags.DEFINE_integer("d_model", 4096, "Model width.")
flags.DEFINE_integer("layers", 4, "stack: number of [d_model, d_model] projections (even for tp).")
flags.DEFINE_integer("blocks", 2, "llama: number of blocks.")
flags.DEFINE_integer("d_q", 4096, "llama: q width.")
flags.DEFINE_integer("d_kv", 1024, "llama: k and v width (GQA).")
flags.DEFINE_integer("d_ff", 14336, "llama: SwiGLU hidden width.")
flags.DEFINE_integer("reps", 20, "Timed steps per arm (median).")
flags.DEFINE_bool("check_grads", True, "Compare gradients with the one-device step.")
flags.DEFINE_bool("time", True, "Time the steps (off: checks only).")
flags.DEFINE_bool("deterministic", True, "jax_cake's deterministic flag.")
flags.DEFINE_float(
    "deadline_s", 0, "Start no case after this many seconds (0: none); skipped cases are listed. Spread over --overlap."
)
flags.DEFINE_string("md", None, "Also write the header, checks and table (markdown) to this file.")
flags.DEFINE_string("rows_json", None, "(internal) a child writes its rows and checks here.")

BF16, F32 = jnp.bfloat16, jnp.float32
DX_TOL, DW_TOL = 1e-2, 1e-5
ACC_FACTOR = 1.5  # where activations re-round (see strict): error vs float32, sharded / one device

# name -> XLA_FLAGS added for the choice (all names exist in jax 0.11.2's XLA; an unknown
# flag aborts the process, tests/test_multi_gpu_check.py checks each on CPU).
_LHS = "--xla_gpu_enable_latency_hiding_scheduler=true"
OVERLAP = {
    "default": "",
    "sync": "--xla_gpu_disable_async_collectives=ALLREDUCE,REDUCESCATTER,ALLGATHER",
    "lhs": _LHS,
    "lhs_pipelined": f"{_LHS} "
    "--xla_gpu_enable_pipelined_all_reduce=true "
    "--xla_gpu_enable_pipelined_reduce_scatter=true "
    "--xla_gpu_enable_pipelined_all_gather=true",
    "lhs_combine": f"{_LHS} "
    "--xla_gpu_all_reduce_combine_threshold_bytes=268435456 "
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=268435456 "
    "--xla_gpu_all_gather_combine_threshold_bytes=268435456",
}
MODES, SHARDINGS, MODELS = ("shard_map", "auto", "explicit"), ("dp", "tp", "fsdp"), ("stack", "llama")
AXIS = "d"


# --- the models ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ops:
    """How one arm runs the model's pieces in one mode and sharding."""

    proj: Callable  # (x, w, kind) -> y; kind "col", "row" (tp) or "full"
    fused: Callable  # (x, ws) -> tuple of y_i
    gather: Callable = lambda w: w  # a weight before use (FSDP under shard_map: all_gather)
    reduce: Callable = lambda y: y  # after a row-parallel projection (tp under shard_map: psum)
    act: Any = BF16  # the activations' dtype (float32 only in the float32 truth)


def truth_ops() -> Ops:
    """The model in float32 on one device: what both bf16 steps are measured against."""
    hi = jax.lax.Precision.HIGHEST
    proj = lambda x, w, kind: jnp.dot(x.astype(F32), w.T, precision=hi)
    return Ops(proj, lambda x, ws: tuple(proj(x, w, "full") for w in ws), act=F32)


def make_ops(arm: str, mode: str, sharding: str, det: bool) -> Ops:
    if arm == "jax_cake":
        proj = lambda x, w, kind: jax_cake.dense_projection(x, w, deterministic=det)
        fused = lambda x, ws: jax_cake.fused_projections(x, tuple(ws), deterministic=det)
    else:

        def proj(x, w, kind):
            if mode == "explicit" and kind == "row":  # the contraction is sharded: say where y lives
                return jnp.dot(x, w.astype(BF16).T, out_sharding=P())
            return jnp.dot(x, w.astype(BF16).T)

        fused = lambda x, ws: tuple(proj(x, w, "col") for w in ws)
    ops = Ops(proj, fused)
    if mode == "shard_map" and sharding == "fsdp":
        ops = dataclasses.replace(ops, gather=lambda w: jax.lax.all_gather(w, AXIS, axis=0, tiled=True))
    if mode == "shard_map" and sharding == "tp":
        ops = dataclasses.replace(ops, reduce=lambda y: jax.lax.psum(y, AXIS))
    if mode == "explicit" and sharding == "fsdp":
        if arm == "xla":  # jax_cake's sharding rule gathers the weights itself
            ops = dataclasses.replace(ops, gather=lambda w: jax.sharding.reshard(w, P()))
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
    h = x
    ws = params["w"]
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
        ws = [ops.gather(w) for w in blk["qkv"]]
        q, k, v = _split(ops.fused(h, ws), (dims.q, dims.kv, dims.kv), g)
        kv = (jax.nn.sigmoid(k.astype(F32)) * v.astype(F32))[:, :, None, :]  # the attention stand-in
        a = q.astype(F32).reshape(t, g, dims.q // dims.kv, dims.kv // g) * kv
        a = a.astype(ops.act).reshape(t, dims.q)
        x = x + ops.reduce(ops.proj(a, ops.gather(blk["o"]), "row" if dims.tp else "full"))
        h = _norm(x, ops.act)
        ws = [ops.gather(w) for w in blk["gu"]]
        gate, up = _split(ops.fused(h, ws), (dims.ff, dims.ff), g)
        m = (jax.nn.silu(gate.astype(F32)) * up.astype(F32)).astype(ops.act).reshape(t, dims.ff)
        x = x + ops.reduce(ops.proj(m, ops.gather(blk["down"]), "row" if dims.tp else "full"))
    return x


APPLY = {"stack": stack_apply, "llama": llama_apply}


def init_params(model: str, dims: Dims, key):
    def w(key, d_out, d_in):
        return jax.random.normal(key, (d_out, d_in), F32) * d_in**-0.5

    keys = iter(jax.random.split(key, 64))
    if model == "stack":
        return {"w": [w(next(keys), dims.d, dims.d) for _ in range(FLAGS.layers)]}

    def fuse(parts):  # tp: one device-blocked weight; else the separate weights
        if dims.groups == 1 and not dims.tp:
            return tuple(parts)
        g = dims.groups
        blocks = [p.reshape(g, p.shape[0] // g, p.shape[1]) for p in parts]
        return (jnp.concatenate(blocks, axis=1).reshape(-1, dims.d),)

    blocks = []
    for _ in range(FLAGS.blocks):
        blocks.append(
            {
                "qkv": fuse(
                    [w(next(keys), dims.q, dims.d), w(next(keys), dims.kv, dims.d), w(next(keys), dims.kv, dims.d)]
                ),
                "o": w(next(keys), dims.d, dims.q),
                "gu": fuse([w(next(keys), dims.ff, dims.d), w(next(keys), dims.ff, dims.d)]),
                "down": w(next(keys), dims.d, dims.ff),
            }
        )
    return {"blocks": blocks}


def param_specs(model: str, sharding: str):
    """PartitionSpecs of the params (a function of the path) and of x / t."""
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
        return lambda params: {"w": [spec("w", i) for i in range(len(params["w"]))]}, data
    return (
        lambda params: {
            "blocks": [
                {k: tuple(spec(k) for _ in v) if isinstance(v, tuple) else spec(k) for k, v in b.items()}
                for b in params["blocks"]
            ]
        },
        data,
    )


def loss_fn(apply, ops, dims, token_sharded_shard_map: bool):
    def loss(x, params, t):
        y = apply(params, x, ops, dims)
        value = jnp.sum((y.astype(F32) - t) ** 2)
        return jax.lax.psum(value, AXIS) if token_sharded_shard_map else value

    return loss


# --- steps ----------------------------------------------------------------------------------


def _is_spec(s):
    return isinstance(s, P)


def build_step(model, mode, sharding, arm, mesh, params, dims_global, dims_local, det):
    """A jitted step (x, params, t) -> (loss, (dx, dparams)) for one case and arm."""
    pspecs_of, data_spec = param_specs(model, sharding)
    pspecs = pspecs_of(params)
    ops = make_ops(arm, mode, sharding, det)
    apply = APPLY[model]
    if mode == "shard_map":
        loss = loss_fn(apply, ops, dims_local, token_sharded_shard_map=sharding != "tp")
        body = jax.value_and_grad(loss, argnums=(0, 1))
        specs = (data_spec, pspecs, data_spec)
        return (
            jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), (data_spec, pspecs)))),
            pspecs,
            data_spec,
        )
    step = jax.value_and_grad(loss_fn(apply, ops, dims_global, False), argnums=(0, 1))
    if mode == "auto":  # gradients placed as their primals, as an optimizer update wants them
        named = lambda s: NamedSharding(mesh, s)
        outs = (named(P()), (named(data_spec), jax.tree.map(named, pspecs, is_leaf=_is_spec)))
        return jax.jit(step, out_shardings=outs), pspecs, data_spec
    return jax.jit(step), pspecs, data_spec


def place(tree, specs, mesh):
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs)


def local_block(a, spec):
    """Device 0's block of a (the per-device shapes of a one-device timing)."""
    n = len(jax.devices())
    idx = tuple(
        slice(0, a.shape[i] // n) if i < len(spec) and spec[i] is not None else slice(None) for i in range(a.ndim)
    )
    return a[idx]


# --- HLO collectives --------------------------------------------------------------------------

_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COLLECTIVE = re.compile(r"= (.*?) (" + "|".join(_KINDS) + r")(-start)?\(")
_SHAPE = re.compile(r"[a-z0-9]+\[[0-9,]*\]")


def collectives(text: str) -> list[tuple[str, str]]:
    """(kind, result shape) of every non-scalar collective in compiled HLO text.

    A combined collective (a tuple result) gives one entry per array; an async
    all-gather / collective-permute start lists its operands before its results, and
    only the results are kept (reduce-scatter runs in an async computation whose body
    holds the plain instruction)."""
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


def dims_of(shape: str) -> tuple[int, ...]:
    return tuple(int(d) for d in shape[shape.index("[") + 1 : -1].split(",") if d)


def summarize(calls) -> str:
    counts: dict[tuple[str, str], int] = {}
    for c in calls:
        counts[c] = counts.get(c, 0) + 1
    return "; ".join(f"{k} {s}" + (f" x{c}" if c > 1 else "") for (k, s), c in sorted(counts.items())) or "none"


def activation_gathers(calls, token_dims) -> list[str]:
    return [f"{k} {s}" for k, s in calls if k == "all-gather" and set(dims_of(s)) & set(token_dims)]


# --- checks, timing -------------------------------------------------------------------------

CHECKS: list[dict] = []


def report(name: str, ok: bool | None, detail: str) -> None:
    """ok None: informational (printed, never fails the run)."""
    CHECKS.append({"name": name, "ok": ok, "detail": detail})
    print(f"{'INFO' if ok is None else 'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def median_pair_ms(calls: list[tuple[Callable, tuple]]) -> list[float]:
    """Median wall time (ms) per call of each (fn, args), the calls interleaved."""
    for fn, args in calls:
        jax.block_until_ready(fn(*args))
    times = [[] for _ in calls]
    for _ in range(FLAGS.reps):
        for i, (fn, args) in enumerate(calls):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[i].append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def strict(model: str, sharding: str) -> bool:
    """Whether the sharded forward computes bitwise the one-device activations: the
    stack under dp / fsdp (GEMMs per token row and gelu). Under tp the row-parallel sum
    re-rounds; in the llama block so do the norms' row sums (XLA's reduction code may add
    a row in another order in another program), and a flipped bf16 ulp propagates."""
    return model == "stack" and sharding != "tp"


def grad_check(name, got, ref, truth, counts: bool, strict_case: bool) -> None:
    """dx / dw against the one-device step (strict cases: dx 1e-2, dw 1e-5); elsewhere
    also against the float32 truth: no tensor's error may exceed ACC_FACTOR x the
    one-device step's own error (sharding must not cost accuracy)."""
    (loss, (dx, dparams)), (rloss, (rdx, rdparams)) = got, ref
    dws, rdws = jax.tree.leaves(dparams), jax.tree.leaves(rdparams)
    dx_err, dw_errs = rel(dx, rdx), [rel(a, b) for a, b in zip(dws, rdws)]
    ok = dx.dtype == BF16 and all(a.dtype == F32 for a in dws)
    detail = f"vs one device: dx {dx_err:.2e} (bf16), dw max {max(dw_errs):.2e} over {len(dws)} (fp32)"
    if strict_case:
        ok = ok and dx_err <= DX_TOL and max(dw_errs) <= DW_TOL
        detail += f"; tol dx {DX_TOL:g}, dw {DW_TOL:g}"
    elif truth is not None:
        _, (tdx, tdparams) = truth
        tdws = jax.tree.leaves(tdparams)
        ratios = [rel(a, t) / max(rel(b, t), 1e-12) for a, b, t in zip([dx, *dws], [rdx, *rdws], [tdx, *tdws])]
        ok = ok and max(ratios) <= ACC_FACTOR
        detail += (
            f"; vs float32 truth: dx {rel(dx, tdx):.2e} (one device {rel(rdx, tdx):.2e}), "
            f"worst error ratio sharded / one device {max(ratios):.2f} (tol {ACC_FACTOR:g})"
        )
    report(f"{name}/grads", ok if counts else None, detail + f"; loss {rel(loss, rloss):.1e}")


def clock_label(platform: str) -> str:
    if platform == "cpu":
        return "host wall time (CPU fake devices, not a GPU measurement)"
    return f"{platform.upper()} wall time per step (block_until_ready on every device, median of {FLAGS.reps})"


def dims_for(model, sharding, n, local: bool) -> Dims:
    if model == "stack":
        return Dims(FLAGS.d_model, tp=sharding == "tp")
    if sharding == "tp" and local:  # one device's slices: its own q, k, v (groups 1)
        return Dims(FLAGS.d_model, FLAGS.d_q // n, FLAGS.d_kv // n, FLAGS.d_ff // n, 1, tp=True)
    g = n if sharding == "tp" else 1
    return Dims(FLAGS.d_model, FLAGS.d_q, FLAGS.d_kv, FLAGS.d_ff, g, tp=sharding == "tp")


def validate(n: int) -> None:
    if n < 2:
        raise app.UsageError(f"need >= 2 devices, found {n}")
    for name, allowed in (("modes", MODES), ("shardings", SHARDINGS), ("models", MODELS), ("overlap", OVERLAP)):
        bad = [v for v in getattr(FLAGS, name) if v not in allowed]
        if bad:
            raise app.UsageError(f"--{name}: unknown {bad}; choose from {list(allowed)}")
    if "tp" in FLAGS.shardings and "stack" in FLAGS.models and FLAGS.layers % 2:
        raise app.UsageError("--layers must be even for tp (column- then row-parallel pairs)")
    if "llama" in FLAGS.models and (FLAGS.d_q % FLAGS.d_kv or any(v % n for v in (FLAGS.d_q, FLAGS.d_kv, FLAGS.d_ff))):
        raise app.UsageError(f"llama: d_kv must divide d_q, and {n} devices d_q, d_kv and d_ff")
    if FLAGS.d_model % n:
        raise app.UsageError(f"--d_model must be a multiple of {n} (tp slices [d_model, d_model] weights)")
    tokens = {FLAGS.tokens_per_device, n * FLAGS.tokens_per_device}
    widths = {FLAGS.d_model, FLAGS.d_q, FLAGS.d_kv, FLAGS.d_ff, FLAGS.d_q + 2 * FLAGS.d_kv, 2 * FLAGS.d_ff}
    widths |= {w // n for w in widths}
    if tokens & widths:  # the activation all-gather check tells x from w by the token dimension
        raise app.UsageError(f"token counts {sorted(tokens)} must differ from the weight widths {sorted(widths)}")


_START = time.monotonic()


def past_deadline() -> bool:
    return FLAGS.deadline_s > 0 and time.monotonic() - _START > FLAGS.deadline_s


def run_cases(n: int) -> list[dict]:
    devices = jax.devices()
    mesh_auto = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Auto,))
    mesh_explicit = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))
    det, t_dev, d = FLAGS.deterministic, FLAGS.tokens_per_device, FLAGS.d_model
    one = functools.partial(jax.device_put, device=devices[0])
    rows, ref_cache, one_cache = [], {}, {}
    for model in FLAGS.models:
        for sharding in FLAGS.shardings:
            t_global = t_dev if sharding == "tp" else n * t_dev
            token_dims = (t_dev, t_global)
            dims_g = dims_for(model, sharding, n, local=False)
            dims_l = dims_for(model, sharding, n, local=True) if sharding == "tp" else dims_g
            params = init_params(model, dims_g, jax.random.key(1))
            kx, kt = jax.random.split(jax.random.key(2))
            x = jax.random.normal(kx, (t_global, d), F32).astype(BF16)
            t = jax.random.normal(kt, (t_global, d), F32)

            if past_deadline():
                report(f"{model}/*/{sharding}/skipped", None, f"--deadline_s={FLAGS.deadline_s:g} passed")
                continue
            refs = {}
            # the same step on one device (XLA's too under tp, where it shows the bf16 re-rounding),
            # and the float32 truth both are measured against where activations re-round
            for arm in ("jax_cake", "xla", "truth") if FLAGS.check_grads else ():
                if (arm == "xla" and sharding != "tp") or (arm == "truth" and strict(model, sharding)):
                    continue
                key = (model, dims_g, arm)
                if key not in ref_cache:
                    ops = truth_ops() if arm == "truth" else make_ops(arm, "one", sharding, det)
                    xin = x.astype(F32) if arm == "truth" else x
                    step = jax.jit(jax.value_and_grad(loss_fn(APPLY[model], ops, dims_g, False), argnums=(0, 1)))
                    ref_cache[key] = jax.device_get(step(one(xin), one(params), one(t)))
                refs[arm] = ref_cache[key]

            one_ms = {}
            if FLAGS.time:  # one device, the per-device shapes
                pspecs, data_spec = param_specs(model, sharding)[0](params), param_specs(model, sharding)[1]
                lp = jax.tree.map(local_block, params, pspecs) if sharding == "tp" else params
                lx, lt = local_block(x, data_spec), local_block(t, data_spec)
                key = (model, dims_l, jax.tree.map(lambda a: a.shape, lp).__repr__(), lx.shape)
                if key not in one_cache:
                    calls = []
                    for arm in ("jax_cake", "xla"):
                        f = jax.jit(
                            jax.value_and_grad(
                                loss_fn(APPLY[model], make_ops(arm, "one", sharding, det), dims_l, False),
                                argnums=(0, 1),
                            )
                        )
                        calls.append((f, (one(lx), one(lp), one(lt))))
                    one_cache[key] = dict(zip(("jax_cake", "xla"), median_pair_ms(calls)))
                one_ms = one_cache[key]

            for mode in FLAGS.modes:
                mesh = mesh_explicit if mode == "explicit" else mesh_auto
                case = f"{model}/{mode}/{sharding}"
                if past_deadline():
                    report(f"{case}/skipped", None, f"--deadline_s={FLAGS.deadline_s:g} passed")
                    continue
                compiled, args, calls_of = {}, None, {}
                with jax.set_mesh(mesh):
                    for arm in ("jax_cake", "xla"):
                        try:
                            step, pspecs, data_spec = build_step(
                                model, mode, sharding, arm, mesh, params, dims_g, dims_l, det
                            )
                            args = (place(x, data_spec, mesh), place(params, pspecs, mesh), place(t, data_spec, mesh))
                            compiled[arm] = step.lower(*args).compile()
                        except Exception as e:  # noqa: BLE001 - a case that does not build is reported
                            report(
                                f"{case}/{arm}/build",
                                False if arm == "jax_cake" else None,
                                f"{type(e).__name__}: {str(e)[:400]}",
                            )
                            continue
                        calls_of[arm] = collectives(compiled[arm].as_text())
                        gathered = activation_gathers(calls_of[arm], token_dims)
                        detail = f"collectives: {summarize(calls_of[arm])}"
                        if arm == "jax_cake":
                            report(f"{case}/jax_cake/no_activation_all_gather", not gathered, detail)
                        else:
                            report(
                                f"{case}/xla/collectives",
                                None,
                                detail + (f" (XLA gathers an activation: {gathered})" if gathered else ""),
                            )
                    for arm in ("jax_cake", "xla"):
                        if arm in compiled and arm in refs:
                            grad_check(
                                f"{case}/{arm}",
                                compiled[arm](*args),
                                refs[arm],
                                refs.get("truth"),
                                arm == "jax_cake",
                                strict(model, sharding),
                            )
                    ms = {}
                    if FLAGS.time and compiled:
                        arms = list(compiled)
                        ms = dict(zip(arms, median_pair_ms([(compiled[a], args) for a in arms])))
                rows.append(
                    {
                        "model": model,
                        "mode": mode,
                        "sharding": sharding,
                        "overlap": FLAGS.overlap[0],
                        "jax_cake_ms": ms.get("jax_cake"),
                        "xla_ms": ms.get("xla"),
                        "one_jax_cake_ms": one_ms.get("jax_cake"),
                        "one_xla_ms": one_ms.get("xla"),
                        "collectives_jax_cake": summarize(calls_of.get("jax_cake", []))
                        if "jax_cake" in calls_of
                        else "n/a",
                        "collectives_xla": summarize(calls_of.get("xla", [])) if "xla" in calls_of else "n/a",
                    }
                )
    return rows


# --- output ---------------------------------------------------------------------------------


def _ms(v) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def table(rows: list[dict]) -> str:
    columns = [
        "model",
        "mode",
        "sharding",
        "overlap",
        "jax_cake ms",
        "XLA ms",
        "XLA / jax_cake",
        "1-dev jax_cake ms",
        "vs 1-device (jax_cake)",
        "vs 1-device (XLA)",
        "collectives (jax_cake; XLA)",
    ]
    cells = []
    for r in rows:
        ratio = r["xla_ms"] / r["jax_cake_ms"] if r["xla_ms"] and r["jax_cake_ms"] else None
        vs = r["jax_cake_ms"] / r["one_jax_cake_ms"] if r["jax_cake_ms"] and r["one_jax_cake_ms"] else None
        vs_x = r["xla_ms"] / r["one_xla_ms"] if r["xla_ms"] and r["one_xla_ms"] else None
        cells.append(
            [
                str(r["model"]),
                str(r["mode"]),
                str(r["sharding"]),
                str(r["overlap"]),
                _ms(r["jax_cake_ms"]),
                _ms(r["xla_ms"]),
                _ms(ratio),
                _ms(r["one_jax_cake_ms"]),
                _ms(vs),
                _ms(vs_x),
                f"{r['collectives_jax_cake']}; XLA: {r['collectives_xla']}",
            ]
        )
    return "\n".join(md.table(columns, cells))


def device_info() -> dict:
    devices = jax.devices()
    return {"n": len(devices), "kind": devices[0].device_kind, "platform": devices[0].platform}


def header(info: dict) -> str:
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    sizes = f"tokens/device {FLAGS.tokens_per_device}, d_model {FLAGS.d_model}"
    if "stack" in FLAGS.models:
        sizes += f", stack {FLAGS.layers} layers"
    if "llama" in FLAGS.models:
        sizes += f", llama {FLAGS.blocks} blocks (q {FLAGS.d_q}, k/v {FLAGS.d_kv}, d_ff {FLAGS.d_ff})"
    return "\n".join(
        [
            f"devices: {info['n']} x {info['kind']} ({info['platform']}); jax {jax.__version__}; {date}",
            f"command: python -m jax_cake.tools.multi_gpu_check {' '.join(sys.argv[1:])}".rstrip(),
            f"{sizes}; deterministic {FLAGS.deterministic}; times: {clock_label(info['platform'])}",
            "overlap: " + "; ".join(f"{k} = {OVERLAP[k] or '(no flags)'}" for k in FLAGS.overlap),
        ]
    )


def run_children(emit_partial: Callable) -> tuple[dict, list[dict], list[dict]]:
    """One child per --overlap choice, with that choice's XLA_FLAGS; their rows and checks.

    This process never starts a backend (on GPU it would hold memory the children need);
    the device names come from the children. emit_partial(info, rows, checks) runs after
    each child, so a run cut short keeps the choices it finished."""
    info, rows, checks = {"n": "?", "kind": "?", "platform": "?"}, [], []
    # absl's argv has lost the flags: pass the command line's on (as --flag=value)
    passthrough = [a for a in sys.argv[1:] if not a.startswith(("--overlap", "--md", "--rows_json", "--deadline_s"))]
    start = time.monotonic()
    for i, choice in enumerate(FLAGS.overlap):
        deadline = []
        if FLAGS.deadline_s > 0:  # an equal share of what is left, minus a start-up
            left = FLAGS.deadline_s - (time.monotonic() - start)
            deadline = [f"--deadline_s={max(left / (len(FLAGS.overlap) - i) - 10, 1):.0f}"]
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {OVERLAP[choice]}".strip())
        print(f"\n== overlap {choice}: XLA_FLAGS={env['XLA_FLAGS']}", flush=True)
        cmd = [
            sys.executable,
            "-m",
            "jax_cake.tools.multi_gpu_check",
            *passthrough,
            *deadline,
            f"--overlap={choice}",
            f"--rows_json={path}",
        ]
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, env=env, check=False).returncode
        print(f"== overlap {choice}: exit status {rc}, {time.perf_counter() - t0:.0f} s", flush=True)
        try:
            with open(path) as f:
                got = json.load(f)
            info, rows = got["info"], rows + got["rows"]
            checks += [dict(c, name=f"{choice}/{c['name']}") for c in got["checks"]]
        except (OSError, ValueError, KeyError):
            checks.append({"name": f"{choice}/child", "ok": False, "detail": f"exit status {rc}, no rows"})
        finally:
            if os.path.exists(path):
                os.unlink(path)
        emit_partial(info, rows, checks)
    return info, rows, checks


def emit(info: dict, rows: list[dict], checks: list[dict], echo: bool) -> int:
    """Prints (echo) and writes --md: header, check summary, table, check lines."""
    failed = [c for c in checks if c["ok"] is False]
    text = "\n".join(
        [
            header(info),
            "",
            (
                f"checks: {sum(c['ok'] is True for c in checks)} passed, {len(failed)} failed, "
                f"{sum(c['ok'] is None for c in checks)} informational"
            ),
            *(f"- FAIL {c['name']} {c['detail']}" for c in failed),
            "",
            table(rows),
        ]
    )
    if echo:
        print("\n" + text, flush=True)
    if FLAGS.md:
        check_lines = [
            f"- {'INFO' if c['ok'] is None else 'PASS' if c['ok'] else 'FAIL'} {c['name']} {c['detail']}"
            for c in checks
        ]
        with open(FLAGS.md, "w") as f:
            f.write(text + "\n\n" + "\n".join(check_lines) + "\n")
    return 1 if failed else 0


def main(argv):
    del argv
    bad = [v for v in FLAGS.overlap if v not in OVERLAP]
    if bad:
        raise app.UsageError(f"--overlap: unknown {bad}; choose from {list(OVERLAP)}")
    if FLAGS.rows_json is None and FLAGS.overlap != ["default"]:
        # XLA reads XLA_FLAGS once, when its backend starts: one child per choice
        info, rows, checks = run_children(lambda *a: emit(*a, echo=False))
        sys.exit(emit(info, rows, checks, echo=True))
    info = device_info()
    validate(info["n"])
    print(header(info), flush=True)
    rows = run_cases(info["n"])
    if FLAGS.rows_json is not None:
        with open(FLAGS.rows_json, "w") as f:
            json.dump({"info": info, "rows": rows, "checks": CHECKS}, f)
        sys.exit(0 if all(c["ok"] is not False for c in CHECKS) else 1)
    sys.exit(emit(info, rows, CHECKS, echo=True))


if __name__ == "__main__":
    app.run(main)
