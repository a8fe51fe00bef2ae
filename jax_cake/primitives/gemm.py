"""One GEMM on whole (or per-shard), unbatched operands: an XLA FFI custom call on CUDA,
the XLA reference elsewhere.

Each function takes a Plan (static, made at trace time). A Plan on the XLA backend runs
the reference everywhere. A kernel Plan lowers through `jax.lax.platform_dependent`: the
CUDA lowering is one `jax.ffi.ffi_call` with the Plan as attributes, any other platform
the reference with the same semantics. Result types are built from the operand's type,
so under shard_map they carry the per-shard shape and varying axes.

Epilogues: "store" writes the result; "add" adds it into a third operand c whose buffer
is aliased to the result (input_output_aliases {2: 0}: in place under jit), rounded as
`reference.add_into`. The fused add exists for fwd (the residual, jax_cake_fwd_residual)
and wgrad (the FP32 running sum, jax_cake_wgrad_accumulate). "gated" (fwd,
jax_cake_fwd_gated) writes the pre-activation and h = act(g) * u from it; its gradient
(dgrad, jax_cake_dgrad_gated) writes d[gate|up] from dh and the saved pre-activation.
The gated projection's dx (dgrad, jax_cake_dgrad_gate_up) reads its operands in two
halves: the cotangent's dg, du and the interleaved weight's gate and up rows.

The grouped kernels' calls (grouped_fwd, its gated form grouped_fwd_gated, grouped_dgrad,
grouped_wgrad) are CUDA-only: they
take rows already laid out group by group with their int32 table
(jax_cake.primitives.grouped, which also runs the XLA path elsewhere).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_cake import reference
from jax_cake.contract import (  # the FFI target names and codes, defined once
    ACTIVATION_CODES,
    DGRAD_GATE_UP_TARGET,
    DGRAD_GATED_TARGET,
    DGRAD_TARGET,
    FWD_GATED_TARGET,
    FWD_RESIDUAL_TARGET,
    FWD_TARGET,
    GATE_BLOCK,
    GROUPED_DGRAD_TARGET,
    GROUPED_FWD_GATED_TARGET,
    GROUPED_FWD_TARGET,
    GROUPED_WGRAD_TARGET,
    ROUTER_DGRAD_TARGET,
    ROUTER_FWD_TARGET,
    ROUTER_WGRAD_TARGET,
    WGRAD_ACCUMULATE_TARGET,
    WGRAD_TARGET,
)
from jax_cake.planner import router_variants  # plain data, no cutlass
from jax_cake.planner import Plan

# The router handlers take no cluster or raster attributes (docs/ffi_contract.md).
_ROUTER_ATTRIBUTES = ("tile_m", "tile_n", "tile_k", "splits", "reduction")

# Prefix of the FFI target names the custom calls name: "" is the default library; another
# build registered with `native.register_build(path, prefix)` runs what is traced under
# `targets_from(prefix)` (two builds side by side in one process).
_target_prefix: contextvars.ContextVar[str] = contextvars.ContextVar("jax_cake_target_prefix", default="")


@contextlib.contextmanager
def targets_from(prefix: str):
    """Custom calls traced inside name the targets `<prefix><target>` (another build)."""
    token = _target_prefix.set(prefix)
    try:
        yield
    finally:
        _target_prefix.reset(token)


@functools.cache
def _gpu_present() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def result_type(operand, shape, dtype, keep_batch_spec: bool = True):
    """The operand's type (sharding, varying manual axes) with a new shape and dtype.

    The leading batch axis keeps the operand's sharding spec; the other axes are
    unsharded, as the custom call computes them whole.
    """
    aval = jax.typeof(operand)
    spec = aval.sharding.spec
    lead = (spec[0] if len(spec) else None,) if keep_batch_spec else (None,)
    sharding = aval.sharding.update(spec=jax.sharding.PartitionSpec(*lead, *([None] * (len(shape) - 1))))
    return aval.update(shape=shape, dtype=jnp.dtype(dtype), sharding=sharding)


def ffi_call(target: str, plan: Plan, results, *operands, input_output_aliases=None, **attributes):
    """One custom call of `target` with the plan as attributes (and `attributes`, the
    target's own): registers the library's targets first (GPU processes), names
    `<prefix><target>` under `targets_from`, and aliases operands to results where asked
    (a buffer the kernel adds into)."""
    prefix = _target_prefix.get()
    if _gpu_present() and not prefix:
        from jax_cake import native  # only a GPU process needs the library

        native.ensure_registered()
    attributes = {**plan.ffi_attributes(), **attributes}
    if target.startswith("jax_cake_router_"):
        attributes = {name: attributes[name] for name in _ROUTER_ATTRIBUTES}
    # vmap_method=None: batching the custom call itself is an error. Every GEMM has a
    # custom_vmap rule (jax_cake.primitives.batching) that maps a vmapped batch onto the
    # kernels' token or batch axis, so a vmap never reaches this call (no sequential loop).
    call = jax.ffi.ffi_call(prefix + target, results, vmap_method=None, input_output_aliases=input_output_aliases)
    return call(*operands, **attributes)


def dispatch(plan: Plan, ref_fn, cuda_fn, *operands, xla_cuda_fn=None):
    """cuda_fn on CUDA and ref_fn elsewhere for a kernel plan; for an XLA plan ref_fn, or
    xla_cuda_fn on CUDA where given (XLA's own form of the same values)."""
    if not plan.uses_kernel:
        if xla_cuda_fn is None:
            return ref_fn(*operands)
        return jax.lax.platform_dependent(*operands, default=ref_fn, cuda=xla_cuda_fn)
    return jax.lax.platform_dependent(*operands, default=ref_fn, cuda=cuda_fn)


# --- the "store" epilogue ------------------------------------------------------------------


def fwd(x, w, plan: Plan):
    b, t, _ = x.shape
    d_out = w.shape[1]

    def cuda(x, w):
        return ffi_call(FWD_TARGET, plan, result_type(x, (b, t, d_out), jnp.bfloat16), x, w)

    return dispatch(plan, reference.fwd, cuda, x, w)


def dgrad(dy, w, plan: Plan):
    b, t, _ = dy.shape
    d_in = w.shape[2]

    def cuda(dy, w):
        return ffi_call(DGRAD_TARGET, plan, result_type(dy, (b, t, d_in), jnp.bfloat16), dy, w)

    return dispatch(plan, reference.dgrad, cuda, dy, w)


def wgrad(dy, x, plan: Plan):
    b, _, d_out = dy.shape
    d_in = x.shape[2]

    def ref(dy, x):
        return reference.wgrad(dy, x, plan.out_dtype)

    def cuda(dy, x):
        results = (
            result_type(dy, (b, d_out, d_in), plan.out_dtype),
            result_type(dy, (plan.workspace_bytes,), jnp.uint8, keep_batch_spec=False),
        )
        dw, _workspace = ffi_call(WGRAD_TARGET, plan, results, dy, x)
        return dw

    return dispatch(plan, ref, cuda, dy, x)


def router_ffi_operands(program: str, a, b) -> list:
    """The FFI operands of one router program for logical FP32 operands a, b.

    The small, reused operands (w, g) go to the kernel pre-split as bf16 (hi, lo), once per
    call here (router_variants.PRESPLIT); the activation x stays FP32 and is split on chip.
    Under one jit, XLA computes g's split once for both gradients (common subexpression).
    """
    a_pre, b_pre = router_variants.PRESPLIT[program]
    operands = []
    for v, pre in ((a, a_pre), (b, b_pre)):
        operands.extend(reference.split_bf16x3(v) if pre else (v,))
    return operands


def _xla_bf16x3(contract_a: int, contract_b: int):
    """a . b for FP32 a, b as ONE XLA dot with the BF16x3 algorithm
    (DotAlgorithmPreset.BF16_BF16_F32_X3: hi*hi + hi*lo + lo*hi in FP32, the reference's
    products in one fused GEMM that reads each FP32 operand once, where the reference runs
    three dots over split copies): the router's XLA plan on CUDA."""
    dims = (((contract_a,), (contract_b,)), ((), ()))
    preset = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3
    return lambda a, b: jax.lax.dot_general(a, b, dims, precision=preset, preferred_element_type=jnp.float32)


def router_fwd(x, w, plan: Plan):
    def cuda(x, w):
        result = result_type(x, (x.shape[0], w.shape[0]), jnp.float32)
        return ffi_call(ROUTER_FWD_TARGET, plan, result, *router_ffi_operands("fwd", x, w))

    return dispatch(plan, reference.router_fwd, cuda, x, w, xla_cuda_fn=_xla_bf16x3(1, 1))


def router_dgrad(g, w, plan: Plan):
    def cuda(g, w):
        result = result_type(g, (g.shape[0], w.shape[1]), jnp.float32)
        return ffi_call(ROUTER_DGRAD_TARGET, plan, result, *router_ffi_operands("dgrad", g, w))

    return dispatch(plan, reference.router_dgrad, cuda, g, w, xla_cuda_fn=_xla_bf16x3(1, 0))


def router_wgrad(g, x, plan: Plan):
    def cuda(g, x):
        results = (
            result_type(g, (g.shape[1], x.shape[1]), jnp.float32, keep_batch_spec=False),
            result_type(g, (plan.workspace_bytes,), jnp.uint8, keep_batch_spec=False),
        )
        dw, _workspace = ffi_call(ROUTER_WGRAD_TARGET, plan, results, *router_ffi_operands("wgrad", g, x))
        return dw

    return dispatch(plan, reference.router_wgrad, cuda, g, x, xla_cuda_fn=_xla_bf16x3(0, 0))


# --- the "gated" epilogue: the pre-activation and the gated activation --------------------


def fwd_gated(x, w, plan: Plan, activation: str):
    """(h [B, T, F], gu [B, T, 2F]) bf16: gu = x . w^T over w's interleaved gate and up rows
    (reference.interleave), h = reference.gate(g, u) (a plan for op "fwd_gated")."""
    b, t, _ = x.shape
    d_out = w.shape[1]

    def ref(x, w):
        gu = reference.fwd(x, w)
        return reference.gate(*reference.deinterleave(gu, -1, GATE_BLOCK), activation), gu

    def cuda(x, w):
        results = (
            result_type(x, (b, t, d_out), jnp.bfloat16),
            result_type(x, (b, t, d_out // 2), jnp.bfloat16),
        )
        gu, h = ffi_call(FWD_GATED_TARGET, plan, results, x, w, activation=np.int64(ACTIVATION_CODES[activation]))
        return h, gu

    return dispatch(plan, ref, cuda, x, w)


def dgrad_gated(dy, w, gu, plan: Plan, activation: str):
    """d_gu [2, B, T, F] bf16, the planes (dg, du) = reference.gate_grad(dh, g, u): dh =
    dy . w (w [B, d_out, F]) rounded to bf16, g and u from the pre-activation gu [B, T, 2F]
    (interleaved in blocks of contract.GATE_BLOCK; a plan for op "dgrad_gated")."""

    def ref(dy, w, gu):
        g, u = reference.deinterleave(gu, -1, GATE_BLOCK)
        return jnp.stack(reference.gate_grad(reference.dgrad(dy, w), g, u, activation))

    def cuda(dy, w, gu):
        b, t, two_f = gu.shape
        result = result_type(dy, (2, b, t, two_f // 2), jnp.bfloat16, keep_batch_spec=False)
        return ffi_call(DGRAD_GATED_TARGET, plan, result, dy, w, gu, activation=np.int64(ACTIVATION_CODES[activation]))

    return dispatch(plan, ref, cuda, dy, w, gu)


def dgrad_gate_up(dg, du, w, plan: Plan):
    """dx [B, T, d_in] bf16 = dg . Wg + du . Wu for dg, du [B, T, F] and w [B, 2F, d_in]
    (gate and up rows interleaved in blocks of contract.GATE_BLOCK): one GEMM over K = 2F
    (a plan for op "dgrad_gate_up")."""
    b, t, _ = dg.shape

    def ref(dg, du, w):
        return reference.dgrad(reference.interleave(dg, du, -1, GATE_BLOCK), w)

    def cuda(dg, du, w):
        result = result_type(dg, (b, t, w.shape[2]), jnp.bfloat16)
        return ffi_call(DGRAD_GATE_UP_TARGET, plan, result, dg, du, w)

    return dispatch(plan, ref, cuda, dg, du, w)


STORE = {
    "fwd": fwd,
    "dgrad": dgrad,
    "wgrad": wgrad,
    "router_fwd": router_fwd,
    "router_dgrad": router_dgrad,
    "router_wgrad": router_wgrad,
}


# --- the "add" epilogue: the result added into c's buffer (aliased) -----------------------


def fwd_add(x, w, r, plan: Plan):
    """bf16(r + bf16(x . w^T)) in r's buffer (a plan for op "fwd_residual")."""
    b, t, _ = x.shape
    d_out = w.shape[1]

    def ref(x, w, r):
        return reference.add_into(r, reference.fwd(x, w))

    def cuda(x, w, r):
        result = result_type(r, (b, t, d_out), jnp.bfloat16)
        return ffi_call(FWD_RESIDUAL_TARGET, plan, result, x, w, r, input_output_aliases={2: 0})

    return dispatch(plan, ref, cuda, x, w, r)


def wgrad_add(dy, x, acc, plan: Plan):
    """acc + dy^T . x in FP32, in acc's buffer (a plan for op "wgrad_accumulate")."""
    b, _, d_out = dy.shape
    d_in = x.shape[2]

    def ref(dy, x, acc):
        return reference.add_into(acc, reference.wgrad(dy, x, "float32"))

    def cuda(dy, x, acc):
        results = (
            result_type(acc, (b, d_out, d_in), jnp.float32),
            result_type(acc, (plan.workspace_bytes,), jnp.uint8, keep_batch_spec=False),
        )
        new_sum, _workspace = ffi_call(WGRAD_ACCUMULATE_TARGET, plan, results, dy, x, acc, input_output_aliases={2: 0})
        return new_sum

    return dispatch(plan, ref, cuda, dy, x, acc)


# The planner's op name of each fused-add kernel, and the call that runs it.
ADD = {"fwd": ("fwd_residual", fwd_add), "wgrad": ("wgrad_accumulate", wgrad_add)}


# --- the grouped kernels (CUDA only: jax_cake.primitives.grouped lays out their rows) -----


def grouped_fwd(x, w, table, plan: Plan):
    """y [M, N] bf16 = x [M, K] . w[table[t]]^T for each 128-row tile t with rows (x's rows
    laid out group by group, w [G, N, K] bf16); the other tiles are not written."""
    return ffi_call(GROUPED_FWD_TARGET, plan, result_type(x, (x.shape[0], w.shape[1]), jnp.bfloat16), x, w, table)


def grouped_fwd_gated(x, w, table, plan: Plan, activation: str):
    """(h [M, F], gu [M, 2F]) bf16: gu = x [M, K] . w[table[t]]^T for each 128-row tile t
    with rows (w [G, 2F, K] bf16, each group's gate and up rows interleaved in blocks of
    contract.GATE_BLOCK) and h = reference.gate(g, u) from it (a plan for op
    "grouped_fwd_gated"); the other tiles are not written."""
    m, two_f = x.shape[0], w.shape[1]
    results = (result_type(x, (m, two_f), jnp.bfloat16), result_type(x, (m, two_f // 2), jnp.bfloat16))
    gu, h = ffi_call(
        GROUPED_FWD_GATED_TARGET, plan, results, x, w, table, activation=np.int64(ACTIVATION_CODES[activation])
    )
    return h, gu


def grouped_dgrad(dy, w, table, plan: Plan):
    """dx [M, K] bf16 = dy [M, N] . w[table[t]] for each 128-row tile t with rows; the other
    tiles are not written."""
    return ffi_call(GROUPED_DGRAD_TARGET, plan, result_type(dy, (dy.shape[0], w.shape[2]), jnp.bfloat16), dy, w, table)


def grouped_wgrad(dy, x, table, plan: Plan):
    """dw [G, N, K] in plan.out_dtype, dw[g] = the FP32 sum over the rows of K tiles
    [table[g], table[g + 1]) of dy [M, N]^T . x [M, K] (G = plan.groups; 0 for an empty
    group)."""
    result = result_type(dy, (plan.groups, dy.shape[1], x.shape[1]), plan.out_dtype, keep_batch_spec=False)
    return ffi_call(GROUPED_WGRAD_TARGET, plan, result, dy, x, table)
