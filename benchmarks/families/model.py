"""--family=model: whole training steps, jax_cake against idiomatic XLA.

    python -m benchmarks.bench --family=model --md=out/model.md --csv=out/model.csv
    python -m benchmarks.bench --family=model --cases=block,mlp --runs=3 --cold_runs=0

Every step is value_and_grad of a loss over FP32 master weights and the input x, then
an Adam update of the weights; both arms of a case start from the same weights, Adam
state and data (fixed seeds) and their first-step losses are compared. The XLA arm is
what one writes without jax_cake: `jnp.dot(x, w.astype(bf16).T)` per weight (XLA merges
dots sharing an operand as it likes) and `jax.checkpoint_policies.dots_saveable`; the
jax_cake arm uses `dense_projection`, `fused_projections` where weights share an input,
`swiglu_mlp` for the MLP (the activation in the gate/up GEMM's epilogue, the residual
in the down projection's) and `jax_cake.remat.save_projections`.

Cases (`--cases`; sizes are flags, defaults below):
- skinny: 4 heads d -> 48, 64, 48, 64 sharing x [T = 16231, d = 4096]; two jax_cake
  arms: four separate dense_projection calls (skinny/separate) and one
  fused_projections (skinny/fused), both paired with the same XLA arm.
- block, block_remat: a Llama-3-8B-shaped stack of --blocks = 2 pre-norm blocks at
  T = 8192: RMSNorm, q/k/v 4096 -> 4096/1024/1024 (GQA), an elementwise stand-in for
  attention (q times sigmoid(k) plus v, k and v repeated over the query groups), o
  4096 -> 4096, residual add, RMSNorm, SwiGLU gate/up 4096 -> 14336, down 14336 -> 4096,
  residual add; jax_cake fuses q/k/v and gate/up. block_remat checkpoints every block
  (save_projections for jax_cake, dots_saveable for XLA).
- mlp: the SwiGLU MLP alone, T = 8192, 4096 -> 14336 -> 4096: swiglu_mlp (mlp/jax_cake)
  and the composition of fused_projections, an XLA silu pass and dense_projection
  (mlp/composed), both paired with the same XLA arm.
- router: DeepSeek-V3-shaped router logits x [16384, 7168] f32 . w [256, 7168]^T f32,
  a top-8 softmax gating loss plus a z-loss; jax_cake.router_logits against jnp.dot
  with precision=DotAlgorithmPreset.BF16_BF16_F32_X3.
- moe, moe_capacity, moe_tokamax: a dropless MoE layer, Mixtral-8x7B-shaped by default
  (T = 8192 tokens, d = 4096, G = 8 SwiGLU experts of d_ff = 14336, top-2; Qwen3-30B-A3B:
  --moe_experts=128 --moe_d=2048 --moe_d_ff=768 --moe_top_k=8; a DeepSeek-V3 expert-parallel
  shard: --moe_tokens=2048 --moe_experts=32 --moe_d=7168 --moe_d_ff=2048 --moe_top_k=8):
  router logits (a bf16 dot, the same in both arms), top-k of their softmax, the experts'
  MLP, loss = mean square of y; gradients for x, the router and the three expert weights
  (FP32 masters), through the routing weights. jax_cake.moe_mlp against the same layer
  written without jax_cake (benchmarks/moe_layers.py): moe against lax.ragged_dot
  (dropless), moe_capacity against a capacity-factor-1.25 layer (dispatch by index, a
  batched einsum over [G, C, *]: 1.25x the rows, tokens past the capacity dropped, so its
  loss differs), moe_tokamax against tokamax.ragged_dot (dropless; needs tokamax, not in
  the default --cases). The XLA columns are the baseline's. On sm_90a the jax_cake arm's
  grouped GEMMs are the grouped kernels.
- cold: a fresh process per (run, arm) (no compilation cache): host wall time from the
  spawn to the first result of the jitted step of case --cold_case (import, backend
  start, trace, compile and run; jax_cake includes loading its library).

The timed cases follow the harness's protocol (one child per run and mode, each arm one
executable of --steps unrolled (step, L2 flush) pairs, the arms in paired groups, CUPTI
device time); the table shows the median over runs of each run's median group, in ms. The
temp columns are the compiled single step's `memory_analysis().temp_size_in_bytes`. An arm
that fails to compile or run (out of memory, say) is named with its error in the status
column and not timed; the case's other arms still are. `--top_kernels=N` adds, after the
table, each arm's N busiest GPU kernels of one step (run 0's: one more call profiled on its
own, device time and launches per kernel name, XLA's numeric suffixes dropped): where a
step's time goes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

from absl import app, flags

from benchmarks import harness
from benchmarks import markdown as md

CASES = ("skinny", "block", "block_remat", "mlp", "router", "moe", "moe_capacity", "moe_tokamax", "cold")
TIMED_CASES = CASES[:-1]
DEFAULT_CASES = tuple(c for c in CASES if c != "moe_tokamax")  # tokamax is not a requirement
MOE_BASELINES = {"moe": "dropless lax.ragged_dot", "moe_capacity": "capacity 1.25", "moe_tokamax": "dropless tokamax"}
COLUMNS = (
    "step",
    "mode",
    "XLA ms",
    "jax_cake ms",
    "XLA/jax_cake",
    "loss rel diff",
    "XLA temp MiB",
    "jax_cake temp MiB",
    "status",
)
COLD_ENV = {"JAX_ENABLE_COMPILATION_CACHE": "false"}

FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class Sizes:
    skinny_tokens: int = 16231
    skinny_d: int = 4096
    skinny_heads: tuple[int, ...] = (48, 64, 48, 64)
    block_tokens: int = 8192
    d_model: int = 4096
    d_q: int = 4096
    d_kv: int = 1024
    d_ff: int = 14336
    blocks: int = 2
    mlp_tokens: int = 8192
    router_tokens: int = 16384
    router_d: int = 7168
    router_experts: int = 256
    top_k: int = 8
    moe_tokens: int = 8192
    moe_d: int = 4096
    moe_d_ff: int = 14336
    moe_experts: int = 8
    moe_top_k: int = 2


# --- the models ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ops:
    """How one arm projects: dense(x, w) -> y; fused(x, ws) -> (y_i); residual(r, x, w) ->
    r + x w^T; its remat policy; mlp(h, wg, wu, wd, residual) -> [residual +] the SwiGLU
    MLP of h (None: the composition of fused, silu and dense / residual)."""

    dense: Callable
    fused: Callable
    residual: Callable
    policy: Any
    mlp: Callable | None = None


def arm_ops(arm: str, deterministic: bool) -> Ops:
    import jax
    import jax.numpy as jnp

    import jax_cake

    if arm == "xla":
        dense = lambda x, w: jnp.dot(x, w.astype(jnp.bfloat16).T)
        fused = lambda x, ws: tuple(dense(x, w) for w in ws)
        return Ops(dense, fused, lambda r, x, w: r + dense(x, w), jax.checkpoint_policies.dots_saveable)
    dense = lambda x, w: jax_cake.dense_projection(x, w, deterministic=deterministic)
    if arm == "separate":
        fused = lambda x, ws: tuple(dense(x, w) for w in ws)
    else:
        fused = lambda x, ws: jax_cake.fused_projections(x, ws, deterministic=deterministic)
    residual = lambda r, x, w: jax_cake.dense_projection(x, w, residual=r, deterministic=deterministic)
    if arm in ("separate", "composed"):  # composed: the MLP from fused_projections, an XLA silu, dense
        return Ops(dense, fused, residual, jax_cake.remat.save_projections)

    def mlp(h, wg, wu, wd, r):
        return jax_cake.swiglu_mlp(h, wg, wu, wd, residual=r, deterministic=deterministic)

    return Ops(dense, fused, residual, jax_cake.remat.save_projections, mlp)


def _f32(a):
    import jax.numpy as jnp

    return a.astype(jnp.float32)


def _mean_square(y):
    import jax.numpy as jnp

    return jnp.mean(jnp.square(_f32(y)))


def rms_norm(x, scale):
    """RMSNorm with FP32 statistics; the result in x's dtype."""
    import jax
    import jax.numpy as jnp

    x32 = _f32(x)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (x32 * scale).astype(x.dtype)


