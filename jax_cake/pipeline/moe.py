"""The dropless MoE expert MLP (jc.moe_mlp): routing, the grouped gated and down projections,
the weighted combine.

x [T, d] bf16, w_gate / w_up [G, F, d], w_down [G, d, F] (bf16 or FP32 masters),
expert_ids [T, k] (an integer dtype), expert_weights [T, k] (float32 or bfloat16):

    y[t] = bf16( sum_j  ew[t, j] * MLP_{e[t, j]}(x[t]) )        (FP32 sum, j = 0 .. k-1 in order)
    MLP_g(v) = bf16( gate(v Wg[g]^T, v Wu[g]^T) Wd[g]^T )         (the grouped projections' values)

1. routing (`route`): the T k token copies (copy c = t k + j) are sorted by expert with a
   stable sort of the key e[t, j] (copies whose id is outside [0, G) get the key G: they
   sort last), so the order is deterministic: by expert, then by copy. group_sizes [G]
   int32 = the per-expert counts (from the sorted keys, no scatter). Copies with an id
   outside [0, G) are past sum(group_sizes): in expert order the grouped GEMMs give them
   h = 0 and an output of 0, in the row layout no row holds them and the combine's gather
   reads 0 for them; either way they add nothing to any weight gradient, read no weight out
   of bounds, and their routing weight is replaced by 0 in the combine (so y and every
   gradient stay finite whatever it holds); their expert_weights gradient is 0.
2. dispatch: each token copy's row of x (a gather, `_dispatch`) into the experts' rows.
   Its transpose (`_collect`) sums each token's k copies in FP32 in a fixed order (j = 0 ..
   k - 1) and rounds once: dx has no scatter-add and no bf16 partial sums.
3. the experts: ONE grouped gated projection (pipeline.grouped.project_grouped_gated:
   the gate and up rows interleaved, the pre-activation saved and named for remat) and ONE
   grouped down projection (pipeline.grouped.project_grouped).
4. combine: the outputs back in copy order (a gather, `_permute`, whose transpose is the
   gather the other way), each weighted by its routing weight in FP32 and summed over j in
   order, rounded once to bf16. The autodiff of that expression gives d ew[t, j] =
   <dy[t], MLP_j(x[t])> in FP32 (rounded once to ew's dtype) and each copy's cotangent
   bf16(ew[t, j] dy[t]).

The experts' rows (`_rows`): where the grouped forward plans a kernel, the grouped kernels'
row layout (primitives.grouped.PaddedLayout: each expert's copies from a multiple of
contract.GROUP_ROW_ALIGN rows, zero rows between), the group sizes its padded sizes: the
dispatch gathers straight into it, every grouped GEMM reads and writes it as it is
(Call.aligned) and the combine gathers out of it, so the layer gathers rows four times
(dispatch and combine, and their transposes) where a layout pass around each GEMM would
add two per GEMM.
Elsewhere the sorted copies, [T k, d], group_sizes. The values are the same either way (the
zero rows add nothing).

Every step is a sort, a gather, a grouped GEMM or an elementwise pass in a fixed order:
bitwise reproducible. Each gather's transpose is a gather (a custom_vjp pair), so the
backward has no scatter-add, and the whole op can be differentiated twice. What runs
where: the sort, the gathers and the combine are XLA ops; the grouped GEMMs are
jax_cake.primitives.grouped's (the grouped kernels on sm_90a, XLA's ragged dot with FP32
results elsewhere). The dispatch is a gather ahead of the first GEMM, not its loads, the
SwiGLU an XLA pass after it, and the routing weight is applied in the combine pass, not the
down GEMM's epilogue.

Sharding: under jit with Auto axes XLA partitions the sort and the gathers itself; under
Explicit axes the tokens (x, expert_ids, expert_weights) are gathered (logged once) for the routing, a
sort over every token, and y gets x's sharding back (the weights keep theirs: the grouped
GEMMs' rules). Inside shard_map each device routes its own tokens to the experts it
holds: with ids shifted by the device's first expert, the others are out of range and
contribute 0, and a psum over the expert axis completes the layer.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_cake import contract, logs, reference, remat
from jax_cake.pipeline import grouped
from jax_cake.planner import device as device_lib
from jax_cake.primitives import grouped as gemms
from jax_cake.primitives import partitioning

_BF16, _F32 = jnp.bfloat16, jnp.float32


def in_range(ids, groups: int):
    """Whether each id is in [0, groups), compared in the ids' own dtype (no cast that could
    wrap a large id into range)."""
    info = jnp.iinfo(ids.dtype)
    below = ids < groups if groups <= info.max else jnp.ones(ids.shape, bool)
    return below & (ids >= 0) if info.min < 0 else below


def route(expert_ids, groups: int):
    """(perm, inv, group_sizes, valid) of the T k copies (copy c = t k + j) of expert_ids
    [T, k]: perm [T k] int32, the copies in expert order (sorted position i holds copy
    perm[i]; stable: copies of one expert in copy order, out-of-range ids last); inv its
    inverse; group_sizes [groups] int32 the per-expert counts; valid [T, k] bool, the ids
    in [0, groups)."""
    valid = in_range(expert_ids, groups)
    key = jnp.where(valid, expert_ids.astype(jnp.int32), groups).reshape(-1)
    copies = key.shape[0]
    iota = lax.iota(jnp.int32, copies)
    sorted_key, perm = lax.sort((key, iota), num_keys=1, is_stable=True)
    bounds = jnp.searchsorted(sorted_key, jnp.arange(groups + 1, dtype=jnp.int32), side="left").astype(jnp.int32)
    group_sizes = bounds[1:] - bounds[:-1]
    inv = jnp.zeros_like(perm).at[perm].set(iota, unique_indices=True)
    return perm, inv, group_sizes, valid


def _take_rows(v, idx):
    """v's rows at idx; 0 for an index past v's rows."""
    return jnp.take(v, idx, axis=0, mode="fill", fill_value=0)


# --- the gathers, each other's transposes (a custom_vjp each: no scatter-add backward) ---


@jax.custom_vjp
def _permute(v, idx, back):
    """v[idx] for a one-to-one idx (each of v's rows taken at most once, an index past v's rows
    gives 0); back: for each row of v, the result's row that holds it (past the result's
    rows: none). The row order's permutation and inverse, or a PaddedLayout's dest and
    source."""
    return _take_rows(v, idx)


def _permute_fwd(v, idx, back):
    return _permute(v, idx, back), (idx, back)


def _permute_bwd(saved, d):
    idx, back = saved
    return _permute(d, back, idx), None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch(x, copy_of_row, row_of_copy, k: int):
    """[R, d]: row i is x[copy_of_row[i] // k], the token of the copy it holds (0 for a row
    holding none: copy_of_row[i] = T k); row_of_copy [T k]: each copy's row (R: none)."""
    return _take_rows(x, copy_of_row // k)


def _dispatch_fwd(x, copy_of_row, row_of_copy, k):
    return _dispatch(x, copy_of_row, row_of_copy, k), (copy_of_row, row_of_copy)


def _dispatch_bwd(k, saved, d):
    copy_of_row, row_of_copy = saved
    return _collect(d, copy_of_row, row_of_copy, k), None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def sum_copies(c):
    """[T, k, ...] -> [T, ...] in c's dtype: the k copies summed in FP32, j = 0 .. k - 1 in
    order (an elementwise chain, the same order on every backend), rounded once."""
    acc = c[:, 0].astype(_F32)
    for j in range(1, c.shape[1]):
        acc = acc + c[:, j].astype(_F32)
    return reference.round_once(acc, c.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _collect(v, copy_of_row, row_of_copy, k: int):
    """[T, d]: token t's k copies in v [R, d] summed (sum_copies; a copy in no row adds 0);
    _dispatch's transpose."""
    copies = _take_rows(v, row_of_copy)
    return sum_copies(jnp.reshape(copies, (copies.shape[0] // k, k) + copies.shape[1:]))


def _collect_fwd(v, copy_of_row, row_of_copy, k):
    return _collect(v, copy_of_row, row_of_copy, k), (copy_of_row, row_of_copy)


def _collect_bwd(k, saved, d):
    copy_of_row, row_of_copy = saved
    return _dispatch(d, copy_of_row, row_of_copy, k), None, None


_collect.defvjp(_collect_fwd, _collect_bwd)


def combine(outputs, expert_weights, valid):
    """y [T, d] bf16 = bf16(sum_j ew[t, j] out[t, j]) in FP32, j in order; outputs [T, k, d]
    bf16 in copy order; copies not `valid` weigh 0."""
    ew = jnp.where(valid, expert_weights.astype(_F32), jnp.zeros((), _F32))
    acc = ew[:, 0, None] * outputs[:, 0].astype(_F32)
    for j in range(1, outputs.shape[1]):
        acc = acc + ew[:, j, None] * outputs[:, j].astype(_F32)
    return reference.round_once(acc, _BF16)


def moe_mlp(
    x, w_gate, w_up, w_down, expert_ids, expert_weights, *, activation: str, deterministic: bool, laid_out=None
):
    """y [T, d] bf16 of validated operands (module docstring). laid_out: run the experts on
    the row layout (None: where the grouped forward's plan runs a kernel)."""
    # Inside shard_map every operand varies over the same manual axes (a replicated x next
    # to device-dependent ids: pcast's transpose then sums dx over those axes).
    x, w_gate, w_up, w_down, expert_ids, expert_weights = partitioning.to_common_varying(
        x, w_gate, w_up, w_down, expert_ids, expert_weights
    )
    mesh = partitioning.explicit_mesh(x, expert_ids, expert_weights)
    if mesh is not None:
        # Explicit axes: the routing is a global sort over every token, so the tokens are
        # gathered for it (the layer runs whole on every device) and y gets x's sharding back.
        # Expert parallelism at scale is shard_map's (per-device routing, module docstring).
        x_spec = jax.typeof(x).sharding.spec
        if any(axis is not None for axis in x_spec):
            logs.once(
                logging.INFO,
                "jax_cake: moe_mlp under Explicit axes gathers its tokens %s (sharded %s) for the routing, a sort "
                "over every token; for expert parallelism route per device under shard_map",
                str(x.shape),
                str(x_spec),
            )
        x, expert_ids, expert_weights = (partitioning.reshard_to(a, P()) for a in (x, expert_ids, expert_weights))
        y = _layer(x, w_gate, w_up, w_down, expert_ids, expert_weights, activation, deterministic, laid_out)
        return partitioning.reshard_to(y, x_spec)
    return _layer(x, w_gate, w_up, w_down, expert_ids, expert_weights, activation, deterministic, laid_out)


def _rows(perm, inv, group_sizes, laid_out: bool):
    """(copy_of_row, row_of_copy, sizes): where the experts' GEMMs find each token copy.
    In expert order: the rows are the sorted copies (perm, inv), sizes group_sizes. Laid
    out: the rows of the grouped kernels' PaddedLayout (each expert's copies from a multiple
    of GROUP_ROW_ALIGN rows, zero rows between; T k for a row holding no copy), sizes its
    padded_sizes; the GEMMs then read and write it as it is (no layout pass around each)."""
    if not laid_out:
        return perm, inv, group_sizes
    copies = perm.shape[0]
    layout = gemms.padded_layout(group_sizes, copies, k_tile=contract.GROUP_ROW_ALIGN)
    holds_copy = layout.source < copies
    copy_of_row = jnp.where(holds_copy, perm[jnp.minimum(layout.source, copies - 1)], copies)
    return copy_of_row, layout.dest[inv], layout.padded_sizes


def uses_kernels(x, w_gate, k: int) -> bool:
    """Whether the experts' grouped forward GEMM runs a kernel: planned for this shape and
    device, on operands that need no partitioning (one device, or shard_map's manual axes;
    elsewhere the GEMMs run XLA's ragged dot, which the row layout would only lengthen)."""
    rows = (x.shape[0] * k, x.shape[1])
    w_shape = (w_gate.shape[0], 2 * w_gate.shape[1], w_gate.shape[2])
    plan = gemms.plan_for("grouped_fwd", rows, w_shape, w_gate.shape[0], device_lib.current(x, w_gate))
    return plan.uses_kernel and partitioning.unpartitioned(x, w_gate)


def _layer(x, w_gate, w_up, w_down, expert_ids, expert_weights, activation, deterministic, laid_out):
    t, k = expert_ids.shape
    groups = w_gate.shape[0]
    if laid_out is None:
        laid_out = uses_kernels(x, w_gate, k)
    perm, inv, group_sizes, valid = route(expert_ids, groups)
    copy_of_row, row_of_copy, sizes = _rows(perm, inv, group_sizes, laid_out)
    xs = _dispatch(x, copy_of_row, row_of_copy, k)  # [R, d], by expert
    h = grouped.project_grouped_gated(
        xs, w_gate, w_up, sizes, activation=activation, deterministic=deterministic, aligned=laid_out
    )
    ys = grouped.project_grouped(remat.name_output(h), w_down, sizes, deterministic=deterministic, aligned=laid_out)
    outputs = jnp.reshape(_permute(remat.name_output(ys), row_of_copy, copy_of_row), (t, k, ys.shape[-1]))
    return combine(outputs, expert_weights, valid)
