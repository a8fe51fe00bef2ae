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
import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_cake import batching, partitioning, reference
from jax_cake.contract import (  # the FFI target names, defined once
    DGRAD_TARGET,
    FWD_RESIDUAL_TARGET,  # noqa: F401 (its call is made in jax_cake.residual)
    FWD_TARGET,
    ROUTER_DGRAD_TARGET,
    ROUTER_FWD_TARGET,
    ROUTER_WGRAD_TARGET,
    WGRAD_TARGET,
)
from jax_cake.planner import router_variants  # plain data, no cutlass
from jax_cake.planner import Plan
from jax_cake.planner import device as device_lib
from jax_cake.planner import plan as make_plan

# The router handlers take no cluster or raster attributes (docs/ffi_contract.md).
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


def ffi_call(target: str, plan: Plan, results, *operands, input_output_aliases=None):
    """One custom call of `target` with the plan as attributes: registers the library's
    targets first (GPU processes), names `<prefix><target>` under `targets_from`, and
    aliases operands to results where asked (a buffer the kernel adds into)."""
    prefix = _target_prefix.get()
    if _gpu_present() and not prefix:
        from jax_cake import native  # only a GPU process needs the library

        native.ensure_registered()
    attributes = plan.ffi_attributes()
    if target.startswith("jax_cake_router_"):
        attributes = {name: attributes[name] for name in _ROUTER_ATTRIBUTES}
    # vmap_method=None: batching the custom call itself is an error. Every primitive below
    # has a custom_vmap rule (jax_cake.batching) that maps a vmapped batch onto the
    # kernels' token or batch axis, so a vmap never reaches this call (no sequential loop).
    call = jax.ffi.ffi_call(prefix + target, results, vmap_method=None, input_output_aliases=input_output_aliases)
    return call(*operands, **attributes)


def _dispatch(plan: Plan, ref_fn, cuda_fn, *operands):
    if not plan.uses_kernel:
        return ref_fn(*operands)
    return jax.lax.platform_dependent(*operands, default=ref_fn, cuda=cuda_fn)


# --- one GEMM on whole (or per-shard) operands, with a given plan ----------------------


def _fwd(x, w, plan: Plan):
    b, t, _ = x.shape
    d_out = w.shape[1]

    def cuda(x, w):
        return ffi_call(FWD_TARGET, plan, _result_type(x, (b, t, d_out), jnp.bfloat16), x, w)

    return _dispatch(plan, reference.fwd, cuda, x, w)


def _dgrad(dy, w, plan: Plan):
    b, t, _ = dy.shape
    d_in = w.shape[2]

    def cuda(dy, w):
        return ffi_call(DGRAD_TARGET, plan, _result_type(dy, (b, t, d_in), jnp.bfloat16), dy, w)

    return _dispatch(plan, reference.dgrad, cuda, dy, w)


def _wgrad(dy, x, plan: Plan):
    b, _, d_out = dy.shape
    d_in = x.shape[2]

    def ref(dy, x):
        return reference.wgrad(dy, x, plan.out_dtype)

    def cuda(dy, x):
        results = (
            _result_type(dy, (b, d_out, d_in), plan.out_dtype),
            _result_type(dy, (plan.workspace_bytes,), jnp.uint8, keep_batch_spec=False),
        )
        dw, _workspace = ffi_call(WGRAD_TARGET, plan, results, dy, x)
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


def _router_fwd(x, w, plan: Plan):
    def cuda(x, w):
        result = _result_type(x, (x.shape[0], w.shape[0]), jnp.float32)
        return ffi_call(ROUTER_FWD_TARGET, plan, result, *router_ffi_operands("fwd", x, w))

    return _dispatch(plan, reference.router_fwd, cuda, x, w)


