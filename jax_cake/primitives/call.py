"""The GEMM calls the pipeline makes: (GEMM role, plan, epilogue) -> one custom call,
with its sharding rule (jax_cake.primitives.partitioning) and its vmap rule
(jax_cake.primitives.batching) around it.

Each public function takes the Plan made at trace time for its whole operands. Under jit
on a mesh the GEMM is partitioned and each shard plans again for its own shape; under
vmap the batch folds into the kernels' token or batch axis. out_sharding (a
PartitionSpec, Explicit axes only) asks for the result's sharding: it turns a psum into
a reduce-scatter where the rule allows; the caller reshards to it. deterministic
(wgrad): what the caller asked for, for the per-shard plans (default: the plan's own).
add_to (fwd, wgrad): the "add" epilogue, the result added into that operand.
fwd_gated: the forward GEMM with the "gated" epilogue (SwiGLU / GeGLU), over gate and up
rows interleaved (reference.interleave); dgrad_gated: the down projection's dgrad with
that activation's gradient in its epilogue; dgrad_gate_up: the gated projection's dx from
the halves of its cotangent.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from jax_cake import logs, reference, remat
from jax_cake.contract import GATE_BLOCK
from jax_cake.planner import Plan
from jax_cake.planner import device as device_lib
from jax_cake.planner import plan as make_plan
from jax_cake.planner.accumulate import plan_accumulate
from jax_cake.planner.residual import plan_residual
from jax_cake.primitives import batching, gemm, partitioning

# The plan of each GEMM role's "add" epilogue, for given sizes and device.
_ADD_PLANNERS = {"fwd": plan_residual, "wgrad": plan_accumulate}


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


def _store_plan(op: str, a_shape, b_shape, device, out_dtype, deterministic: bool) -> Plan:
    """The plan of the "store" GEMM `op` on operands of these shapes (out_dtype: wgrad's and
    the router's; deterministic: the weight gradients')."""
    kwargs = dict(sizes(op, a_shape, b_shape), device=device)
    if op == "wgrad" or op.startswith("router_"):
        kwargs["out_dtype"] = out_dtype
    if op.endswith("wgrad"):
        kwargs["deterministic"] = deterministic
    return make_plan(op, **kwargs)


@dataclasses.dataclass(frozen=True)
class PlannedGemm:
    """One GEMM (`op`, `epilogue`) with the plan made at trace time for the whole operands.

    Called with a device, it plans again for the operands it is given (the per-shard or
    vmap-folded shapes) on that device; `reduce_dtype` (a wgrad that a psum follows) makes
    the result in that dtype (FP32) so partial sums are added before the one rounding.
    Frozen and hashable: it is a static argument of custom_partitioning.
    """

    op: str
    plan: Plan
    deterministic: bool
    epilogue: str = "store"

    @property
    def out_dtype(self):
        return jnp.dtype(self.plan.out_dtype)

    def replan(self, a_shape, b_shape, device, out_dtype=None) -> Plan:
        if self.epilogue == "add":
            return _ADD_PLANNERS[self.op](**sizes(self.op, a_shape, b_shape), device=device)
        out_dtype = out_dtype if out_dtype is not None else self.out_dtype
        return _store_plan(self.op, a_shape, b_shape, device, out_dtype, self.deterministic)

    def for_shapes(self, a_shape, b_shape, device) -> "PlannedGemm":
        return dataclasses.replace(self, plan=self.replan(a_shape, b_shape, device))

    def __call__(self, a, b, device=None, reduce_dtype=None):
        """The "store" GEMM on operands as they are (whole, or one shard). reduce_dtype:
        the result is one shard's partial sum, made in that dtype (FP32) so that the sum
        over the shards is rounded once."""
        plan = self.plan
        if reduce_dtype is not None and self.op in ("fwd", "dgrad"):
            logs.once(
                logging.INFO,
                "jax_cake: %s %s is a partial sum over a sharded contraction; it runs XLA's dot with FP32 output "
                "(the %s kernels write bf16) so the shards' partials are summed in FP32 and rounded once",
                self.op,
                f"{tuple(a.shape)} x {tuple(b.shape)}",
                self.op,
            )
            return getattr(reference, self.op)(a, b, reduce_dtype)
        if reduce_dtype is not None and self.op != "wgrad":
            reduce_dtype = None  # the router writes FP32 already
        if device is not None or reduce_dtype is not None:
            plan = self.replan(a.shape, b.shape, device or device_lib.current(a, b), reduce_dtype)
        return gemm.STORE[self.op](a, b, plan)


def call_sharded(planned: PlannedGemm, a, b, out_sharding=None):
    """planned(a, b) on whatever sharding a and b have (no vmap here: see `call`)."""
    mesh = partitioning.explicit_mesh(a, b)
    if mesh is not None:
        device = device_lib.current(a, b)
        return partitioning.explicit_call(planned.op, planned, a, b, mesh=mesh, device=device, out_request=out_sharding)
    if partitioning.unpartitioned(a, b) or any(map(jax.export.is_symbolic_dim, a.shape + b.shape)):
        # (custom_partitioning lowers static shapes only; a shape-polymorphic export's
        # GEMM is planned on the XLA path, which XLA partitions itself)
        return planned(a, b)
    return partitioning.partitioned_call(planned.op, planned, a, b)


def _add_unbatched(planned: PlannedGemm, a, b, c):
    """The "add" epilogue on unbatched operands: the fused custom call where it has a plan
    and nothing needs partitioning (it has no partitioning rule), else the partitioned
    "store" GEMM and then the add, with the same values."""
    fused_op, fused_call = gemm.ADD[planned.op]
    plan = planned.plan
    if plan.op == fused_op and partitioning.unpartitioned(a, b, c):
        return fused_call(a, b, c, plan)
    if plan.op == fused_op:  # the kernel plan of the fused add, but the operands need partitioning
        out = {"out_dtype": "float32"} if planned.op == "wgrad" else {}
        plan = make_plan(planned.op, **sizes(planned.op, a.shape, b.shape), **out, device=device_lib.current(a, b))
    store = PlannedGemm(planned.op, plan, plan.deterministic)
    if planned.op == "wgrad":
        # The sum takes the running sum's sharding (the sum's type is its cotangent's):
        # under Explicit axes dw is asked for in it.
        specs = partitioning.explicit_specs(a, b, c)
        if specs is None:
            return reference.add_into(c, call_sharded(store, a, b))
        dw = call_sharded(store, a, b, out_sharding=specs[2]).astype(jnp.float32)
        return reference.add_into(c, partitioning.reshard_to(dw, specs[2]))
    # fwd: the sum takes the product's sharding; the residual is resharded to it.
    y = call_sharded(store, a, b)
    if partitioning.explicit_mesh(c, y) is not None:
        c = partitioning.reshard_to(c, jax.typeof(y).sharding.spec)
    return reference.add_into(c, y)


def call(planned: PlannedGemm, a, b, c=None, out_sharding=None):
    """planned's GEMM on a, b (and the add epilogue's c): sharded by
    jax_cake.primitives.partitioning, vmapped by jax_cake.primitives.batching's fold."""

    def run(a, b, c):  # the GEMM on folded operands, planned for their shapes (nested vmap too)
        return call(planned.for_shapes(a.shape, b.shape, device_lib.current(a, b)), a, b, c)

    if c is None:

        @custom_vmap
        def gemm_call(a, b):
            return call_sharded(planned, a, b, out_sharding)

        @gemm_call.def_vmap
        def rule(axis_size, in_batched, a, b):
            return batching.fold(planned.op, axis_size, tuple(in_batched), run, a, b), True

        return gemm_call(a, b)

    @custom_vmap
    def add_call(a, b, c):
        return _add_unbatched(planned, a, b, c)

    @add_call.def_vmap
    def add_rule(axis_size, in_batched, a, b, c):
        return batching.fold(planned.op, axis_size, tuple(in_batched), run, a, b, c), True

    return add_call(a, b, c)


