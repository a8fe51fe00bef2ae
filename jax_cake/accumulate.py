"""Gradient accumulation inside the wgrad kernel: `grad_accumulator=` of the projections.

    def loss(params, accs, x):
        y = jax_cake.dense_projection(x, params["w"], grad_accumulator=accs["w"])
        ...
    accs = jax.grad(loss, argnums=1)(params, accs, x)   # accs["w"] += this micro-batch's dw

Design. The micro-batch loop of gradient accumulation is a `lax.scan` carrying FP32 sums
of the weight gradients. Written the ordinary way, each micro-batch's wgrad writes an FP32
dw and a separate elementwise pass reads dw and the sum and writes the sum (12 bytes per
weight element per micro-batch). Here the wgrad kernel adds its finished tiles into the
sum instead (jax_cake_wgrad_accumulate; the sum is aliased to the result, so under jit it
is updated in place). To fit JAX's autodiff, the running sum is an *input* of the
projection that the forward ignores, and the op's VJP gives it the cotangent
`grad_accumulator + dw` (the new running sum) while w gets a zero cotangent (a symbolic
zero: nothing is computed or added for it). So `jax.grad(loss, argnums=<the sums>)`
returns the new sums, a scan step is `accs = jax.grad(...)(params, accs, micro_batch)`,
and the forward, the activation gradient and everything else stay as they are. A
keyword on the existing ops (rather than a separate function) keeps a model's code one
op per projection: the same call runs plainly or accumulating, and the sums are an
ordinary pytree of arrays next to the parameters.

Rules that follow from this design (the docstrings of dense_projection and
batched_projection repeat them):
  - differentiate with respect to the sums: the w cotangent of an accumulating call is
    zero, the gradient went into the sum;
  - give each sum to one call per loss: a weight used by two calls (tied weights) takes
    the sum in one of them and none in the other, whose dw then arrives as w's ordinary
    cotangent (add it yourself); two calls given the same sum would each return
    `sum + dw`, and JAX adds cotangents, counting the sum twice;
  - the sum is FP32 of w's shape (any w dtype); under shard_map it must vary over the
    same manual axes as x (one partial sum per shard; psum it after the last micro-batch).
The sum of the kernel path is bitwise reproducible (`deterministic` does not matter
here): one FP32 add of the finished micro-batch gradient per element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from jax_cake import api, batching, partitioning, primitives, reference, remat
from jax_cake.contract import WGRAD_ACCUMULATE_TARGET
from jax_cake.planner import Plan
from jax_cake.planner import device as device_lib
from jax_cake.planner import plan as make_plan
from jax_cake.planner.accumulate import plan_accumulate

# --- the primitive ----------------------------------------------------------------------


def _sizes(dy, x) -> dict:
    return dict(tokens=dy.shape[1], d_in=x.shape[2], d_out=dy.shape[2], batch=dy.shape[0])


def _direct(dy, x, acc, plan: Plan):
    """wgrad_accumulate on unbatched operands (the custom_vmap rule below folds a vmapped
    axis away before this)."""
    # The fused call has no partitioning rule: it runs only where nothing is partitioned
    # (one device, a one-device mesh, or inside shard_map over every mesh axis), as the
    # unpartitioned kernels of jax_cake.primitives do. Elsewhere (a mesh of several devices,
    # or NamedSharding operands under jit with no mesh set) the partitioned wgrad runs, then
    # the add, so XLA never replicates the fused call (all-gathering dy and x).
    fused = plan.op == "wgrad_accumulate" and (primitives._manual(dy, x, acc) or primitives._one_device())
    if not fused:
        if plan.op == "wgrad_accumulate":
            plan = make_plan("wgrad", **_sizes(dy, x), out_dtype="float32", device=device_lib.current(dy, x))
        specs = api._explicit_specs(dy, x, acc)
        if specs is None:
            return acc + primitives.wgrad(dy, x, plan).astype(jnp.float32)
        # Explicit axes: dw is asked for in the sum's sharding (the sum's type is the
        # cotangent's), and the add is made there.
        acc_spec = specs[2]
        dw = primitives.wgrad(dy, x, plan, out_sharding=acc_spec).astype(jnp.float32)
        return acc + partitioning.reshard_to(dw, acc_spec)
    b, _, d_out = dy.shape
    d_in = x.shape[2]

    def ref(dy, x, acc):
        return acc + reference.wgrad(dy, x, "float32")

    def cuda(dy, x, acc):
        results = (
            primitives._result_type(acc, (b, d_out, d_in), jnp.float32),
            primitives._result_type(acc, (plan.workspace_bytes,), jnp.uint8, keep_batch_spec=False),
        )
        new_sum, _workspace = primitives.ffi_call(
            WGRAD_ACCUMULATE_TARGET, plan, results, dy, x, acc, input_output_aliases={2: 0}
        )
        return new_sum

    return primitives._dispatch(plan, ref, cuda, dy, x, acc)


def _fold(size: int, batched, dy, x, acc):
    """The vmapped accumulation (batched operands carry the vmapped axis V first) as one
    unbatched call: V folds into the batch axis B ([V, B, ...] -> [V*B, ...]), an unbatched
    operand broadcast over V (each entry's sum is its own acc + its own dw), planned with
    plan_accumulate for the folded shape."""
    dy, x, acc = (v if v_b else jnp.broadcast_to(v, (size,) + v.shape) for v, v_b in zip((dy, x, acc), batched))

    dy2, x2, acc2 = batching.merge_lead(dy), batching.merge_lead(x), batching.merge_lead(acc)
    plan = plan_accumulate(**_sizes(dy2, x2), device=device_lib.current(dy2, x2))
    out = _call(dy2, x2, acc2, plan)
    return out.reshape((size, acc.shape[1]) + out.shape[1:])


def _call(dy, x, acc, plan: Plan):
    @custom_vmap
    def accumulate(dy, x, acc):
        return _direct(dy, x, acc, plan)

    @accumulate.def_vmap
    def rule(axis_size, in_batched, dy, x, acc):
        return _fold(axis_size, tuple(in_batched), dy, x, acc), True

    return accumulate(dy, x, acc)


def wgrad_accumulate(dy, x, acc, plan: Plan):
    """acc + dy[B, T, d_out]^T . x[B, T, d_in] in float32: one micro-batch's weight
    gradient added to the running sum acc[B, d_out, d_in] (float32).

    A kernel plan for op "wgrad_accumulate" (`plan_accumulate`) runs
    jax_cake_wgrad_accumulate with acc aliased to the result (input_output_aliases
    {2: 0}), so under jit the sum is updated in place with no separate pass over it. A
    plan for op "wgrad" (no accumulating variant fits) runs that wgrad and an XLA add; an
    XLA plan, and any platform but CUDA, the reference `acc + dot(dy^T, x)` in float32.
    Where anything is partitioned (a mesh of several devices outside shard_map, or
    sharded operands under jit on several devices) the accumulating call has no
    partitioning rule: the partitioned wgrad runs there (under Explicit axes in acc's
    sharding), then the add. Under vmap the vmapped axis folds into the batch axis (one
    call, planned for the folded shape).
    """
    return _call(dy, x, acc, plan)


# --- the op ---------------------------------------------------------------------------------


def _plans(x3, w3):
    b, t, d_in = x3.shape
    d_out = w3.shape[1]
    device = device_lib.current(x3, w3)
    sizes = dict(tokens=t, d_in=d_in, d_out=d_out, batch=b, device=device)
    return make_plan("fwd", **sizes), make_plan("dgrad", **sizes), plan_accumulate(**sizes)


@jax.custom_vjp
def _accumulating_projection(x3, w3, acc3):
    fwd_plan, _, _ = _plans(x3, w3)
    return primitives.fwd(x3, w3.astype(jnp.bfloat16), fwd_plan)


def _accumulating_fwd(x3, w3, acc3):
    w_bf16 = w3.astype(jnp.bfloat16)
    fwd_plan, _, _ = _plans(x3, w3)
    return primitives.fwd(x3, w_bf16, fwd_plan), (x3, w_bf16, acc3)


def _accumulating_bwd(residuals, dy):
    x3, w_bf16, acc3 = residuals
    _, dgrad_plan, acc_plan = _plans(x3, w_bf16)
    dy = dy.astype(jnp.bfloat16)
    # Under Explicit axes dx is asked for in x's sharding and the new sum comes in the
    # sum's (the cotangents must have their primals' sharding types).
    x_spec = (api._explicit_specs(x3) or (None,))[0]
    dx = primitives.dgrad(dy, w_bf16, dgrad_plan, out_sharding=x_spec)
    new_sum = wgrad_accumulate(dy, x3, acc3, acc_plan)
    dx, new_sum = api._as_primal_types((dx, new_sum), (x3, acc3))
    return dx, None, new_sum  # w: a symbolic zero, its gradient is in the sum


_accumulating_projection.defvjp(_accumulating_fwd, _accumulating_bwd)


def _check_accumulator(fn: str, acc, w) -> None:
    api._check_array(fn, "grad_accumulator", acc)
    if jnp.dtype(acc.dtype) != jnp.dtype(jnp.float32):
        raise TypeError(
            f"{fn}: grad_accumulator must be float32 (the FP32 running sum of w's gradient), got "
            f"{jnp.dtype(acc.dtype).name}; start it with jnp.zeros(w.shape, jnp.float32)"
        )
    if tuple(acc.shape) != tuple(w.shape):
        raise ValueError(
            f"{fn}: grad_accumulator must have w's shape {tuple(w.shape)}, got shape {tuple(acc.shape)}"
        )


def _common_varying(fn: str, x3, w3, acc3):
    """x, w and the sum varying over the union of their manual axes; the sum must already
    vary over all of them (a replicated sum would be counted once per shard)."""
    union = api._varying_axes(x3) | api._varying_axes(w3) | api._varying_axes(acc3)
    missing = sorted(union - api._varying_axes(acc3))
    if missing:
        raise ValueError(
            f"{fn}: grad_accumulator must vary over the manual axes {missing} as x does (one partial sum per "
            "shard: make it with jax.lax.pcast(..., to='varying') and psum it after the last micro-batch)"
        )
    return api._to_common_varying(x3, w3, acc3)


def dense_projection(x, w, grad_accumulator, *, deterministic: bool = True, out_sharding=None):
    """`jax_cake.dense_projection(x, w, grad_accumulator=...)` (see its docstring)."""
    fn = "dense_projection"
    api._check_dense_operands(fn, x, w, deterministic)
    _check_accumulator(fn, grad_accumulator, w)
    out = api._check_out_sharding(fn, out_sharding, x.ndim)
    lead = x.shape[:-1]
    x3, w3 = api._batch_of_one(x, w)
    acc3 = jnp.reshape(grad_accumulator, (1,) + w.shape)
    x3, w3, acc3 = _common_varying(fn, x3, w3, acc3)
    y3 = _accumulating_projection(x3, w3, acc3)
    return remat.name_output(api._apply_out_sharding(jnp.reshape(y3, lead + (w.shape[0],)), out))


def batched_projection(x, w, grad_accumulator, *, deterministic: bool = True, out_sharding=None):
    """`jax_cake.batched_projection(x, w, grad_accumulator=...)` (see its docstring)."""
    fn = "batched_projection"
    api._check_batched_operands(fn, x, w, deterministic)
    _check_accumulator(fn, grad_accumulator, w)
    out = api._check_out_sharding(fn, out_sharding, 3)
    x, w, acc = _common_varying(fn, x, w, grad_accumulator)
    return remat.name_output(api._apply_out_sharding(_accumulating_projection(x, w, acc), out))
