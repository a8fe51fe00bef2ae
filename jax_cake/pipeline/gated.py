"""The gated projection (SwiGLU / GeGLU): h = act(x Wg^T) * (x Wu^T), one custom_vjp whose
forward GEMM carries the "gated" epilogue.

With Wg, Wu [F, d_in] (kept apart, as the user stores them) and W = their bf16 casts
interleaved by rows in blocks of 16 ([2F, d_in]: rows 32j .. 32j + 15 are Wg[16j ..
16j + 15], the next 16 the same rows of Wu; jax_cake.reference.interleave), or row by row
(block 1) where 16 does not divide F or the operands need partitioning (`_block`); the
cast of an FP32 master is a pass XLA runs anyway, and the interleave happens inside that
fusion:

- forward: ONE fwd GEMM gu = x W^T ([T, 2F] bf16: the pre-activation, each column the
  FP32 accumulator rounded once) with the gated epilogue h = bf16(act(g) * u)
  (jax_cake.reference.gate; primitives.fwd_gated): inside the kernel where the planner
  has a gated variant (jax_cake.planner.gated), else an XLA elementwise pass right after
  the GEMM, with the same values.
- saved for the backward: x, the weights as given (no copy) and gu, named
  jax_cake.remat.PREACTIVATION_NAME, so a remat policy can keep it (else the backward
  runs the forward GEMM again).
- backward: (dg, du) = jax_cake.reference.gate_grad(dh, g, u) (bf16, from the saved
  bf16 g, u); dx is ONE dgrad GEMM over K = 2F that reads dg, du and W's gate and up rows
  in place (primitives.dgrad_gate_up; elsewhere over dg, du interleaved as W's rows); dWg and dWu
  come from jax_cake.pipeline.fused.weight_gradients (one wgrad over 2F split by rows,
  or one wgrad per weight where F >= WIDE_D_OUT), each in its weight's dtype straight
  from the FP32 accumulator.

The MLP (swiglu_mlp: y = [r +] h Wd^T) is one more custom_vjp here where the down
projection's dgrad kernel with the activation gradient in its epilogue is planned
(`fused_mlp_plan`, jax_cake.planner.gated.plan_gate_grad): the forward is the gated GEMM
and the down projection's forward GEMM (the residual in its epilogue); the backward's dg
and du come straight from that dgrad kernel (it reads the saved gu; dh never reaches
memory) as the two planes of one array, dWd is the wgrad of dy and the saved h, and dx and
dWg, dWu are the composition's: ONE dgrad over K = 2F reading dg and du in place, one wgrad
per weight.
Elsewhere the MLP is the gated projection followed by the projection pipeline's down
projection, with the same values up to the FP32 rounding of the activation.

Why interleaved, not [Wg; Wu] stacked (fused_projections' layout): with d_ff sharded
(Wg and Wu column-parallel on F) the interleave is row by row, so any shard of the
interleaved W is exactly the rows of that shard's Wg and Wu, so the stacked weight, gu,
its cotangent and dW are all sharded on their 2F axis with no data moved (the stacked
[Wg; Wu] would put a shard's gate and up rows in two distant blocks: XLA would reshuffle
the weight). Inside shard_map each shard interleaves its own rows. In every 32-column
sub-tile of the kernel's accumulator the 16 gate columns and their 16 up columns sit at
the same register positions of the same threads: what the epilogue needs.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_cake import contract, primitives, reference
from jax_cake.pipeline import fused, projection
from jax_cake.pipeline.sharded_vjp import sharded_vjp
from jax_cake.planner import device as device_lib
from jax_cake.planner import plan as make_plan
from jax_cake.planner.gated import GATE_GRAD_OP, plan_gate_grad, plan_gate_up_dgrad, plan_gated
from jax_cake.planner.plan_type import Plan
from jax_cake.primitives import partitioning

_BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Options:
    """The static options of one gated projection (hashable: a nondiff argument)."""

    deterministic: bool
    activation: str  # one of reference.ACTIVATIONS
    w_dtypes: tuple[str, str]  # the gate's and up's dtype names: their gradients' dtypes
    block: int = 1  # the gate/up interleave's block (_block)


def stack(w_gate, w_up, block: int):
    """W [2F, d_in] bf16: the weights' casts interleaved by rows (one fusion in XLA)."""
    return reference.interleave(w_gate.astype(_BF16), w_up.astype(_BF16), 0, block)