def _public(op: str, a, b, plan: Plan, deterministic, out_sharding, add_to=None):
    if deterministic is None:
        deterministic = plan.deterministic
    epilogue = "store" if add_to is None else "add"
    # The addend's dtype and Explicit spec: its cotangent's type (static, so the addend itself
    # is not kept for a second-order backward, which would cost the fused add its buffer).
    addend = None
    if add_to is not None:
        (spec,) = partitioning.explicit_specs(add_to) or (None,)
        addend = (jnp.dtype(add_to.dtype).name, spec)
    return _role(PlannedGemm(op, plan, bool(deterministic), epilogue), out_sharding, addend, a, b, add_to)


# --- second order: the gradient of a GEMM role is the other two roles ----------------------
#
# Each role is linear in each operand, so reverse-over-reverse autodiff (the gradient of a
# pipeline's backward: a Hessian-vector product, a gradient penalty) runs the kernels'
# roles again with the cotangent in the place of one operand:
#
#   fwd    y = a b^T  (a [B, T, K], b [B, N, K]):  da = dgrad(g, b),  db = wgrad(g, a)
#   dgrad  y = a b    (a [B, T, N], b [B, N, K]):  da = fwd(g, b),    db = wgrad(a, g)
#   wgrad  y = a^T b  (a [B, T, N], b [B, T, K]):  da = fwd(b, g),    db = dgrad(a, g)
#
# (the router's roles the same in FP32 by BF16x3, without B); the "add" epilogue's addend
# gets g. Each cotangent is made in its operand's dtype and, under Explicit axes, sharding.