def _router_dgrad(g, w, plan: Plan):
    def cuda(g, w):
        result = _result_type(g, (g.shape[0], w.shape[1]), jnp.float32)
        return ffi_call(ROUTER_DGRAD_TARGET, plan, result, *router_ffi_operands("dgrad", g, w))

    return _dispatch(plan, reference.router_dgrad, cuda, g, w)


def _router_wgrad(g, x, plan: Plan):
    def cuda(g, x):
        results = (
            _result_type(g, (g.shape[1], x.shape[1]), jnp.float32, keep_batch_spec=False),
            _result_type(g, (plan.workspace_bytes,), jnp.uint8, keep_batch_spec=False),
        )
        dw, _workspace = ffi_call(ROUTER_WGRAD_TARGET, plan, results, *router_ffi_operands("wgrad", g, x))
        return dw

    return _dispatch(plan, reference.router_wgrad, cuda, g, x)


_KERNELS = {
    "fwd": _fwd,
    "dgrad": _dgrad,
    "wgrad": _wgrad,
    "router_fwd": _router_fwd,
    "router_dgrad": _router_dgrad,
    "router_wgrad": _router_wgrad,
}


def sizes(op: str, a_shape, b_shape) -> dict:
    """The planner's sizes (tokens, d_in, d_out[, batch]) of GEMM `op` on operand shapes.

    By position, not by role: fwd(a [B, M, K], b [B, N, K]), dgrad(a [B, M, N], b [B, N, K]),
    wgrad(a [B, T, N], b [B, T, K]); the router ones the same without B.
    """
    lead = a_shape[:1] if not op.startswith("router_") else ()
    a2, b2 = a_shape[len(lead) :], b_shape[len(lead) :]
    if op.endswith("fwd"):
        out = dict(tokens=a2[0], d_in=a2[1], d_out=b2[0])
    else:  # dgrad and wgrad: a is [tokens, d_out], b's last axis is d_in
        out = dict(tokens=a2[0], d_out=a2[1], d_in=b2[1])
    if lead:
        out["batch"] = lead[0]
    return out


@dataclasses.dataclass(frozen=True)
class Local:
    """One GEMM (`op`) with the plan made at trace time for the whole operands.

    Called with a device, it plans again for the operands it is given (the per-shard or
    vmap-folded shapes) on that device; `reduce_dtype` (a wgrad that a psum follows) makes
    the result in that dtype (FP32) so partial sums are added before the one rounding.
    Frozen and hashable: it is a static argument of custom_partitioning.
    """

    op: str
    plan: Plan
    deterministic: bool

    @property
    def out_dtype(self):
        return jnp.dtype(self.plan.out_dtype)

    def replan(self, a_shape, b_shape, device, out_dtype=None) -> Plan:
        kwargs = dict(sizes(self.op, a_shape, b_shape), device=device)
        if self.op == "wgrad" or self.op.startswith("router_"):
            kwargs["out_dtype"] = out_dtype if out_dtype is not None else self.out_dtype
        if self.op.endswith("wgrad"):
            kwargs["deterministic"] = self.deterministic
        return make_plan(self.op, **kwargs)

    def for_shapes(self, a_shape, b_shape, device) -> "Local":
        return dataclasses.replace(self, plan=self.replan(a_shape, b_shape, device))

    def __call__(self, a, b, device=None, reduce_dtype=None):
        plan = self.plan
        if reduce_dtype is not None and self.op not in ("wgrad",):
            reduce_dtype = None  # fwd/dgrad kernels write bf16; the router writes FP32
        if device is not None or reduce_dtype is not None:
            plan = self.replan(a.shape, b.shape, device or device_lib.current(a, b), reduce_dtype)
        return _KERNELS[self.op](a, b, plan)


def _manual(*arrays) -> bool:
    """Inside shard_map over every mesh axis: the operands are already per-shard."""
    for a in arrays:
        mesh = jax.typeof(a).sharding.mesh
        if not mesh.empty and all(t == jax.sharding.AxisType.Manual for t in mesh.axis_types):
            return True
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and all(t == jax.sharding.AxisType.Manual for t in mesh.axis_types)