def _gated_forward(x3, w_gate, w_up, options: Options):
    """(h, gu): the gated forward GEMM and its epilogue."""
    w = stack(w_gate, w_up, options.block)
    b, t, d_in = x3.shape
    fwd_plan = plan_gated(
        tokens=t, d_in=d_in, d_out=w.shape[0], activation=options.activation, batch=b, device=device_lib.current(x3, w)
    )
    return primitives.fwd_gated(x3, w[None], fwd_plan, options.activation, options.block)


def _forward(options: Options, x3, w_gate, w_up):
    h, gu = _gated_forward(x3, w_gate, w_up, options)
    return h, (x3, w_gate, w_up, gu)  # gu is named for the remat policies (primitives.fwd_gated)


def _backward(options: Options, specs, saved, dh):
    x3, w_gate, w_up, gu = saved
    g, u = reference.deinterleave(gu, -1, options.block)
    dg, du = reference.gate_grad(dh.astype(_BF16), g, u, options.activation)
    return _gate_up_grads(x3, w_gate, w_up, dg, du, options, specs)


_gated = sharded_vjp(_forward, _backward)


def _gate_up_grads(x3, w_gate, w_up, dg, du, options: Options, specs):
    """(dx, dw_gate, dw_up) from the pre-activation's cotangent, its halves dg, du [1, T,
    F]: dx is ONE dgrad GEMM over K = 2F that reads them in place
    (primitives.dgrad_gate_up), the weights' gradients come from fused.weight_gradients."""
    det, w_dtypes = options.deterministic, options.w_dtypes
    w = stack(w_gate, w_up, options.block)
    b, t, d_in = x3.shape
    # The rule's dgrad over K = 2F: the plan table's tile rows timed the plain dgrad's kernels.
    sizes = dict(tokens=t, d_in=d_in, d_out=w.shape[0], batch=b, device=device_lib.current(x3, w))
    dgrad_plan = plan_gate_up_dgrad(make_plan("dgrad", **sizes, tile_rows=False), options.block)
    x_spec, *w_specs = specs[:3]  # x's, w_gate's and w_up's under Explicit axes
    dx = primitives.dgrad_gate_up(dg, du, w[None], dgrad_plan, options.block, out_sharding=x_spec)
    # The cotangent whole in W's row order, for the one wgrad over 2F where F is narrow
    # (XLA drops it where each weight gets its own wgrad).
    d_gu = reference.interleave(dg, du, -1, options.block)
    dw_gate, dw_up = fused.weight_gradients(
        x3,
        w,
        d_gu,
        (dg, du),
        lambda dw: reference.deinterleave(dw, 0, options.block),
        deterministic=det,
        w_dtypes=w_dtypes,
        w_specs=tuple(w_specs),
    )
    return dx, dw_gate, dw_up


def _block(x3, w_gate, w_up) -> int:
    """The interleave's block: the gated kernel's (contract.GATE_BLOCK) where that kernel
    can run, on operands that need no partitioning (one device, or inside shard_map), with
    d_ff a multiple of it; else 1, which keeps any d_ff shard's gate and up rows in one
    shard of the stack (the sharded GEMMs then run the forward and an XLA pass for h)."""
    if w_gate.shape[0] % contract.GATE_BLOCK == 0 and partitioning.unpartitioned(x3, w_gate, w_up):
        return contract.GATE_BLOCK
    return 1


def _options(x3, w_gate, w_up, activation: str, deterministic: bool) -> Options:
    return Options(
        deterministic=deterministic,
        activation=activation,
        w_dtypes=(jnp.dtype(w_gate.dtype).name, jnp.dtype(w_up.dtype).name),
        block=_block(x3, w_gate, w_up),
    )


