"""Projections of one input by several weights (QKV, gate/up, MLA, skinny heads): one
launch per GEMM instead of one per weight.

With D = sum_i d_out_i and W = the weights' bf16 casts stacked along d_out ([D, d_in]):

- forward: ONE fwd GEMM y = x @ W.T ([T, D]); each y_i is a column slice of y. The cast
  of an FP32 master to bf16 is a pass XLA runs anyway, and the stacking happens inside
  that same fusion (it writes W instead of the separate casts: no extra bytes).
- backward: dy = the dy_i side by side ([T, D], bf16). dx is ONE dgrad GEMM dy @ W over
  K = D (one FP32 sum, rounded once: no per-weight partial dx and no adds). Where some
  d_out_i is narrow (memory bound: skinny heads, MLA ranks), the weight gradient is ONE
  wgrad GEMM dy.T @ x (x read once) whose [D, d_in] result is split into the dw_i by
  rows; it writes FP32 when any w_i is FP32 (an FP32 master gets its gradient straight
  from the accumulator; a bf16 w_i gets that FP32 sum rounded once) and bf16 when every
  w_i is bf16. Where every d_out_i is at least WIDE_D_OUT (compute bound: reading x once
  per weight costs little next to the FLOPs), each dw_i is its own wgrad GEMM written
  straight into dw_i's buffer in w_i's dtype: one wgrad over D would write a [D, d_in]
  buffer that the split then copies (2 x 470 MB at gate/up 4096 -> 2 x 14336, FP32).

The three plans are made from the summed shape (tokens T, d_in, d_out = D), as the
projection pipeline's (jax_cake.pipeline.projection.plans).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_cake import primitives
from jax_cake.pipeline import projection
from jax_cake.pipeline.sharded_vjp import sharded_vjp
from jax_cake.planner import device as device_lib
from jax_cake.planner import plan as make_plan

_BF16 = jnp.bfloat16
# From this d_out up a wgrad is compute bound (docs/planner.md): one wgrad per weight.
WIDE_D_OUT = 512


def _stack_bf16(ws):
    """[D, d_in] bf16: the weights' casts side by side along d_out (one fusion in XLA)."""
    return jnp.concatenate([w.astype(_BF16) for w in ws], axis=0)


def _wgrad_dtype(w_dtypes: tuple[str, ...]) -> str:
    return "bfloat16" if all(d == "bfloat16" for d in w_dtypes) else "float32"


def _split_columns(y, widths: tuple[int, ...]):
    out, start = [], 0
    for width in widths:
        out.append(jax.lax.slice_in_dim(y, start, start + width, axis=-1))
        start += width
    return tuple(out)


def stacked_plans(x3, w_cat, deterministic: bool, w_dtypes: tuple[str, ...]):
    """(forward, input-grad, weight-grad) plans of the GEMMs over the stacked weight
    w_cat [D, d_in] (the weight-grad plan writes FP32 when any weight is FP32)."""
    return projection.plans(x3, w_cat[None], projection.Options(deterministic, _wgrad_dtype(w_dtypes)))


def _wgrad_plan(x3, w_cat, d_out: int, deterministic: bool, out_dtype: str):
    """The plan of one weight's own wgrad (tokens and d_in from x3, the device as the
    fused call's)."""
    b, t, d_in = x3.shape
    return make_plan(
        "wgrad",
        tokens=t,
        d_in=d_in,
        d_out=d_out,
        batch=b,
        out_dtype=out_dtype,
        deterministic=deterministic,
        device=device_lib.current(x3, w_cat),
    )


def _forward(options: tuple[bool, tuple[str, ...]], x3, *ws):
    deterministic, w_dtypes = options
    w_cat = _stack_bf16(ws)
    fwd_plan, _, _ = stacked_plans(x3, w_cat, deterministic, w_dtypes)
    y = primitives.fwd(x3, w_cat[None], fwd_plan)
    return _split_columns(y, tuple(w.shape[0] for w in ws)), (x3, w_cat)


def weight_gradients(x3, w_cat, dy, parts, split, *, deterministic: bool, w_dtypes: tuple[str, ...], w_specs):
    """The weights' gradients (dw_i in w_i's dtype) over one x3 [1, T, d_in].

    dy [1, T, D]: the cotangent of the stacked GEMM's output (its columns in w_cat's row
    order); parts: the per-weight cotangents dy_i [1, T, d_out_i]; split: dw [D, d_in] ->
    the dw_i (w_cat's row order undone). Every d_out_i >= WIDE_D_OUT: one wgrad per weight
    from parts, straight into w_i's dtype; else ONE wgrad over D from dy, split by rows
    (module docstring). w_specs: each weight's PartitionSpec under Explicit axes (static),
    else None: each gradient is asked for in its weight's sharding (sharded_vjp reshards
    the cotangents to them).
    """
    if min(d.shape[-1] for d in parts) >= WIDE_D_OUT:
        dws = [
            primitives.wgrad(
                d.astype(_BF16),
                x3,
                _wgrad_plan(x3, w_cat, d.shape[-1], deterministic, dtype),
                deterministic=deterministic,
                out_sharding=None if spec is None else P(None, *spec),
            )[0]
            for d, dtype, spec in zip(parts, w_dtypes, w_specs)
        ]
    else:
        _, _, wgrad_plan = stacked_plans(x3, w_cat, deterministic, w_dtypes)
        dw = primitives.wgrad(dy, x3, wgrad_plan, deterministic=deterministic)[0]  # [D, d_in], the plan's dtype
        dws = [piece.astype(dtype) for piece, dtype in zip(split(dw), w_dtypes)]
    return tuple(dws)


def _split_rows(dw, widths: tuple[int, ...]):
    out, start = [], 0
    for width in widths:
        out.append(jax.lax.slice_in_dim(dw, start, start + width, axis=0))
        start += width
    return tuple(out)


def _backward(options: tuple[bool, tuple[str, ...]], specs, saved, dys):
    deterministic, w_dtypes = options
    x_spec, *w_specs = specs
    x3, w_cat = saved
    _, dgrad_plan, _ = stacked_plans(x3, w_cat, deterministic, w_dtypes)
    dys = tuple(d.astype(_BF16) for d in dys)
    dy = jnp.concatenate(dys, axis=-1)
    dx = primitives.dgrad(dy, w_cat[None], dgrad_plan, out_sharding=x_spec)
    widths = tuple(d.shape[-1] for d in dys)
    dws = weight_gradients(
        x3,
        w_cat,
        dy,
        dys,
        lambda dw: _split_rows(dw, widths),
        deterministic=deterministic,
        w_dtypes=w_dtypes,
        w_specs=tuple(w_specs),
    )
    return (dx, *dws)


_fused = sharded_vjp(_forward, _backward)


def project_fused(x3, ws, *, deterministic: bool) -> tuple:
    """(y3_i [1, T, d_out_i] bf16 for w_i in ws) of validated x3 [1, T, d_in] bf16 and
    weights ws[i] [d_out_i, d_in]."""
    w_dtypes = tuple(jnp.dtype(w.dtype).name for w in ws)
    return _fused((deterministic, w_dtypes), x3, *ws)