def _one_device() -> bool:
    """Nothing to partition: one device in the process, or a one-device mesh in scope."""
    mesh = jax.sharding.get_abstract_mesh()
    return jax.device_count() == 1 or (not mesh.empty and mesh.size == 1)


def call_sharded(local: Local, a, b, out_sharding=None):
    """local(a, b) on whatever sharding a and b have (no vmap here: see `call`)."""
    mesh = partitioning.explicit_mesh(a, b)
    if mesh is not None:
        device = device_lib.current(a, b)
        return partitioning.explicit_call(local.op, local, a, b, mesh=mesh, device=device, out_request=out_sharding)
    if _manual(a, b) or _one_device():
        return local(a, b)
    return partitioning.partitioned_call(local.op, local, a, b)


def call(local: Local, a, b, out_sharding=None):
    """local(a, b): sharded by jax_cake.partitioning, vmapped by jax_cake.batching."""
    return batching.vmappable(local, a, b, out_sharding)


def _public(op: str, a, b, plan: Plan, deterministic, out_sharding):
    if deterministic is None:
        deterministic = plan.deterministic
    return call(Local(op, plan, bool(deterministic)), a, b, out_sharding)


# --- the primitives ------------------------------------------------------------------------
# Each takes the Plan made at trace time for its whole operands. Under jit on a mesh the
# GEMM is partitioned (jax_cake.partitioning) and each shard plans again for its own shape;
# under vmap the batch folds into the kernels' token or batch axis (jax_cake.batching).
# out_sharding (a PartitionSpec, Explicit axes only) asks for the result's sharding: it
# turns a psum into a reduce-scatter where the rule allows; the caller reshards to it.
# deterministic (wgrad): what the caller asked for, for the per-shard plans (default: the
# plan's own).


def fwd(x, w, plan: Plan, *, out_sharding=None):
    """y[B, T, d_out] bf16 = x[B, T, d_in] . w[B, d_out, d_in]^T (bf16 operands)."""
    return _public("fwd", x, w, plan, True, out_sharding)


def fwd_residual(x, w, r, plan: Plan):
    """y[B, T, d_out] bf16 = bf16(r + bf16(x[B, T, d_in] . w[B, d_out, d_in]^T)): the
    forward with the residual r[B, T, d_out] added by the kernel in r's buffer (the plan
    from jax_cake.planner.residual.plan_residual). See jax_cake.residual.fwd_residual."""
    from jax_cake import residual  # it builds on this module

    return residual.fwd_residual(x, w, r, plan)


def dgrad(dy, w, plan: Plan, *, out_sharding=None):
    """dx[B, T, d_in] bf16 = dy[B, T, d_out] . w[B, d_out, d_in]."""
    return _public("dgrad", dy, w, plan, True, out_sharding)


def wgrad(dy, x, plan: Plan, *, deterministic: bool | None = None, out_sharding=None):
    """dw[B, d_out, d_in] in plan.out_dtype = dy[B, T, d_out]^T . x[B, T, d_in]."""
    return _public("wgrad", dy, x, plan, deterministic, out_sharding)


def router_fwd(x, w, plan: Plan, *, out_sharding=None):
    """logits[T, E] f32 = x[T, d] . w[E, d]^T by BF16x3."""
    return _public("router_fwd", x, w, plan, True, out_sharding)


def router_dgrad(g, w, plan: Plan, *, out_sharding=None):
    """dx[T, d] f32 = g[T, E] . w[E, d] by BF16x3."""
    return _public("router_dgrad", g, w, plan, True, out_sharding)


def router_wgrad(g, x, plan: Plan, *, deterministic: bool | None = None, out_sharding=None):
    """dw[E, d] f32 = g[T, E]^T . x[T, d] by BF16x3."""
    return _public("router_wgrad", g, x, plan, deterministic, out_sharding)
