"""The public ops: dense, batched, fused and gated projections, the SwiGLU MLP, the FP32
router GEMM and the grouped (ragged) projections of MoE experts (grouped_projection and
ragged_dot, a drop-in for jax.lax.ragged_dot).

Each op validates its arguments (jax_cake.pipeline.validation: a bad argument raises a
TypeError or ValueError naming it, at trace time, before anything runs), brings them to
the batched GEMM convention and hands them to its pipeline (jax_cake.pipeline), which
plans every GEMM at trace time from static shapes, dtypes and the device and runs them
inside one `jax.custom_vjp`. Each output is named for the remat policies
(jax_cake.remat).

The options of the projections are epilogues of their GEMMs: `residual=` adds into the
forward GEMM's output, `grad_accumulator=` into the weight gradient's; the gated
projection's activation is its forward GEMM's "gated" epilogue (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_cake import logs, remat
from jax_cake.pipeline import fused, gated, grouped, moe, projection, router, validation
from jax_cake.primitives import partitioning


@dataclasses.dataclass(frozen=True, eq=False)
class _ProjectionCall:
    """A validated dense_projection or batched_projection call in the batched GEMM
    convention (x3 [B, T, d_in], w3 [B, d_out, d_in]), with its epilogue options."""

    fn: str  # the op's name, for the errors
    x3: Any
    w3: Any
    deterministic: bool
    residual: Any  # as given (None: no residual)
    r3: Any  # the residual in the GEMM convention, [B, T, d_out]
    acc3: Any  # None, or the running sum of w's gradient in the GEMM convention
    out_request: Any  # None, or the PartitionSpec asked of y3 where y3 has it as it is
    out_sharding: Any  # None, or validation.check_out_sharding's (spec, sharding)
    to_y: Callable[[Any], Any]  # y3 -> y in the caller's layout


def _run_projection(call: _ProjectionCall):
    """The validated projection with its epilogue options."""
    if call.acc3 is not None:
        validation.check_accumulator_varying(call.fn, call.x3, call.w3, call.acc3)
    # The residual goes into the forward GEMM's epilogue unless the output is resharded
    # or the call accumulates: then it is added to the finished output.
    fuse_residual = call.residual is not None and call.acc3 is None and call.out_sharding is None
    y3 = projection.project(
        call.x3,
        call.w3,
        deterministic=call.deterministic,
        residual=call.r3 if fuse_residual else None,
        accumulator=call.acc3,
        out_request=call.out_request,
    )
    y = partitioning.apply_out_sharding(call.to_y(y3), call.out_sharding)
    if call.residual is not None and not fuse_residual:
        y = projection.add_residual(call.residual, remat.name_output(y))
    return remat.name_output(y)


def dense_projection(x, w, *, deterministic: bool = True, grad_accumulator=None, out_sharding=None, residual=None):
    """y = x @ w.T with BF16 operands and FP32 accumulation.

    Args:
      x: [..., d_in] bfloat16 activations (any number of leading token dimensions).
      w: [d_out, d_in] bfloat16 or float32 weight. A float32 weight is a master weight:
        it is rounded to bfloat16 for the products, and its gradient is float32, written
        from the kernel's FP32 accumulator (no bfloat16 rounding).
      deterministic: keyword-only. True (default): bitwise identical results on every
        run for the same inputs, shapes and GPU. False: the planner may pick a faster
        split-K program whose weight-gradient sum order can vary, where measured faster.
      grad_accumulator: keyword-only, None (default) or a float32 array of w's shape: the
        running sum of w's gradient over micro-batches. Given, the backward adds this
        call's dw into it inside the wgrad kernel (in place under jit, bitwise
        reproducible): the cotangent of grad_accumulator is `grad_accumulator + dw` and
        w's is zero, so `jax.grad(loss, argnums=<the sums>)` returns the new sums (a
        lax.scan over micro-batches carries them). Give a sum to one call per loss;
        under shard_map it must vary over the manual axes x varies over (one partial
        sum per shard). See README's Gradient accumulation.
      out_sharding: keyword-only, None (default), a PartitionSpec (with a mesh set by
        `jax.set_mesh`) or a NamedSharding: the sharding of y. None: the sharding rule's
        (jax_cake.primitives.partitioning): the tokens keep x's sharding, d_out w's where x does not
        use that mesh axis. Given, y is resharded to it (Explicit axes) or constrained to
        it (Auto axes), and a reduction over a sharded d_in becomes a reduce-scatter where
        the asked-for sharding allows one.
      residual: keyword-only, None (default) or a bfloat16 array of y's shape [...,
        d_out]: returns residual + x @ w.T. The forward kernel adds its bf16 tiles into
        the residual's buffer (in place under jit where the residual is donated or an
        intermediate): bf16(residual + bf16(x @ w.T)), bit for bit the values of
        `residual + dense_projection(x, w)` on the same tile. The residual's gradient is
        dy, with the residual's sharding. With grad_accumulator= or out_sharding= the
        add is always a separate one.

    Returns:
      y: [..., d_out] bfloat16. Gradients: dx bfloat16, dw in w's dtype.
    """
    fn = "dense_projection"
    deterministic = validation.check_dense_operands(fn, x, w, deterministic)
    lead, d_out = x.shape[:-1], w.shape[0]
    if residual is not None:
        validation.check_residual(fn, residual, lead + (d_out,))
    if grad_accumulator is not None:
        validation.check_accumulator(fn, grad_accumulator, w)
    out = validation.check_out_sharding(fn, out_sharding, lead + (d_out,))
    one = (1,) + w.shape
    # The asked-for sharding reaches the GEMM where y3 has it as it is (x of rank 2).
    request = P(None, *out[0]) if out is not None and x.ndim == 2 else None
    return _run_projection(
        _ProjectionCall(
            fn=fn,
            x3=partitioning.merge_leading(x),
            w3=jnp.reshape(w, one),
            deterministic=deterministic,
            residual=residual,
            r3=None if residual is None else partitioning.merge_leading(residual),
            acc3=None if grad_accumulator is None else jnp.reshape(grad_accumulator, one),
            out_request=request,
            out_sharding=out,
            to_y=lambda y3: jnp.reshape(y3, lead + (d_out,)),
        )
    )


def batched_projection(x, w, *, deterministic: bool = True, grad_accumulator=None, out_sharding=None, residual=None):
    """y[b] = x[b] @ w[b].T for every batch entry b (e.g. MLA head rows), one launch.

    Args:
      x: [B, T, d_in] bfloat16.
      w: [B, d_out, d_in] bfloat16 or float32 (master weight, as in dense_projection).
      deterministic: keyword-only, as in dense_projection.
      grad_accumulator: keyword-only, None or a float32 [B, d_out, d_in] running sum of
        w's gradient, as in dense_projection.
      out_sharding: keyword-only, the sharding of y, as in dense_projection.
      residual: keyword-only, None or a bfloat16 [B, T, d_out] array added to y in the
        forward kernel, as in dense_projection.

    Returns:
      y: [B, T, d_out] bfloat16. Gradients: dx bfloat16, dw in w's dtype.
    """
    fn = "batched_projection"
    deterministic = validation.check_batched_operands(fn, x, w, deterministic)
    if residual is not None:
        validation.check_residual(fn, residual, (x.shape[0], x.shape[1], w.shape[1]))
    if grad_accumulator is not None:
        validation.check_accumulator(fn, grad_accumulator, w)
    out = validation.check_out_sharding(fn, out_sharding, (x.shape[0], x.shape[1], w.shape[1]))
    request = out[0] if out is not None else None
    return _run_projection(
        _ProjectionCall(
            fn=fn,
            x3=x,
            w3=w,
            deterministic=deterministic,
            residual=residual,
            r3=residual,
            acc3=grad_accumulator,
            out_request=request,
            out_sharding=out,
            to_y=lambda y3: y3,
        )
    )


def fused_projections(x, ws: Sequence[Any], *, deterministic: bool = True) -> tuple:
    """(x @ w.T for w in ws) with one GEMM launch each for the forward, dx and dw.

    QKV, gate/up, MLA ranks, skinny heads: weights that share x. See
    jax_cake.pipeline.fused for how the GEMMs are laid out.

    Args:
      x: [..., d_in] bfloat16 activations shared by every projection (any number of
        leading token dimensions).
      ws: a non-empty list or tuple of weights, ws[i] [d_out_i, d_in] bfloat16 or
        float32 (a float32 weight is a master weight, as in dense_projection: rounded to
        bfloat16 for the products, its gradient float32 from the FP32 accumulator).
        Dtypes may be mixed.
      deterministic: keyword-only, as in dense_projection (applies to the one wgrad).

    Returns:
      A tuple (y_0, y_1, ...) with y_i [..., d_out_i] bfloat16. Gradients: dx bfloat16
      [..., d_in] (one FP32 sum over all sum_i d_out_i, rounded once), dw_i in ws[i]'s
      dtype [d_out_i, d_in].

    Raises (at trace time): TypeError / ValueError naming the bad argument (x, ws or
    ws[i], deterministic).
    """
    fn = "fused_projections"
    deterministic = validation.check_deterministic(fn, deterministic)
    validation.check_activations(fn, x)
    validation.check_weights(fn, ws, x.shape[-1])
    lead = x.shape[:-1]
    ys = fused.project_fused(partitioning.merge_leading(x), tuple(ws), deterministic=deterministic)
    return tuple(remat.name_output(jnp.reshape(y, lead + (y.shape[-1],))) for y in ys)


def _gated_operands(fn, x, w_gate, w_up, activation, deterministic):
    deterministic = validation.check_deterministic(fn, deterministic)
    activation = validation.check_activation(fn, activation)
    validation.check_activations(fn, x)
    validation.check_gated_weights(fn, w_gate, w_up, x.shape[-1])
    return activation, deterministic


def gated_projection(x, w_gate, w_up, *, activation: str = "silu", deterministic: bool = True):
    """h = act(x @ w_gate.T) * (x @ w_up.T): the SwiGLU ("silu") / GeGLU ("gelu") input
    projection of an MLP, with one GEMM launch each for the forward, dx and dw.

    Values (jax_cake.reference.gate / gate_grad): g = bf16(x w_gate^T) and u = bf16(x
    w_up^T), each the GEMM's FP32 accumulator rounded once (the pre-activation, which the
    backward saves); h = bf16(act(g) * u) computed in FP32 from the bf16 g and u. For a
    bf16 cotangent dh: dg = bf16(dh * u * act'(g)), du = bf16(dh * act(g)) in FP32 from
    the saved g, u; dx = [dg | du] @ [w_gate; w_up] as ONE GEMM over K = 2 d_ff (one FP32
    sum, rounded once); dw_gate, dw_up from the wgrad's FP32 accumulator in each weight's
    dtype. The forward is one GEMM over the gate and up rows interleaved
    (jax_cake.pipeline.gated); on the GPU, at the large shapes where the planner runs its
    wide tiles, the activation runs in that GEMM's epilogue (jax_cake.planner.gated),
    elsewhere as an XLA elementwise pass right after it, with the same values.
    The backward's activation gradient is an XLA pass.

    Args:
      x: [..., d_in] bfloat16 activations (any number of leading token dimensions).
      w_gate, w_up: [d_ff, d_in] bfloat16 or float32 weights of the same shape (a float32
        weight is a master weight, as in dense_projection). Keep them apart: with d_ff
        sharded (both on their first axis, column-parallel) every shard computes its own
        h columns with no gather of x or of the weights.
      activation: keyword-only, "silu" (z sigmoid(z), SwiGLU; default) or "gelu" (the
        tanh approximation, jax.nn.gelu(approximate=True), GeGLU).
      deterministic: keyword-only, as in dense_projection.

    Returns:
      h: [..., d_ff] bfloat16. Gradients: dx bfloat16, dw_gate and dw_up in their
      weights' dtypes. Under jax.checkpoint, jc.remat.save_gated_preactivation (or
      save_projections) keeps the pre-activation so the backward does not run the
      forward GEMM again.

    Raises (at trace time): TypeError / ValueError naming the bad argument.
    """
    fn = "gated_projection"
    activation, deterministic = _gated_operands(fn, x, w_gate, w_up, activation, deterministic)
    lead, d_ff = x.shape[:-1], w_gate.shape[0]
    x3 = partitioning.merge_leading(x)
    h3 = gated.project_gated(x3, w_gate, w_up, activation=activation, deterministic=deterministic)
    return remat.name_output(jnp.reshape(h3, lead + (d_ff,)))


def swiglu_mlp(x, w_gate, w_up, w_down, *, activation: str = "silu", residual=None, deterministic: bool = True):
    """y = [residual +] gated_projection(x, w_gate, w_up) @ w_down.T: a SwiGLU / GeGLU MLP.

    The gated projection as in gated_projection; the down projection is the projection
    pipeline's (dense_projection's values), with residual= as its forward GEMM's "add"
    epilogue (the fused residual kernel on the GPU). Where the planner runs the down
    projection's input gradient with the activation's gradient in its epilogue
    (jax_cake.planner.gated.plan_gate_grad; held back by default, slower as built), the
    backward gets d[gate|up] straight from that kernel. h is not an output: under
    jax.checkpoint with jc.remat.save_gated_preactivation (or save_projections) the
    backward keeps the pre-activation [gate | up] and recomputes h from it elementwise,
    running no GEMM twice.

    Args:
      x: [..., d_in] bfloat16.
      w_gate, w_up: [d_ff, d_in] bfloat16 or float32, as in gated_projection.
      w_down: [d_out, d_ff] bfloat16 or float32.
      activation: keyword-only, "silu" (default) or "gelu", as in gated_projection.
      residual: keyword-only, None (default) or a bfloat16 [..., d_out] array: returns
        bf16(residual + bf16(h @ w_down.T)), as dense_projection's residual=.
      deterministic: keyword-only, as in dense_projection (every GEMM of the MLP).

    Returns:
      y: [..., d_out] bfloat16. Gradients: dx bfloat16, each weight's in its dtype, the
      residual's dy.

    Raises (at trace time): TypeError / ValueError naming the bad argument.
    """
    fn = "swiglu_mlp"
    activation, deterministic = _gated_operands(fn, x, w_gate, w_up, activation, deterministic)
    d_ff = w_gate.shape[0]
    validation.check_down_weight(fn, w_down, d_ff)
    lead, d_out = x.shape[:-1], w_down.shape[0]
    if residual is not None:
        validation.check_residual(fn, residual, lead + (d_out,))
    y3 = gated.project_mlp(
        partitioning.merge_leading(x),
        w_gate,
        w_up,
        jnp.reshape(w_down, (1,) + w_down.shape),
        None if residual is None else partitioning.merge_leading(residual),
        activation=activation,
        deterministic=deterministic,
    )
    return remat.name_output(jnp.reshape(y3, lead + (d_out,)))


def router_logits(x, w, *, deterministic: bool = True):
    """FP32 MoE router logits = x @ w.T by BF16x3 emulation.

    Each FP32 operand is split into hi + lo bfloat16 parts and hi*hi + hi*lo + lo*hi are
    accumulated in FP32 (the accuracy of jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3).
    The backward uses the same emulation for dx and dw.

    Args:
      x: [T, d] float32 tokens.
      w: [E, d] float32 router weight (E = 256 experts is the tuned case).
      deterministic: keyword-only, as in dense_projection (applies to dw).

    Returns:
      logits: [T, E] float32.
    """
    fn = "router_logits"
    deterministic = validation.check_router_operands(fn, x, w, deterministic)
    return remat.name_output(router.route(x, w, deterministic=deterministic))


def grouped_projection(x, w, group_sizes, *, deterministic: bool = True):
    """y[r] = x[r] @ w[g(r)].T: one weight per group of rows (MoE experts), g(r) the group
    row r falls in, with BF16 operands and FP32 accumulation.

    Groups: the rows of x are sorted by group; group i holds the next group_sizes[i] rows
    (a run-time array: the sizes may change from step to step with no recompilation and no
    host sync). The sizes are made safe inside the op, never read on the host: a negative
    size counts as 0, and the groups are cut at M (the groups' running sum stops at M: the
    group that crosses it keeps the rows up to M, later groups none). So no GEMM reads or
    writes out of bounds, and the results are finite for finite inputs. Rows from
    sum(sizes) on (after those rules) belong to no group: their y is 0, their dx is 0, and
    they add nothing to dw, whatever they hold.

    Values: each output element is the FP32 sum of its products rounded once to bf16 (an
    FP32 result, then one rounding, on every backend); dw in w's dtype straight from the
    FP32 sum (an FP32 master weight gets an FP32 gradient, never rounded to bf16); an
    empty group's dw is exactly 0. On sm_90a the GEMMs run the grouped kernels; elsewhere
    (and where `jc.explain(jc.plan("grouped_fwd", ...))` says why) XLA's ragged dot with
    an FP32 result, the same semantics.

    Args:
      x: [M, d_in] bfloat16 tokens, rows sorted by group.
      w: [G, d_out, d_in] bfloat16 or float32 (a master weight: rounded to bfloat16 for the
        products, its gradient float32).
      group_sizes: [G] int32, rows per group (see Groups above).
      deterministic: keyword-only, as in dense_projection (the XLA path is bitwise
        reproducible either way).

    Returns:
      y: [M, d_out] bfloat16. Gradients: dx bfloat16, dw in w's dtype (group_sizes gets
      none). Differentiable twice (grad of grad); jax.jvp raises custom_vjp's error.
      Under jit with sharded inputs: tokens sharded keep their sharding, w sharded on
      d_out or d_in works as in dense_projection; w sharded on its expert axis G is
      gathered (each device's tokens may use any expert): for expert parallelism, run
      it under jax.shard_map with the caller's all-to-all (examples/expert_parallel.py).

    Raises (at trace time): TypeError / ValueError naming the bad argument.
    """
    fn = "grouped_projection"
    deterministic = validation.check_grouped_operands(fn, x, w, group_sizes, deterministic)
    return remat.name_output(grouped.project_grouped(x, w, group_sizes, deterministic=deterministic))


def _ragged_dot_fallback(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset, out_sharding) -> str:
    """Why jax_cake does not serve this ragged_dot call ("" where it does; see ragged_dot)."""
    if not all(hasattr(v, "shape") and hasattr(v, "dtype") for v in (lhs, rhs, group_sizes)):
        return "an operand is not an array"
    lhs_dtype, rhs_dtype = jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype)
    if lhs_dtype != jnp.dtype(jnp.bfloat16):
        return f"lhs is {lhs_dtype.name}: jax_cake's grouped GEMMs take bfloat16 activations"
    if rhs_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"rhs is {rhs_dtype.name}: jax_cake takes a bfloat16 rhs or a float32 master"
    if preferred_element_type is not None and jnp.dtype(preferred_element_type) != jnp.dtype(jnp.bfloat16):
        name = jnp.dtype(preferred_element_type).name
        return f"preferred_element_type {name}: jax_cake's grouped GEMMs write bfloat16"
    if preferred_element_type is None and rhs_dtype == jnp.dtype(jnp.float32):
        return (
            "a float32 rhs with preferred_element_type=None has a float32 result in lax (pass "
            "preferred_element_type=jnp.bfloat16 for jax_cake's float32 master weight)"
        )
    if not validation.is_default_precision(precision):
        return f"precision={precision!r}: jax_cake runs the default precision only"
    if group_offset is not None:
        return "group_offset is given: jax_cake takes every group"
    if out_sharding is not None:
        return "out_sharding is given"
    if jnp.dtype(group_sizes.dtype) != jnp.dtype(jnp.int32):
        return f"group_sizes is {jnp.dtype(group_sizes.dtype).name}, not int32"
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
        return "shapes other than lhs [M, K], rhs [G, K, N], group_sizes [G]"
    if lhs.shape[1] != rhs.shape[1] or group_sizes.shape[0] != rhs.shape[0] or rhs.shape[0] < 1:
        return "shapes other than lhs [M, K], rhs [G, K, N], group_sizes [G] with G >= 1"
    return ""


def ragged_dot(
    lhs,
    rhs,
    group_sizes,
    precision=None,
    preferred_element_type=None,
    group_offset=None,
    out_sharding=None,
    *,
    deterministic: bool = True,
):
    """A drop-in for `jax.lax.ragged_dot` (same signature, result dtypes and values) that
    runs jax_cake's grouped projection where it can: MoE code written against lax swaps
    one name.

    out[r] = lhs[r] @ rhs[g(r)] with lhs [M, K], rhs [G, K, N] (lax's layout, used as
    stored: no transposed copy of the weights; the forward is the grouped "dgrad" GEMM, as
    the projection pipeline's "kn" layout does) and group_sizes [G].

    Served by jax_cake (grouped_projection's semantics, gradients and plan) when all of:
      - lhs is bfloat16 [M, K], rhs [G, K, N] with G >= 1, group_sizes int32 [G];
      - rhs is bfloat16 with preferred_element_type None or bfloat16 (lax's result is
        bfloat16: jax_cake computes it as the FP32 sum rounded once), or rhs is float32
        with preferred_element_type=jnp.bfloat16 (a master weight: rounded to bfloat16 for
        the products, where lax would multiply the float32 values, and its gradient is
        float32 from the FP32 accumulator);
      - precision is the default (None, Precision.DEFAULT or a pair of them), group_offset
        and out_sharding are None.
    Every other call is `jax.lax.ragged_dot` with the caller's arguments, unchanged (with
    a log line on the "jax_cake" logger, once per reason): float32 activations, a float32
    result, another precision, group_offset, out_sharding, other shapes (lax's own
    errors).

    Where served, the values are lax.ragged_dot's for valid group sizes (sizes >= 0,
    summing to at most M; rows past the sum are 0 in both), and jax_cake's rules hold
    beyond: a negative size counts as 0 and groups are cut at M (grouped_projection), where
    lax's result is unspecified.

    deterministic: keyword-only, as in grouped_projection.
    """
    fn = "ragged_dot"
    deterministic = validation.check_deterministic(fn, deterministic)
    reason = _ragged_dot_fallback(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset, out_sharding)
    if reason:
        logs.once(logging.INFO, "jax_cake: ragged_dot runs jax.lax.ragged_dot: %s", reason)
        return lax.ragged_dot(
            lhs,
            rhs,
            group_sizes,
            precision=precision,
            preferred_element_type=preferred_element_type,
            group_offset=group_offset,
            out_sharding=out_sharding,
        )
    deterministic = validation.check_grouped_operands(
        fn, lhs, rhs, group_sizes, deterministic, names=("lhs", "rhs"), layout="kn"
    )
    y = grouped.project_grouped(lhs, rhs, group_sizes, deterministic=deterministic, layout="kn")
    return remat.name_output(y)


def grouped_gated_projection(x, w_gate, w_up, group_sizes, *, activation: str = "silu", deterministic: bool = True):
    """h[r] = act(x[r] @ w_gate[g(r)].T) * (x[r] @ w_up[g(r)].T): the SwiGLU ("silu") /
    GeGLU ("gelu") input projection of MoE experts, one gate and up weight per group of rows.

    Groups as in grouped_projection (rows sorted by group, group_sizes a run-time int32
    array, negative sizes count as 0, groups cut at M); rows past the groups' sum get h = 0
    and dx = 0 and add nothing to the weight gradients, whatever they hold. Values as in
    gated_projection (jax_cake.reference.gate / gate_grad): g, u = the FP32 accumulator
    rounded once to bf16 (the pre-activation, saved for the backward and named
    jc.remat.PREACTIVATION_NAME); h = bf16(act(g) * u) in FP32; the backward's dg, du from
    the saved g, u; dx ONE grouped GEMM over K = 2 d_ff; dw_gate and dw_up each from the
    FP32 sum of its group's rows, in its weight's dtype (from d_ff = 512 up one grouped
    weight-gradient GEMM per weight, narrower ONE over the 2 d_ff interleaved rows). The
    forward is ONE grouped GEMM over the gate and up rows interleaved
    (jax_cake.pipeline.grouped): on sm_90a with d_ff a multiple of 16 the grouped kernel
    writes h in its epilogue (h then also named jc.remat.ACTIVATION_NAME), elsewhere an XLA
    pass makes h right after it; both give these values up to the FP32 rounding of the
    activation's exp.

    Args:
      x: [M, d_in] bfloat16, rows sorted by group.
      w_gate, w_up: [G, d_ff, d_in] bfloat16 or float32 (master weights: rounded to bfloat16
        for the products, their gradients float32), the same shape.
      group_sizes: [G] int32, rows per group.
      activation: keyword-only, "silu" (default) or "gelu" (tanh form), as in gated_projection.
      deterministic: keyword-only, as in dense_projection.

    Returns:
      h: [M, d_ff] bfloat16. Gradients: dx bfloat16, dw_gate and dw_up in their weights'
      dtypes (group_sizes gets none). Differentiable twice (grad of grad).

    Raises (at trace time): TypeError / ValueError naming the bad argument.
    """
    fn = "grouped_gated_projection"
    activation, deterministic = validation.check_grouped_gated_operands(
        fn, x, w_gate, w_up, group_sizes, activation, deterministic
    )
    h = grouped.project_grouped_gated(x, w_gate, w_up, group_sizes, activation=activation, deterministic=deterministic)
    return remat.name_output(h)


def moe_mlp(
    x, w_gate, w_up, w_down, expert_ids, expert_weights, *, activation: str = "silu", deterministic: bool = True
):
    """y[t] = sum_j expert_weights[t, j] * MLP_{expert_ids[t, j]}(x[t]): a dropless
    mixture-of-experts SwiGLU / GeGLU MLP (every routed token is computed; no capacity).

    MLP_g(v) = gated(v, w_gate[g], w_up[g]) @ w_down[g].T with gated_projection's values.
    Inside (jax_cake.pipeline.moe): the T k token copies are sorted by expert on the device
    (a stable sort: deterministic), group_sizes = the per-expert counts (G from the
    weights' shape), the copies' rows gathered, then grouped_gated_projection and
    grouped_projection (the down projection) over them, and each copy's output weighted
    by its routing weight in FP32 and the k copies summed per token in a fixed order (j =
    0 .. k - 1), rounded once to bf16. dx sums each token's k copies the same way (FP32,
    fixed order, rounded once; no scatter-add). Bitwise reproducible.

    Out-of-range ids: a copy whose expert id is outside [0, G) contributes 0 to y: it joins
    no group (nothing is read or written out of bounds), its routing weight counts as 0,
    its expert_weights gradient is 0 and it adds nothing to dx or any weight gradient. So
    under jax.shard_map with each device holding G / n experts, ids minus the device's
    first expert and a psum over the devices give the expert-parallel layer.

    What runs where: the sort, the gathers and the weighted combine are XLA ops; the grouped
    GEMMs run the grouped kernels on sm_90a (the activation in the gate/up GEMM's
    epilogue), XLA's ragged dot with FP32 results elsewhere.

    Sharding: jit with sharded tokens works (Auto axes: XLA partitions the routing; Explicit
    axes: the tokens are gathered for the routing's sort and y gets x's sharding back, each
    gradient its primal's); weights sharded on d_ff or d_in as in grouped_projection.

    Args:
      x: [T, d] bfloat16 tokens.
      w_gate, w_up: [G, d_ff, d] bfloat16 or float32 (master weights, as in
        dense_projection), the same shape.
      w_down: [G, d, d_ff] bfloat16 or float32.
      expert_ids: [T, k] of an integer dtype (jax.lax.top_k's int32 indices), k >= 1.
      expert_weights: [T, k] float32 or bfloat16 routing weights (e.g. top_k of the
        router's probabilities).
      activation: keyword-only, "silu" (default) or "gelu", as in gated_projection.
      deterministic: keyword-only, as in dense_projection (every GEMM).

    Returns:
      y: [T, d] bfloat16. Gradients: dx bfloat16; each weight's in its dtype (FP32 masters
      from the FP32 sum); expert_weights' d ew[t, j] = <dy[t], MLP_j(x[t])> in FP32, in
      its dtype (the router learns through it); expert_ids gets none. Differentiable twice.

    Raises (at trace time): TypeError / ValueError naming the bad argument.
    """
    fn = "moe_mlp"
    activation, deterministic = validation.check_moe_operands(
        fn, x, w_gate, w_up, w_down, expert_ids, expert_weights, activation, deterministic
    )
    y = moe.moe_mlp(
        x, w_gate, w_up, w_down, expert_ids, expert_weights, activation=activation, deterministic=deterministic
    )
    return remat.name_output(y)