def _run_role(op: str, a, b, out_dtype, deterministic: bool, out_sharding):
    plan = _store_plan(op, a.shape, b.shape, device_lib.current(a, b), out_dtype, deterministic)
    return _public(op, a, b, plan, deterministic, out_sharding)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _role(planned: PlannedGemm, out_sharding, addend, a, b, c):
    del addend
    return call(planned, a, b, c, out_sharding)


def _role_fwd(planned, out_sharding, addend, a, b, c):
    del addend
    return call(planned, a, b, c, out_sharding), (a, b)


def _role_bwd(planned, out_sharding, addend, saved, g):
    del out_sharding
    a, b = saved
    prefix = "router_" if planned.op.startswith("router_") else ""
    role = planned.op.removeprefix(prefix)
    # The router's roles are FP32 throughout; the bf16 roles take a bf16 cotangent (the
    # addend's cotangent is g itself, in the addend's dtype and spec).
    a_spec, b_spec = partitioning.explicit_specs(a, b) or (None, None)
    dc = None if addend is None else partitioning.to_specs((g.astype(addend[0]),), (addend[1],))[0]
    g = g.astype(a.dtype)

    def run(op, p, q, out_dtype, spec):
        return _run_role(prefix + op, p, q, out_dtype, planned.deterministic, spec)

    if role == "fwd":
        da, db = run("dgrad", g, b, a.dtype, a_spec), run("wgrad", g, a, b.dtype, b_spec)
    elif role == "dgrad":
        da, db = run("fwd", g, b, a.dtype, a_spec), run("wgrad", a, g, b.dtype, b_spec)
    else:
        da, db = run("fwd", b, g, a.dtype, a_spec), run("dgrad", a, g, b.dtype, b_spec)
    da, db = partitioning.to_specs((da.astype(a.dtype), db.astype(b.dtype)), (a_spec, b_spec))
    return da, db, dc


_role.defvjp(_role_fwd, _role_bwd)


# --- the primitives ------------------------------------------------------------------------


def fwd(x, w, plan: Plan, *, out_sharding=None, add_to=None):
    """y[B, T, d_out] bf16 = x[B, T, d_in] . w[B, d_out, d_in]^T (bf16 operands).

    add_to: None, or a bf16 residual r[B, T, d_out]: y = bf16(r + bf16(x . w^T)), added by
    the kernel in r's buffer for a plan of op "fwd_residual"
    (jax_cake.planner.residual.plan_residual), else by the plain forward and an add."""
    return _public("fwd", x, w, plan, True, out_sharding, add_to)