def swiglu(ops: Ops, p, h, residual=None):
    """down(silu(gate) * up), added to `residual` where given (the block's skip path)."""
    import jax

    if ops.mlp is not None:
        return ops.mlp(h, p["wg"], p["wu"], p["wd"], residual)
    gate, up = ops.fused(h, [p["wg"], p["wu"]])
    act = (jax.nn.silu(_f32(gate)) * _f32(up)).astype(h.dtype)
    return ops.dense(act, p["wd"]) if residual is None else ops.residual(residual, act, p["wd"])


def block(ops: Ops, p, x):
    """One pre-norm block on x [T, d] bf16 with an elementwise attention stand-in."""
    import jax

    h = rms_norm(x, p["attn_norm"])
    q, k, v = ops.fused(h, [p["wq"], p["wk"], p["wv"]])
    groups = q.shape[-1] // k.shape[-1]
    k, v = (jax.numpy.tile(a, (1, groups)) for a in (k, v))  # GQA: kv heads serve `groups` query heads
    attn = (_f32(q) * jax.nn.sigmoid(_f32(k)) + _f32(v)).astype(x.dtype)
    x = ops.residual(x, attn, p["wo"])
    return swiglu(ops, p, rms_norm(x, p["mlp_norm"]), residual=x)


def skinny_loss(ops: Ops):
    return lambda params, x: sum(_mean_square(y) for y in ops.fused(x, list(params)))