def project_gated(x3, w_gate, w_up, *, activation: str, deterministic: bool):
    """h3 [1, T, F] bf16 of validated x3 [1, T, d_in] bf16 and w_gate, w_up [F, d_in] (bf16
    or FP32 masters)."""
    return _gated(_options(x3, w_gate, w_up, activation, deterministic), x3, w_gate, w_up)


# --- the MLP: the gated projection and the down projection in one custom_vjp ---------------


@dataclasses.dataclass(frozen=True)
class MlpOptions:
    """The static options of one fused MLP (hashable: a nondiff argument)."""

    gated: Options
    down: projection.Options  # the down projection's (w_down's dtype, the residual epilogue)
    gate_grad: Plan  # the down projection's dgrad with the gradient epilogue (fused_mlp_plan)


def _mlp_forward(options: MlpOptions, x3, w_gate, w_up, w_down3, r3):
    wd3 = w_down3.astype(_BF16)
    h, gu = _gated_forward(x3, w_gate, w_up, options.gated)
    fwd_plan, _, _ = projection.plans(h, wd3, options.down)
    y = primitives.fwd(h, wd3, fwd_plan, add_to=r3)
    return y, (x3, w_gate, w_up, wd3, h, gu)  # h and gu are named (primitives.fwd_gated)


def _mlp_backward(options: MlpOptions, specs, saved, dy):
    x3, w_gate, w_up, wd3, h, gu = saved
    dy = dy.astype(_BF16)
    _, _, down_wgrad_plan = projection.plans(h, wd3, options.down)
    # The down projection's dgrad with the activation's gradient in its epilogue: dg and du
    # straight from the kernel (dh is never written), the two contiguous planes of one array.
    dg, du = primitives.dgrad_gated(dy, wd3, gu, options.gate_grad, options.gated.activation, options.gated.block)
    dw_down = primitives.wgrad(dy, h, down_wgrad_plan, deterministic=options.down.deterministic)
    dx, dw_gate, dw_up = _gate_up_grads(x3, w_gate, w_up, dg, du, options.gated, specs)
    return dx, dw_gate, dw_up, dw_down, (dy if options.down.residual else None)


_mlp = sharded_vjp(_mlp_forward, _mlp_backward)


def fused_mlp_plan(x3, w_gate, w_up, w_down3, r3=None, *, activation: str) -> Plan | None:
    """The plan of the down projection's dgrad with the activation gradient in its
    epilogue where project_mlp runs the MLP as one custom_vjp (where that kernel is
    planned, on operands that need no partitioning), else None (the composition)."""
    others = (w_down3,) if r3 is None else (w_down3, r3)
    if _block(x3, w_gate, w_up) != contract.GATE_BLOCK or not partitioning.unpartitioned(*others):
        return None
    plan = plan_gate_grad(
        tokens=x3.shape[1],
        d_ff=w_gate.shape[0],
        d_out=w_down3.shape[1],
        activation=activation,
        batch=x3.shape[0],
        device=device_lib.current(x3, w_down3),
    )
    return plan if plan.op == GATE_GRAD_OP else None


def project_mlp(x3, w_gate, w_up, w_down3, r3, *, activation: str, deterministic: bool):
    """y3 [1, T, d_out] bf16 = [r3 +] gated(x3) w_down^T for validated operands (w_down3
    [1, d_out, F], r3 None or [1, T, d_out] bf16): one custom_vjp where fused_mlp_plan, else the
    gated projection followed by the projection pipeline's down projection (the same
    values up to the FP32 rounding of the activation)."""
    gated = _options(x3, w_gate, w_up, activation, deterministic)
    gate_grad = fused_mlp_plan(x3, w_gate, w_up, w_down3, r3, activation=activation)
    if gate_grad is None:
        h3 = _gated(gated, x3, w_gate, w_up)
        return projection.project(h3, w_down3, deterministic=deterministic, residual=r3)
    down = projection.Options(
        deterministic=deterministic, w_dtype=jnp.dtype(w_down3.dtype).name, residual=r3 is not None
    )
    return _mlp(MlpOptions(gated, down, gate_grad), x3, w_gate, w_up, w_down3, r3)