def fused_or(fused_call, fallback, out_batched, *operands):
    """fused_call(*operands), one custom call of a fused kernel on unbatched operands that
    need no partitioning; otherwise, and under vmap (the rule maps the fallback, so the
    batch folds into its GEMMs), fallback(*operands), its unfused form: the same values up
    to the FP32 rounding of an activation (the gated epilogues) or the FP32 order of a sum
    (dgrad_gate_up). out_batched: the vmap rule's batched-ness of the result (a bool per
    output)."""

    @custom_vmap
    def call(*operands):
        if not partitioning.unpartitioned(*operands):
            return fallback(*operands)
        return fused_call(*operands)

    @call.def_vmap
    def rule(axis_size, in_batched, *operands):
        in_axes = tuple(0 if b else None for b in in_batched)
        return jax.vmap(fallback, in_axes=in_axes, axis_size=axis_size)(*operands), out_batched

    # Differentiated (only reverse-over-reverse reaches here: a pipeline's custom_vjp
    # differentiates it once) through the unfused form: its GEMM roles and XLA's
    # elementwise gradient of the epilogue (the unfused forward runs again in that
    # backward: a cost of second order only).
    @jax.custom_vjp
    def differentiable(*operands):
        return call(*operands)

    def differentiable_fwd(*operands):
        return call(*operands), operands

    def differentiable_bwd(operands, cotangent):
        return jax.vjp(fallback, *operands)[1](cotangent)

    differentiable.defvjp(differentiable_fwd, differentiable_bwd)
    return differentiable(*operands)


def fwd_gated(x, w, plan: Plan, activation: str, block: int, *, out_sharding=None):
    """(h, gu): the forward GEMM with the "gated" epilogue.

    w [B, 2F, d_in] bf16 holds the gate and up rows interleaved in blocks of `block` rows
    (reference.interleave, axis 1); gu [B, T, 2F] bf16 = x . w^T is the pre-activation in that order (g = bf16(x
    Wg^T), u = bf16(x Wu^T)); h [B, T, F] = reference.gate(g, u, activation) = bf16(act(g)
    * u). gu is named remat.PREACTIVATION_NAME.

    For a plan of op "fwd_gated" (jax_cake.planner.gated.plan_gated) on operands that need
    no partitioning, one custom call writes gu and h from the accumulator tile (h is then
    named remat.ACTIVATION_NAME: it cannot be recomputed without the GEMM). Otherwise, and
    under vmap or a partitioning rule, the "store" GEMM writes gu and an XLA elementwise
    pass makes h from it (under a remat policy that saves gu, h is recomputed from it
    elementwise, without the GEMM); both give the same values up to the FP32 rounding of
    the activation."""
    store_plan = plan.unfused() if plan.op == "fwd_gated" else plan

    def store_then_gate(x, w):
        gu = remat.name_preactivation(fwd(x, w, store_plan, out_sharding=out_sharding))
        return reference.gate(*reference.deinterleave(gu, -1, block), activation), gu

    if plan.op != "fwd_gated" or out_sharding is not None or block != GATE_BLOCK:
        return store_then_gate(x, w)

    def gated_call(x, w):
        h, gu = gemm.fwd_gated(x, w, plan, activation)
        return remat.name_activation(h), remat.name_preactivation(gu)

    return fused_or(gated_call, store_then_gate, (True, True), x, w)