def block_loss(ops: Ops, remat: bool):
    import jax

    layer = lambda p, x: block(ops, p, x)
    if remat:
        layer = jax.checkpoint(layer, policy=ops.policy)

    def loss(params, x):
        for p in params:
            x = layer(p, x)
        return _mean_square(x)

    return loss


def mlp_loss(ops: Ops):
    return lambda params, x: _mean_square(swiglu(ops, params, x))


def router_loss(arm: str, top_k: int, deterministic: bool):
    """Top-k softmax gates times fixed per-expert values, plus a z-loss on all logits."""
    import jax
    import jax.numpy as jnp

    import jax_cake

    def logits_of(x, w):
        if arm == "xla":
            return jnp.dot(x, w.T, precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3)
        return jax_cake.router_logits(x, w, deterministic=deterministic)

    def loss(w, x):
        logits = logits_of(x, w)
        values, idx = jax.lax.top_k(logits, top_k)
        gates = jax.nn.softmax(values, axis=-1)
        expert_value = jnp.linspace(-1.0, 1.0, w.shape[0], dtype=jnp.float32)
        z = jax.nn.logsumexp(logits, axis=-1)
        return jnp.mean(jnp.sum(gates * expert_value[idx], axis=-1)) + 1e-3 * jnp.mean(z * z)

    return loss


def moe_loss(baseline: str | None, top_k: int, deterministic: bool):
    """The MoE layer's loss: jax_cake.moe_mlp (baseline None) or the baseline layer."""
    import jax
    import jax.numpy as jnp

    import jax_cake
    from benchmarks import moe_layers

    if baseline is None:
        layer = lambda *a: jax_cake.moe_mlp(*a, deterministic=deterministic)
    elif baseline == "moe":
        layer = moe_layers.dropless(moe_layers.lax_ragged)
    elif baseline == "moe_capacity":
        layer = moe_layers.capacity()
    else:
        layer = moe_layers.dropless(moe_layers.tokamax_ragged())

    def loss(params, x):
        logits = jnp.dot(x, params["router"].astype(jnp.bfloat16).T, preferred_element_type=jnp.float32)
        weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
        return _mean_square(layer(x, params["wg"], params["wu"], params["wd"], ids, weights))

    return loss


def adam(params, grads, opt, lr=1e-4, b1=0.9, b2=0.999, eps=1e-8):
    """One Adam update (the first: bias corrections of step 1) on FP32 masters."""
    import jax

    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, opt[0], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, opt[1], grads)
    params = jax.tree.map(lambda p, m, v: p - lr * (m / (1 - b1)) / ((v / (1 - b2)) ** 0.5 + eps), params, m, v)
    return params, (m, v)


def train_step(loss_fn: Callable) -> Callable:
    """(x, params, opt) -> (params, opt, loss, dx): harness.steps_program's (x, w, dy) slots."""
    import jax

    def step(x, params, opt):
        loss, (grads, dx) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, x)
        params, opt = adam(params, grads, opt)
        return params, opt, loss, dx

    return step


