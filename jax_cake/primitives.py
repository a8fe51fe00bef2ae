"""One function per GEMM: an XLA FFI custom call on CUDA, the XLA reference elsewhere.

Each takes a Plan (static, made at trace time). A Plan on the XLA backend runs the
reference everywhere. A kernel Plan lowers through `jax.lax.platform_dependent`: the
CUDA lowering is one `jax.ffi.ffi_call` with the Plan as attributes, any other platform
the reference with the same semantics. Result types are built from the operand's type,
so under shard_map they carry the per-shard shape and varying axes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

from jax_cake import reference
from jax_cake.planner import router_variants  # plain data, no cutlass
from jax_cake.planner import Plan

from jax_cake.contract import (  # the FFI target names, defined once
    DGRAD_TARGET,
    FWD_TARGET,
    ROUTER_DGRAD_TARGET,
    ROUTER_FWD_TARGET,
    ROUTER_WGRAD_TARGET,
    WGRAD_ACCUMULATE_TARGET,  # noqa: F401 (its primitive is still to come)
    WGRAD_TARGET,
)

# The router handlers take no cluster or raster attributes (docs/FFI_CONTRACT.md).
_ROUTER_ATTRIBUTES = ("tile_m", "tile_n", "tile_k", "splits", "reduction")

# Prefix of the FFI target names the custom calls name: "" is the default library; another
# build registered with `native.register_build(path, prefix)` runs what is traced under
# `targets_from(prefix)` (jax_cake.tools.compare_builds).
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


def _result_type(operand, shape, dtype, keep_batch_spec: bool = True):
    """The operand's type (sharding, varying manual axes) with a new shape and dtype.

    The leading batch axis keeps the operand's sharding spec; the other axes are
    unsharded, as the custom call computes them whole.
    """
    aval = jax.typeof(operand)
    spec = aval.sharding.spec
    lead = (spec[0] if len(spec) else None,) if keep_batch_spec else (None,)
    sharding = aval.sharding.update(spec=jax.sharding.PartitionSpec(*lead, *([None] * (len(shape) - 1))))
    return aval.update(shape=shape, dtype=jnp.dtype(dtype), sharding=sharding)


def _ffi(target: str, plan: Plan, results, *operands):
    prefix = _target_prefix.get()
    if _gpu_present() and not prefix:
        from jax_cake import native  # only a GPU process needs the library

        native.ensure_registered()
    attributes = plan.ffi_attributes()
    if target.startswith("jax_cake_router_"):
        attributes = {name: attributes[name] for name in _ROUTER_ATTRIBUTES}
    # vmap of a custom call: one call per batch element (correct; fold batches into T for speed).
    return jax.ffi.ffi_call(prefix + target, results, vmap_method="sequential")(*operands, **attributes)


def _dispatch(plan: Plan, ref_fn, cuda_fn, *operands):
    if not plan.uses_kernel:
        return ref_fn(*operands)
    return jax.lax.platform_dependent(*operands, default=ref_fn, cuda=cuda_fn)


def fwd(x, w, plan: Plan):
    """y[B, T, d_out] bf16 = x[B, T, d_in] . w[B, d_out, d_in]^T (bf16 operands)."""
    b, t, _ = x.shape
    d_out = w.shape[1]

    def cuda(x, w):
        return _ffi(FWD_TARGET, plan, _result_type(x, (b, t, d_out), jnp.bfloat16), x, w)

    return _dispatch(plan, reference.fwd, cuda, x, w)


def dgrad(dy, w, plan: Plan):
    """dx[B, T, d_in] bf16 = dy[B, T, d_out] . w[B, d_out, d_in]."""
    b, t, _ = dy.shape
    d_in = w.shape[2]

    def cuda(dy, w):
        return _ffi(DGRAD_TARGET, plan, _result_type(dy, (b, t, d_in), jnp.bfloat16), dy, w)

    return _dispatch(plan, reference.dgrad, cuda, dy, w)


def wgrad(dy, x, plan: Plan):
    """dw[B, d_out, d_in] in plan.out_dtype = dy[B, T, d_out]^T . x[B, T, d_in]."""
    b, _, d_out = dy.shape
    d_in = x.shape[2]

    def ref(dy, x):
        return reference.wgrad(dy, x, plan.out_dtype)

    def cuda(dy, x):
        results = (
            _result_type(dy, (b, d_out, d_in), plan.out_dtype),
            _result_type(dy, (plan.workspace_bytes,), jnp.uint8, keep_batch_spec=False),
        )
        dw, _workspace = _ffi(WGRAD_TARGET, plan, results, dy, x)
        return dw

    return _dispatch(plan, ref, cuda, dy, x)


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


def router_fwd(x, w, plan: Plan):
    """logits[T, E] f32 = x[T, d] . w[E, d]^T by BF16x3."""

    def cuda(x, w):
        result = _result_type(x, (x.shape[0], w.shape[0]), jnp.float32)
        return _ffi(ROUTER_FWD_TARGET, plan, result, *router_ffi_operands("fwd", x, w))

    return _dispatch(plan, reference.router_fwd, cuda, x, w)


def router_dgrad(g, w, plan: Plan):
    """dx[T, d] f32 = g[T, E] . w[E, d] by BF16x3."""

    def cuda(g, w):
        result = _result_type(g, (g.shape[0], w.shape[1]), jnp.float32)
        return _ffi(ROUTER_DGRAD_TARGET, plan, result, *router_ffi_operands("dgrad", g, w))

    return _dispatch(plan, reference.router_dgrad, cuda, g, w)


def router_wgrad(g, x, plan: Plan):
    """dw[E, d] f32 = g[T, E]^T . x[T, d] by BF16x3."""

    def cuda(g, x):
        results = (
            _result_type(g, (g.shape[1], x.shape[1]), jnp.float32, keep_batch_spec=False),
            _result_type(g, (plan.workspace_bytes,), jnp.uint8, keep_batch_spec=False),
        )
        dw, _workspace = _ffi(ROUTER_WGRAD_TARGET, plan, results, *router_ffi_operands("wgrad", g, x))
        return dw

    return _dispatch(plan, reference.router_wgrad, cuda, g, x)
