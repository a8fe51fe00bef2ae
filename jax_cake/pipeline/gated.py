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
  bf16 g, u), interleaved as W's rows; dx is ONE dgrad GEMM over K = 2F; dWg and dWu
  come from jax_cake.pipeline.fused.weight_gradients (one wgrad over 2F split by rows,
  or one wgrad per weight where F >= WIDE_D_OUT), each in its weight's dtype straight
  from the FP32 accumulator.

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
import functools

import jax
import jax.numpy as jnp

from jax_cake import contract, primitives, reference
from jax_cake.pipeline import fused
from jax_cake.planner import device as device_lib
from jax_cake.planner.gated import plan_gated
from jax_cake.primitives import partitioning

_BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Options:
    """The static options of one gated projection (hashable: a nondiff argument)."""

    deterministic: bool
    activation: str  # one of reference.ACTIVATIONS
    w_dtypes: tuple[str, str]  # the gate's and up's dtype names: their gradients' dtypes
    w_specs: tuple | None = None  # the weights' PartitionSpecs under Explicit axes, else None
    block: int = 1  # the gate/up interleave's block (_block)


def stack(w_gate, w_up, block: int):
    """W [2F, d_in] bf16: the weights' casts interleaved by rows (one fusion in XLA)."""
    return reference.interleave(w_gate.astype(_BF16), w_up.astype(_BF16), 0, block)


def _forward(x3, w_gate, w_up, options: Options):
    w = stack(w_gate, w_up, options.block)
    b, t, d_in = x3.shape
    fwd_plan = plan_gated(
        tokens=t, d_in=d_in, d_out=w.shape[0], activation=options.activation, batch=b, device=device_lib.current(x3, w)
    )
    return primitives.fwd_gated(x3, w[None], fwd_plan, options.activation, options.block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gated(x3, w_gate, w_up, options: Options):
    return _forward(x3, w_gate, w_up, options)[0]


def _gated_fwd(x3, w_gate, w_up, options):
    h, gu = _forward(x3, w_gate, w_up, options)
    return h, (x3, w_gate, w_up, gu)  # gu is named for the remat policies (primitives.fwd_gated)


def _gated_bwd(options, saved, dh):
    x3, w_gate, w_up, gu = saved
    det, w_dtypes = options.deterministic, options.w_dtypes
    w = stack(w_gate, w_up, options.block)
    _, dgrad_plan, _ = fused.stacked_plans(x3, w, det, w_dtypes)
    g, u = reference.deinterleave(gu, -1, options.block)
    dg, du = reference.gate_grad(dh.astype(_BF16), g, u, options.activation)
    d_gu = reference.interleave(dg, du, -1, options.block)  # [1, T, 2F] bf16, W's row order
    (x_spec,) = partitioning.explicit_specs(x3) or (None,)
    dx = primitives.dgrad(d_gu, w[None], dgrad_plan, out_sharding=x_spec)
    dw_gate, dw_up = fused.weight_gradients(
        x3,
        w,
        d_gu,
        (dg, du),
        lambda dw: reference.deinterleave(dw, 0, options.block),
        deterministic=det,
        w_dtypes=w_dtypes,
        w_specs=options.w_specs,
    )
    (dx,) = partitioning.as_primal_types((dx,), (x3,))
    return dx, dw_gate, dw_up


_gated.defvjp(_gated_fwd, _gated_bwd)


def _block(x3, w_gate, w_up) -> int:
    """The interleave's block: the gated kernel's (contract.GATE_BLOCK) where that kernel
    can run, on operands that need no partitioning (one device, or inside shard_map), with
    d_ff a multiple of it; else 1, which keeps any d_ff shard's gate and up rows in one
    shard of the stack (the sharded GEMMs then run the forward and an XLA pass for h)."""
    if w_gate.shape[0] % contract.GATE_BLOCK == 0 and partitioning.unpartitioned(x3, w_gate, w_up):
        return contract.GATE_BLOCK
    return 1


def project_gated(x3, w_gate, w_up, *, activation: str, deterministic: bool):
    """h3 [1, T, F] bf16 of validated x3 [1, T, d_in] bf16 and w_gate, w_up [F, d_in] (bf16
    or FP32 masters), made varying over the same manual axes inside shard_map."""
    x3, w_gate, w_up = partitioning.to_common_varying(x3, w_gate, w_up)
    specs = partitioning.explicit_specs(w_gate, w_up)
    options = Options(
        deterministic=deterministic,
        activation=activation,
        w_dtypes=(jnp.dtype(w_gate.dtype).name, jnp.dtype(w_up.dtype).name),
        w_specs=None if specs is None else tuple(specs),
        block=_block(x3, w_gate, w_up),
    )
    return _gated(x3, w_gate, w_up, options)