# --- the cases ------------------------------------------------------------------------------


def case_label(name: str, s: Sizes) -> str:
    if name == "skinny":
        return f"skinny heads T={s.skinny_tokens} {s.skinny_d}->{','.join(map(str, s.skinny_heads))}"
    if name in ("block", "block_remat"):
        return f"{s.blocks} blocks T={s.block_tokens} d={s.d_model} q/k/v {s.d_q}/{s.d_kv}/{s.d_kv} d_ff={s.d_ff}" + (
            ", remat per block" if name == "block_remat" else ""
        )
    if name == "mlp":
        return f"SwiGLU MLP T={s.mlp_tokens} {s.d_model}->{s.d_ff}->{s.d_model}"
    if name == "router":
        return f"router T={s.router_tokens} {s.router_d}->{s.router_experts} top-{s.top_k}"
    if name in MOE_BASELINES:
        return (
            f"MoE T={s.moe_tokens} d={s.moe_d} G={s.moe_experts} d_ff={s.moe_d_ff} top-{s.moe_top_k} "
            f"vs {MOE_BASELINES[name]}"
        )
    raise ValueError(f"case {name!r}: expected one of {TIMED_CASES}")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    label: str
    arms: tuple[str, ...]  # "xla" first, then the jax_cake arms
    inputs: Callable[[], tuple]  # () -> (x, params, opt)
    loss: Callable[[str], Callable]  # arm -> loss(params, x)


def _block_params(key, s: Sizes):
    import jax
    import jax.numpy as jnp

    d = s.d_model
    shapes = dict(wq=(s.d_q, d), wk=(s.d_kv, d), wv=(s.d_kv, d), wo=(d, s.d_q), wg=(s.d_ff, d), wu=(s.d_ff, d))
    shapes["wd"] = (d, s.d_ff)
    keys = jax.random.split(key, len(shapes))
    p = {n: jax.random.normal(k, shape, jnp.float32) / shape[1] ** 0.5 for k, (n, shape) in zip(keys, shapes.items())}
    p.update(attn_norm=jnp.ones((d,), jnp.float32), mlp_norm=jnp.ones((d,), jnp.float32))
    return p


def _with_opt(x, params):
    import jax
    import jax.numpy as jnp

    return x, params, tuple(jax.tree.map(jnp.zeros_like, params) for _ in range(2))


def make_case(name: str, s: Sizes, deterministic: bool) -> Case:
    import jax
    import jax.numpy as jnp

    label = case_label(name, s)  # raises for an unknown case
    key_x, key_w = jax.random.split(jax.random.key(0))
    bf16, f32 = jnp.bfloat16, jnp.float32
    ops = lambda arm: arm_ops(arm, deterministic)
    if name == "skinny":

        def inputs():
            x = jax.random.normal(key_x, (s.skinny_tokens, s.skinny_d), f32).astype(bf16)
            keys = jax.random.split(key_w, len(s.skinny_heads))
            ws = [jax.random.normal(k, (d, s.skinny_d), f32) / s.skinny_d**0.5 for k, d in zip(keys, s.skinny_heads)]
            return _with_opt(x, ws)

        return Case(name, label, ("xla", "separate", "fused"), inputs, lambda arm: skinny_loss(ops(arm)))
    if name in ("block", "block_remat"):

        def inputs():
            x = jax.random.normal(key_x, (s.block_tokens, s.d_model), f32).astype(bf16)
            return _with_opt(x, [_block_params(k, s) for k in jax.random.split(key_w, s.blocks)])

        remat = name == "block_remat"
        return Case(name, label, ("xla", "jax_cake"), inputs, lambda arm: block_loss(ops(arm), remat))
    if name == "mlp":

        def inputs():
            x = jax.random.normal(key_x, (s.mlp_tokens, s.d_model), f32).astype(bf16)
            p = _block_params(key_w, s)
            return _with_opt(x, {n: p[n] for n in ("wg", "wu", "wd")})

        return Case(name, label, ("xla", "jax_cake", "composed"), inputs, lambda arm: mlp_loss(ops(arm)))
    if name == "router":

        def inputs():
            x = jax.random.normal(key_x, (s.router_tokens, s.router_d), f32)
            return _with_opt(x, 0.02 * jax.random.normal(key_w, (s.router_experts, s.router_d), f32))

        return Case(name, label, ("xla", "jax_cake"), inputs, lambda arm: router_loss(arm, s.top_k, deterministic))
    if name in MOE_BASELINES:

        def inputs():
            x = jax.random.normal(key_x, (s.moe_tokens, s.moe_d), f32).astype(bf16)
            shapes = dict(wg=(s.moe_d_ff, s.moe_d), wu=(s.moe_d_ff, s.moe_d), wd=(s.moe_d, s.moe_d_ff))
            keys = jax.random.split(key_w, len(shapes) + 1)
            p = {
                n: jax.random.normal(k, (s.moe_experts, *shape), f32) / shape[1] ** 0.5
                for k, (n, shape) in zip(keys, shapes.items())
            }
            p["router"] = jax.random.normal(keys[-1], (s.moe_experts, s.moe_d), f32) / s.moe_d**0.5
            return _with_opt(x, p)

        def loss(arm):
            return moe_loss(name if arm == "xla" else None, s.moe_top_k, deterministic)

        return Case(name, label, ("xla", "jax_cake"), inputs, loss)
    raise AssertionError(name)