def dgrad_gated(dy, w, gu, plan: Plan, activation: str, block: int, *, out_sharding=None):
    """(dg, du), each [B, T, F] bf16: the down projection's input gradient dh = dy . w (w
    [B, d_out, F]) carried through the gated activation, reference.gate_grad(dh, g, u) of
    the saved pre-activation gu [B, T, 2F] (gate and up interleaved in blocks of `block`).

    For a plan of op "dgrad_gated" (jax_cake.planner.gated.plan_gate_grad) on operands
    that need no partitioning, one custom call: the kernel's epilogue reads gu and writes
    dg and du as the two planes of one [2, B, T, F] array (each plane contiguous, so the
    GEMMs that read dg and du can take them where they lie), and dh never reaches memory. Otherwise,
    and under vmap or a partitioning rule, the "store" dgrad writes dh and an XLA
    elementwise pass makes dg and du from it; both give the same values up to the FP32
    rounding of the activation."""
    store_plan = plan.unfused()

    def dgrad_then_gate(dy, w, gu):
        dh = dgrad(dy, w, store_plan, out_sharding=out_sharding)
        return reference.gate_grad(dh, *reference.deinterleave(gu, -1, block), activation)

    if plan.op != "dgrad_gated" or out_sharding is not None or block != GATE_BLOCK:
        return dgrad_then_gate(dy, w, gu)

    def fused_call(dy, w, gu):
        d_gu = gemm.dgrad_gated(dy, w, gu, plan, activation)
        return d_gu[0], d_gu[1]

    return fused_or(fused_call, dgrad_then_gate, (True, True), dy, w, gu)


def dgrad_gate_up(dg, du, w, plan: Plan, block: int, *, out_sharding=None):
    """dx[B, T, d_in] bf16 = dg . Wg + du . Wu: the gated projection's input gradient from
    the halves of its pre-activation's cotangent, dg and du [B, T, F] bf16, and w [B, 2F,
    d_in], the gate and up rows interleaved in blocks of `block` (reference.interleave).

    For a plan of op "dgrad_gate_up" (jax_cake.planner.gated.plan_gate_up_dgrad) on
    operands that need no partitioning, one custom call over K = 2F reads dg, du and w's
    gate and up rows in place. Otherwise, and under vmap or a partitioning rule, XLA
    interleaves dg and du into w's row order and the plain dgrad runs over that; both
    give the same sum up to the FP32 order of its terms."""
    store_plan = plan.unfused()

    def interleave_then_dgrad(dg, du, w):
        return dgrad(reference.interleave(dg, du, -1, block), w, store_plan, out_sharding=out_sharding)

    if plan.op != "dgrad_gate_up" or out_sharding is not None or block != GATE_BLOCK:
        return interleave_then_dgrad(dg, du, w)

    def fused_call(dg, du, w):
        return gemm.dgrad_gate_up(dg, du, w, plan)

    return fused_or(fused_call, interleave_then_dgrad, True, dg, du, w)


def dgrad(dy, w, plan: Plan, *, out_sharding=None):
    """dx[B, T, d_in] bf16 = dy[B, T, d_out] . w[B, d_out, d_in]."""
    return _public("dgrad", dy, w, plan, True, out_sharding)


def wgrad(dy, x, plan: Plan, *, deterministic: bool | None = None, out_sharding=None, add_to=None):
    """dw[B, d_out, d_in] in plan.out_dtype = dy[B, T, d_out]^T . x[B, T, d_in].

    add_to: None, or an FP32 running sum acc[B, d_out, d_in]: returns acc + dw in FP32,
    added by the kernel in acc's buffer for a plan of op "wgrad_accumulate"
    (jax_cake.planner.accumulate.plan_accumulate), else by a wgrad and an add."""
    return _public("wgrad", dy, x, plan, deterministic, out_sharding, add_to)


def router_fwd(x, w, plan: Plan, *, out_sharding=None):
    """logits[T, E] f32 = x[T, d] . w[E, d]^T by BF16x3."""
    return _public("router_fwd", x, w, plan, True, out_sharding)


def router_dgrad(g, w, plan: Plan, *, out_sharding=None):
    """dx[T, d] f32 = g[T, E] . w[E, d] by BF16x3."""
    return _public("router_dgrad", g, w, plan, True, out_sharding)


def router_wgrad(g, x, plan: Plan, *, deterministic: bool | None = None, out_sharding=None):
    """dw[E, d] f32 = g[T, E]^T . x[T, d] by BF16x3."""
    return _public("router_wgrad", g, x, plan, deterministic, out_sharding)