# --- a child: one (run, mode) ---------------------------------------------------------------


def measure_case(case: Case, timer, steps: int, groups: int, top_kernels: int = 0) -> dict[str, dict]:
    """{arm: {"groups_us", "loss", "temp_bytes", "status"}} of one case, its arms paired.
    An arm that fails to compile or run (out of memory, say) gets its failure as the status
    and no times; the others are still timed. With top_kernels, each timed arm also gets
    "kernels": its top_kernels busiest GPU kernels of one more call, profiled on its own
    (harness.top_kernels; None without the device timeline)."""
    import jax

    x, params, opt = case.inputs()
    compiled, out = {}, {}
    for arm in case.arms:
        try:
            step = train_step(case.loss(arm))
            single = jax.jit(step).lower(x, params, opt).compile()
            loss = float(single(x, params, opt)[2])
            out[arm] = {"loss": loss, "temp_bytes": single.memory_analysis().temp_size_in_bytes, "status": "ok"}
            del single
            program = jax.jit(harness.steps_program(step, steps), donate_argnums=0)
            compiled[arm] = program.lower(timer.buf, x, params, opt).compile()
        except Exception as e:  # reported in the table; the other arms go on
            out.setdefault(arm, {})["status"] = f"failed: {harness.first_line(e)}"
            compiled.pop(arm, None)
    for arm in list(compiled):  # warm-up: graph instantiation, autotuning, lazy loading
        try:
            timer.buf = jax.block_until_ready(compiled[arm](timer.buf, x, params, opt)[0])
        except Exception as e:  # likewise at run time
            out[arm]["status"] = f"failed: {harness.first_line(e)}"
            del compiled[arm]
    calls = {arm: (lambda buf, arm=arm: compiled[arm](buf, x, params, opt)[0]) for arm in compiled}
    if calls:
        for arm, times in harness.paired_groups(timer, calls, groups).items():
            out[arm]["groups_us"] = times
    if top_kernels:
        for arm, call in calls.items():
            breakdown = timer.kernels(call)
            out[arm]["kernels"] = None if breakdown is None else harness.top_kernels(breakdown, top_kernels)
    return out


def collect(
    cases: Sequence[str],
    sizes: Sizes,
    *,
    mode: str,
    run: int,
    steps: int,
    groups: int,
    flush_mb: int,
    timer_kind: str,
    deterministic: bool = True,
    top_kernels: int = 0,
) -> list[dict]:
    """One sample per (case, arm) measured in this process."""
    timer = harness.make_timer(timer_kind, harness.flush_buffer(flush_mb), steps)
    samples, t0 = [], time.time()
    for i, name in enumerate(cases):
        print(f"[{mode} run {run}] {i + 1}/{len(cases)} {name} {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
        case = make_case(name, sizes, deterministic)
        for arm, result in measure_case(case, timer, steps, groups, top_kernels).items():
            samples.append({"case": name, "label": case.label, "arm": arm, "mode": mode, "run": run, **result})
    return samples


def cold_child(case_name: str, arm: str, sizes: Sizes, t0: float, deterministic: bool = True) -> dict:
    """The first step of a fresh process: seconds from t0 (the parent's spawn time) to
    the step's result on the host."""
    import jax

    case = make_case(case_name, sizes, deterministic)
    x, params, opt = case.inputs()
    loss = float(jax.jit(train_step(case.loss(arm)))(x, params, opt)[2])
    return {"seconds": time.time() - t0, "loss": loss}


def run_cold(argv_flags: Sequence[str], case_name: str, runs: int) -> list[dict]:
    """Cold-start samples: `runs` fresh processes per arm (`python -m benchmarks.bench
    *argv_flags --cold_child=ARM`), the arm order alternating. Each sample carries its
    process's device header."""
    arms = ("xla", "jax_cake")
    samples = []
    env = harness.child_env(**COLD_ENV)
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(runs):
            for arm in arms if run % 2 == 0 else arms[::-1]:
                out = os.path.join(tmp, f"cold_{arm}_{run}.json")
                cmd = [sys.executable, "-m", "benchmarks.bench", *argv_flags, f"--cold_child={arm}"]
                cmd += [f"--cases={case_name}", f"--child_out={out}", f"--cold_t0={time.time()!r}"]
                subprocess.run(cmd, env=env, check=True)
                with open(out) as f:
                    data = json.load(f)
                samples.append({"case": "cold", "arm": arm, "run": run, **data["samples"][0], "header": data["header"]})
    return samples


# --- report -----------------------------------------------------------------------------------


def _rel_diff(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return abs(a - b) / abs(b) if b else abs(a - b)


def _first(samples: Sequence[dict], key: str):
    """The first sample's value of key (None where there is none: a failed arm)."""
    return samples[0].get(key) if samples else None


def _mib(n: int | None) -> float | None:
    return None if n is None else n / 2**20


def _status(xla: Sequence[dict], jc: Sequence[dict]) -> str:
    """The row's status: "ok", or each failed arm's failure (its first run's), named."""
    failed = [
        f"{name} {s[0]['status']}"
        for name, s in (("XLA", xla), ("jax_cake", jc))
        if s and s[0].get("status", "ok") != "ok"
    ]
    return "; ".join(failed) or "ok"


def _median_of_runs(samples: Sequence[dict]) -> float | None:
    per_run = [statistics.median(g for g in s["groups_us"] if g is not None) for s in samples if s.get("groups_us")]
    return statistics.median(per_run) / 1e3 if per_run else None


def table_rows(samples: Sequence[dict], cold_samples: Sequence[dict] = (), cold_label: str = "") -> list[dict]:
    """One row per (case, jax_cake arm, mode) and one for the cold start."""
    rows = []
    cases = list(dict.fromkeys(s["case"] for s in samples))
    modes = list(dict.fromkeys(s["mode"] for s in samples))
    for mode in modes:
        for case in cases:
            mine = [s for s in samples if s["case"] == case and s["mode"] == mode]
            by_arm = {arm: [s for s in mine if s["arm"] == arm] for arm in dict.fromkeys(s["arm"] for s in mine)}
            xla = by_arm.get("xla", [])
            for arm in (a for a in by_arm if a != "xla"):
                jc = by_arm[arm]
                xla_ms, jc_ms = _median_of_runs(xla), _median_of_runs(jc)
                label = mine[0]["label"] + (f" ({arm})" if arm != "jax_cake" else "")
                rows.append(
                    {
                        "step": label,
                        "mode": mode,
                        "XLA ms": xla_ms,
                        "jax_cake ms": jc_ms,
                        "XLA/jax_cake": xla_ms / jc_ms if xla_ms and jc_ms else None,
                        "loss rel diff": _rel_diff(_first(jc, "loss"), _first(xla, "loss")),
                        "XLA temp MiB": _mib(_first(xla, "temp_bytes")),
                        "jax_cake temp MiB": _mib(_first(jc, "temp_bytes")),
                        "status": _status(xla, jc),
                    }
                )
    if cold_samples:
        ms = {
            arm: statistics.median(1e3 * s["seconds"] for s in cold_samples if s["arm"] == arm)
            for arm in ("xla", "jax_cake")
        }
        loss = {arm: next(s["loss"] for s in cold_samples if s["arm"] == arm) for arm in ("xla", "jax_cake")}
        rows.append(
            {
                "step": f"cold first step, fresh process: {cold_label}",
                "mode": "-",
                "XLA ms": ms["xla"],
                "jax_cake ms": ms["jax_cake"],
                "XLA/jax_cake": ms["xla"] / ms["jax_cake"],
                "loss rel diff": _rel_diff(loss["jax_cake"], loss["xla"]),
                "XLA temp MiB": None,
                "jax_cake temp MiB": None,
                "status": "ok",
            }
        )
    return rows


def header_line(header: dict, command: str, protocol: dict) -> str:
    return (
        f"GPU {header['gpu']}, {header['sms'] or 'n/a'} SMs, driver {header['driver']}, jax {header['jax']}, "
        f"{header['date']}; command: `{command}`; step times: {header['timer']}, ms, median over "
        f"{protocol['runs']} runs of each run's median over {protocol['groups']} paired groups of {protocol['steps']} "
        f"steps (L2 flushed before each); jax_cake deterministic={protocol['deterministic']}; ratio = XLA ms / "
        "jax_cake ms (above 1: jax_cake faster); loss rel diff = |loss jax_cake - loss XLA| / |loss XLA| at the "
        "first step; temp = compiled step's memory_analysis().temp_size_in_bytes"
        + (
            f"; cold: host wall time from process spawn to the first step's result, median over "
            f"{protocol['cold_runs']} processes per arm"
            if protocol.get("cold_runs")
            else ""
        )
    )


def markdown(header_text: str, rows: Sequence[dict]) -> str:
    cells = ([_cell(c, r.get(c)) for c in COLUMNS] for r in rows)
    return "\n".join([header_text, "", *md.table(COLUMNS, cells)]) + "\n"


KERNEL_COLUMNS = ("kernel", "launches", "us", "share")


def kernels_markdown(samples: Sequence[dict]) -> str:
    """Per (case, mode, arm) with a "kernels" breakdown, its first run's: a table of the
    busiest kernels of one step (launches and device time per step, share of the kernels'
    total). Empty where no sample has one."""
    out = []
    for s in samples:
        if "kernels" not in s or s["run"] != 0:
            continue
        arm = "XLA" if s["arm"] == "xla" else s["arm"]
        out += ["", f"Kernels of one step: {s['label']}, {arm} ({s['mode']}):", ""]
        if s["kernels"] is None:
            out.append("n/a: host wall time has no device timeline (--timer=device on a GPU).")
            continue
        total = sum(k["us"] for k in s["kernels"]) or 1.0
        cells = ([k["kernel"], md.number(k["launches"]), md.number(k["us"]), f"{k['us'] / total:.1%}"] for k in s["kernels"])
        out += md.table(KERNEL_COLUMNS, cells)
    return "\n".join(out) + ("\n" if out else "")


def _cell(column: str, v) -> str:
    if column == "loss rel diff" and isinstance(v, float):
        return f"{v:.1e}"
    return md.number(v)


# --- entry point --------------------------------------------------------------------------------

SIZE_FLAGS = tuple(f.name for f in dataclasses.fields(Sizes))
READS = ("cases", "cold_case", "cold_runs", "deterministic", "top_kernels", "cold_child", "cold_t0", *SIZE_FLAGS)


def define_flags() -> None:
    """The model family's own flags (the sizes, the cases, the cold start)."""
    defaults = Sizes()
    for name in SIZE_FLAGS:
        value = getattr(defaults, name)
        if isinstance(value, tuple):
            flags.DEFINE_list(name, [str(v) for v in value], f"model: size {name}.")
        else:
            flags.DEFINE_integer(name, value, f"model: size {name}.")
    flags.DEFINE_list("cases", list(DEFAULT_CASES), f"model: cases, from {CASES}.")
    flags.DEFINE_string("cold_case", "block", f"model: the case the cold row times the first step of, {TIMED_CASES}.")
    flags.DEFINE_integer("cold_runs", 2, "model: fresh processes per arm for the cold row.")
    flags.DEFINE_bool("deterministic", True, "model: the jax_cake arms' deterministic flag (the library's default).")
    flags.DEFINE_integer(
        "top_kernels", 0, "model: list each arm's N busiest GPU kernels of one step after the table (0: none)."
    )
    flags.DEFINE_string("cold_child", None, "Internal: time a cold first step of this arm (xla, jax_cake).")
    flags.DEFINE_float("cold_t0", None, "Internal: the cold child's spawn time (time.time()).")


def sizes_from_flags() -> Sizes:
    values = {}
    for name in SIZE_FLAGS:
        v = getattr(FLAGS, name)
        values[name] = tuple(int(x) for x in v) if isinstance(v, list) else v
    s = Sizes(**values)
    if s.d_q % s.d_kv:
        raise app.UsageError(f"--d_q={s.d_q} must be a multiple of --d_kv={s.d_kv} (GQA)")
    if s.top_k > s.router_experts:
        raise app.UsageError(f"--top_k={s.top_k} must be at most --router_experts={s.router_experts}")
    if s.moe_top_k > s.moe_experts:
        raise app.UsageError(f"--moe_top_k={s.moe_top_k} must be at most --moe_experts={s.moe_experts}")
    return s


def check() -> None:
    sizes_from_flags()
    harness.selected("cases", CASES)
    if "moe_tokamax" in FLAGS.cases:
        from benchmarks import moe_layers

        try:
            moe_layers.tokamax_ragged()
        except ImportError as e:
            raise app.UsageError(f"--cases=moe_tokamax: tokamax does not import ({e})") from e
    if FLAGS.cold_case not in TIMED_CASES:
        raise app.UsageError(f"--cold_case: {FLAGS.cold_case!r} not in {list(TIMED_CASES)}")


def child(mode: str, run: int, timer_kind: str) -> list[dict]:
    """A timed child's samples, or a cold child's one (--cold_child)."""
    sizes = sizes_from_flags()
    if FLAGS.cold_child:
        return [cold_child(FLAGS.cold_case, FLAGS.cold_child, sizes, FLAGS.cold_t0, FLAGS.deterministic)]
    timed = [c for c in FLAGS.cases if c != "cold"]
    common = dict(steps=FLAGS.steps, groups=FLAGS.groups, flush_mb=FLAGS.flush_mb, timer_kind=timer_kind)
    return collect(
        timed, sizes, mode=mode, run=run, deterministic=FLAGS.deterministic, top_kernels=FLAGS.top_kernels, **common
    )


def parent(argv: Sequence[str], modes: Sequence[str]) -> tuple[dict, list[dict]]:
    """The timed cases' children, then the cold start's fresh processes."""
    header, samples = {}, []
    if any(c != "cold" for c in FLAGS.cases):
        header, samples = harness.run_children("benchmarks.bench", argv, modes, FLAGS.runs)
    if "cold" in FLAGS.cases:
        argv = harness.child_argv(["family", *SIZE_FLAGS, "deterministic", "cold_case"])
        cold = run_cold(argv, FLAGS.cold_case, FLAGS.cold_runs)
        if not header:  # only the cold row: a cold child named the device (the parent starts no backend)
            header = dict(cold[-1]["header"], timer="n/a (no timed cases)")
        samples += cold
    return header, samples


def report(header: dict, samples: Sequence[dict]) -> harness.Report:
    cold = [s for s in samples if s["case"] == "cold"]
    protocol = dict(
        runs=FLAGS.runs,
        groups=FLAGS.groups,
        steps=FLAGS.steps,
        deterministic=FLAGS.deterministic,
        cold_runs=FLAGS.cold_runs if cold else 0,
    )
    command = " ".join(["python -m benchmarks.bench", *sys.argv[1:]])
    timed = [s for s in samples if s["case"] != "cold"]
    rows = table_rows(timed, cold, case_label(FLAGS.cold_case, sizes_from_flags()))
    text = markdown(header_line(header, command, protocol), rows) + kernels_markdown(timed)
    return harness.Report(text, COLUMNS, rows)


FAMILY = harness.Family(
    "model",
    "whole training steps (value_and_grad and Adam): jax_cake against idiomatic XLA",
    READS,
    {"runs": 2, "modes": ["g"], "groups": 6, "steps": 1},
    child,
    report,
    check,
    parent=parent,
)
