"""The grouped (ragged) GEMMs of the MoE projections: one function per GEMM role, a Plan in,
the GEMM out, each a `jax.custom_vjp` whose backward is the other two roles.

With the rows of the activations sorted by group and group_sizes [G] (int32, a run-time
array; reference.grouped_sizes's rules for negative sizes and a sum above M), g(r) the
group of row r:

    fwd    y [M, N]     = a [M, K] . b [G, N, K]^T,  y[r] = a[r] . b[g(r)]^T   plan op "grouped_fwd"
    dgrad  dx [M, K]    = a [M, N] . b [G, N, K],    dx[r] = a[r] . b[g(r)]     "grouped_dgrad"
    wgrad  dw [G, N, K] = a [M, N]^T . b [M, K],     K = the rows, ragged      "grouped_wgrad"

Every role is linear in each operand, so its derivatives are the other roles:

    fwd(x, w):     dx = dgrad(dy, w),     dw = wgrad(dy, x)
    dgrad(dy, w):  d dy = fwd(ddx, w),    dw = wgrad(dy, ddx)
    wgrad(dy, x):  d dy = fwd(x, ddw),    dx = dgrad(dy, ddw)

and the backward of a grouped projection (jax_cake.pipeline.grouped), written with these
roles, can itself be differentiated (grad of grad). Forward mode (jax.jvp) is
custom_vjp's error.

Operands: the activations (a, and b of wgrad) are bf16; the weight (b of fwd and dgrad)
is bf16 or an FP32 master, rounded to bf16 for the product, whose cotangent is the wgrad
in its dtype from the FP32 sum. Results: bf16 (fwd, dgrad) and plan.out_dtype (wgrad).

Backends: the XLA plan runs jax_cake.reference.grouped_fwd / _dgrad / _wgrad. A kernel
plan (jax_cake.planner.grouped: on sm_90a) runs, on CUDA, the grouped kernel of its role on
the rows laid out group by group (`PaddedLayout`): each group's rows copied to start at a
multiple of contract.GROUP_ROW_ALIGN rows (zeros between), so that every 128-row tile
belongs to one group; the layout is computed on the device from group_sizes (no host
sync). fwd and dgrad gather their rows back (rows past the groups: 0); wgrad sums each
group's K tiles of the laid-out dy and x. An aligned call (Call.aligned: moe_mlp's rows,
laid out by its caller) skips both: its rows and results stay in the layout, and on the
kernel path rows past the groups' padded ends are unspecified (the caller masks them).
Elsewhere, under vmap and where the operands would need partitioning, the XLA path runs the
same semantics. Around it:

- vmap: a `custom_vmap` rule broadcasts the operands the vmapped axis does not carry and
  runs the reference with a leading batch dimension on every operand (one ragged dot with
  a batch dimension, no loop).
- jit with sharded operands (Auto axes): XLA partitions the ragged dot itself.
- Explicit axes: the GEMM runs under `jax.sharding.auto_axes`, its result typed with
  `out_spec` (a backward asks for its primal's sharding) or the rule `result_spec`: the
  activations' row sharding and the weight's free axis, as the dense GEMMs' rule gives.
- shard_map: the roles run on the per-device operands as given.

`fwd_gated` is the fwd role over interleaved gate and up rows with the activation (h =
reference.gate(g, u)): one call of the gated grouped kernel for a plan of op
"grouped_fwd_gated", else fwd and an XLA pass; differentiated through that unfused form.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.sharding import PartitionSpec as P

from jax_cake import contract, logs, reference, remat
from jax_cake.planner import Plan
from jax_cake.planner import device as device_lib
from jax_cake.planner import plan as make_plan
from jax_cake.primitives import gemm as gemm_lib
from jax_cake.primitives.call import fused_or
from jax_cake.primitives import partitioning

_BF16 = jnp.bfloat16

_REFERENCE = {
    "grouped_fwd": reference.grouped_fwd,
    "grouped_dgrad": reference.grouped_dgrad,
    "grouped_wgrad": reference.grouped_wgrad,
}


def sizes(op: str, a_shape, b_shape) -> dict:
    """The planner's sizes (tokens, d_in, d_out) of grouped GEMM `op` on operand shapes, by
    position: fwd(a [M, K], b [G, N, K]), dgrad(a [M, N], b [G, N, K]), wgrad(a [M, N],
    b [M, K])."""
    if op == "grouped_fwd":
        return dict(tokens=a_shape[-2], d_in=a_shape[-1], d_out=b_shape[-2])
    return dict(tokens=a_shape[-2], d_out=a_shape[-1], d_in=b_shape[-1])


def plan_for(op: str, a_shape, b_shape, groups: int, device, *, out_dtype="bfloat16", deterministic=True) -> Plan:
    """The Plan of grouped GEMM `op` on operands of these shapes."""
    return make_plan(
        op,
        **sizes(op, a_shape, b_shape),
        groups=groups,
        out_dtype=out_dtype,
        deterministic=deterministic,
        device=device,
    )


def _axes(spec, ndim: int):
    return partitioning.normalize(spec, ndim)


def result_spec(op: str, a, b) -> P:
    """The result's sharding under Explicit axes: the rows keep a's sharding (never
    gathered), the weight's free axis (N of fwd, K of dgrad) or wgrad's (N, K) keep their
    operand's axes where not used already; wgrad's groups are whole. Leading (vmapped)
    dimensions keep a's."""
    a_axes = _axes(jax.typeof(a).sharding.spec, a.ndim)
    b_axes = _axes(jax.typeof(b).sharding.spec, b.ndim)
    lead = a.ndim - 2
    if op == "grouped_fwd":
        wanted = a_axes[: lead + 1] + (b_axes[lead + 1],)
    elif op == "grouped_dgrad":
        wanted = a_axes[: lead + 1] + (b_axes[lead + 2],)
    else:
        wanted = a_axes[:lead] + ((), a_axes[lead + 1], b_axes[lead + 1])
    used: set = set()
    out = []
    for axes in wanted:
        keep = tuple(axis for axis in axes if axis not in used)
        if len(keep) != len(axes):
            keep = ()  # an axis already used: this dimension stays whole
        used.update(keep)
        out.append(keep)
    return partitioning.to_pspec(tuple(out))


def _explicit_mesh(*arrays):
    """The mesh whose Explicit axes the GEMM runs under: the operands' types', else the
    context's (jax.set_mesh or an abstract mesh with Explicit axes), else None."""
    mesh = partitioning.explicit_mesh(*arrays)
    if mesh is not None:
        return mesh
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and any(t == jax.sharding.AxisType.Explicit for t in context.axis_types):
        return context
    return None


def _xla(op: str, out_dtype, out_spec, a, b, group_sizes):
    """reference's grouped GEMM; under Explicit axes in Auto mode (lax's ragged dot has no
    Explicit sharding rule), typed out_spec (or the rule's)."""
    ref = functools.partial(_REFERENCE[op], out_dtype=out_dtype)
    mesh = _explicit_mesh(a, b, group_sizes)
    if mesh is None:
        return ref(a, b, group_sizes)
    spec = out_spec if out_spec is not None else result_spec(op, a, b)
    if jax.sharding.get_abstract_mesh().empty:  # Explicit-sharded arrays without jax.set_mesh
        with jax.sharding.use_abstract_mesh(mesh):
            return jax.sharding.auto_axes(ref, out_sharding=spec)(a, b, group_sizes)
    return jax.sharding.auto_axes(ref, out_sharding=spec)(a, b, group_sizes)


@dataclasses.dataclass(frozen=True)
class PaddedLayout:
    """Where the grouped kernels find each row: every group's rows start at a multiple of
    contract.GROUP_ROW_ALIGN rows of a buffer of `capacity` rows (a static bound: M rows
    plus the padding G groups can need), zeros between.

    dest [M] int32: row r's row in the buffer (`capacity` for a row past the groups: not
    copied, read back as 0); source [capacity] int32, its inverse: the row the buffer's row
    holds (M for a padding row: 0); row_table [capacity / 128 + 1] int32: each 128-row tile's group
    (the last group for tiles past the rows), then how many tiles hold rows (the fwd and
    dgrad kernels' table); k_table [G + 1] int32: each group's first K tile (of the wgrad
    kernel's tile_k rows), then the end (the wgrad kernel's); padded_sizes [G] int32: each
    group's row count rounded up to GROUP_ROW_ALIGN (an aligned caller's group sizes)."""

    dest: Any
    source: Any
    row_table: Any
    k_table: Any
    capacity: int
    padded_sizes: Any

    def lay_out(self, a):
        """a [M, n] laid out: [capacity, n], each row at dest, zeros elsewhere. A gather (by
        source), so XLA fuses it with a gather that makes a (moe_mlp's routing)."""
        return jnp.take(a, self.source, axis=0, mode="fill", fill_value=0)

    def gather(self, buffer):
        """The rows of a laid-out [capacity, n] buffer back in a's order: [M, n], 0 for rows
        past the groups."""
        return jnp.take(buffer, self.dest, axis=0, mode="fill", fill_value=0)


def padded_layout(group_sizes, rows: int, k_tile: int) -> PaddedLayout:
    """The PaddedLayout of `rows` rows in groups of group_sizes [G] (reference.grouped_sizes's
    rules for negative sizes and a sum above rows), computed on the device; k_table counts
    K tiles of k_tile rows (the wgrad kernel's tile_k, a divisor of GROUP_ROW_ALIGN)."""
    align = contract.GROUP_ROW_ALIGN
    groups = group_sizes.shape[0]
    capacity = -(-(rows + (align - 1) * groups) // align) * align
    sizes = reference.grouped_sizes(group_sizes, rows)
    ends = jnp.cumsum(sizes)
    padded = (sizes + align - 1) // align * align
    padded_ends = jnp.cumsum(padded)
    padded_starts = padded_ends - padded
    r = jnp.arange(rows, dtype=jnp.int32)
    group = jnp.searchsorted(ends, r, side="right").astype(jnp.int32)  # G: past the groups
    g = jnp.minimum(group, groups - 1)
    dest = jnp.where(group < groups, padded_starts[g] + r - (ends[g] - sizes[g]), capacity)
    tile_group, row_table, k_table = _tables(padded_ends, capacity, k_tile)
    # Each buffer row's source row: the offset into its tile's group, M past the group's rows.
    p = jnp.arange(capacity, dtype=jnp.int32)
    pg = tile_group[p // align]
    offset = p - padded_starts[pg]
    source = jnp.where(offset < sizes[pg], ends[pg] - sizes[pg] + offset, rows)
    return PaddedLayout(
        dest.astype(jnp.int32), source.astype(jnp.int32), row_table, k_table, capacity, padded.astype(jnp.int32)
    )


def _tables(padded_ends, capacity: int, k_tile: int):
    """(tile_group, row_table, k_table) of a buffer of `capacity` rows whose groups end at
    padded_ends [G] (multiples of GROUP_ROW_ALIGN): PaddedLayout's tables."""
    align = contract.GROUP_ROW_ALIGN
    if align % k_tile:
        raise ValueError(f"grouped tables: k_tile={k_tile} does not divide {align}, the groups' row alignment")
    groups = padded_ends.shape[0]
    tile_starts = jnp.arange(capacity // align, dtype=jnp.int32) * align
    tile_group = jnp.minimum(jnp.searchsorted(padded_ends, tile_starts, side="right"), groups - 1)
    used_tiles = padded_ends[-1] // align
    row_table = jnp.concatenate([tile_group, used_tiles[None]]).astype(jnp.int32)
    padded_starts = jnp.concatenate([jnp.zeros((1,), padded_ends.dtype), padded_ends[:-1]])
    k_table = (jnp.concatenate([padded_starts, padded_ends[-1:]]) // k_tile).astype(jnp.int32)
    return tile_group, row_table, k_table


def _aligned_tables(group_sizes, rows: int, k_tile: int):
    """(row_table, k_table) of rows already laid out (Call.aligned): group_sizes multiples
    of GROUP_ROW_ALIGN, summing to at most `rows`."""
    _, row_table, k_table = _tables(jnp.cumsum(group_sizes.astype(jnp.int32)), rows, k_tile)
    return row_table, k_table


def _aligned_kernel(plan: Plan, a, b, group_sizes):
    """The grouped kernel of plan.op on rows already laid out: group_sizes multiples of
    GROUP_ROW_ALIGN, summing to at most a's rows (Call.aligned). Rows past the groups are
    not written."""
    row_table, k_table = _aligned_tables(group_sizes, a.shape[0], plan.tile[2])
    if plan.op == "grouped_wgrad":
        return gemm_lib.grouped_wgrad(a, b, k_table, plan)
    role = gemm_lib.grouped_fwd if plan.op == "grouped_fwd" else gemm_lib.grouped_dgrad
    return role(a, b, row_table, plan)


def _kernel(plan: Plan, a, b, group_sizes):
    """The grouped kernel of plan.op on a, b (bf16, unbatched) through the PaddedLayout."""
    layout = padded_layout(group_sizes, a.shape[0], k_tile=plan.tile[2])
    if plan.op == "grouped_wgrad":
        return gemm_lib.grouped_wgrad(layout.lay_out(a), layout.lay_out(b), layout.k_table, plan)
    role = gemm_lib.grouped_fwd if plan.op == "grouped_fwd" else gemm_lib.grouped_dgrad
    return layout.gather(role(layout.lay_out(a), b, layout.row_table, plan))


@dataclasses.dataclass(frozen=True)
class Call:
    """One grouped GEMM call's static part: its plan, the `deterministic` its backward plans
    with, and the result's sharding asked for under Explicit axes (None: result_spec's)."""

    plan: Plan
    deterministic: bool = True
    out_spec: Any = None
    # The operands' rows already laid out (PaddedLayout's buffer, the group sizes its
    # padded_sizes: multiples of GROUP_ROW_ALIGN, their sum at most the rows): the kernels run
    # on them as they are, and the rows of fwd and dgrad past the groups are unspecified
    # (the XLA path's 0, the kernels' unwritten) for the caller to mask or never read.
    aligned: bool = False


def _gemm(call: Call, a, b, group_sizes):
    """The GEMM of call.plan on a, b (bf16), with its vmap rule."""
    plan = call.plan

    def xla(a, b, group_sizes):
        return _xla(plan.op, plan.out_dtype, call.out_spec, a, b, group_sizes)

    @custom_vmap
    def gemm(a, b, group_sizes):
        if not plan.uses_kernel:
            return xla(a, b, group_sizes)
        if a.ndim != 2 or not partitioning.unpartitioned(a, b, group_sizes):
            logs.once(
                logging.INFO,
                "jax_cake: %s under vmap or on operands that need partitioning runs XLA's ragged dot (the "
                "grouped kernels run unbatched whole operands or shard_map's)",
                plan.op,
            )
            return xla(a, b, group_sizes)
        kernel = _aligned_kernel if call.aligned else _kernel
        return jax.lax.platform_dependent(a, b, group_sizes, default=xla, cuda=functools.partial(kernel, plan))

    @gemm.def_vmap
    def rule(axis_size, in_batched, a, b, group_sizes):
        # Every operand carries the vmapped axis first, then one GEMM with a batch dimension
        # (reference's leading dimensions). Nested vmaps come back here, one axis each.
        a, b, group_sizes = (
            v if batched else jnp.broadcast_to(v, (axis_size,) + v.shape)
            for v, batched in zip((a, b, group_sizes), in_batched)
        )
        return _gemm(dataclasses.replace(call, out_spec=None), a, b, group_sizes), True

    return gemm(a, b, group_sizes)


def _check(plan: Plan, op: str) -> None:
    if not isinstance(plan, Plan) or plan.op != op:
        got = plan.op if isinstance(plan, Plan) else type(plan).__name__
        raise ValueError(f"jax_cake.primitives.grouped: the {op} role needs a plan of op {op!r}, got {got}")


def _cotangent_specs(*primals):
    """Each primal's PartitionSpec under Explicit axes (its cotangent is asked for in it),
    else Nones."""
    return partitioning.explicit_specs(*primals) or (None,) * len(primals)


def _plan(op: str, a, b, groups: int, call: Call, out_dtype="bfloat16") -> Plan:
    """The Plan of a backward's GEMM `op` on a, b, with call's `deterministic`."""
    device = device_lib.current(a, b)
    return plan_for(op, a.shape, b.shape, groups, device, out_dtype=out_dtype, deterministic=call.deterministic)


# --- the three roles, each the others' derivative -------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _role(a, b, group_sizes, call: Call):
    """The grouped GEMM of role call.plan.op on a, b (rounded to bf16 for the product)."""
    return _gemm(call, a.astype(_BF16), b.astype(_BF16), group_sizes)


def _role_fwd(a, b, group_sizes, call):
    return _role(a, b, group_sizes, call), (a, b, group_sizes)


def _role_bwd(call, saved, g):
    a, b, group_sizes = saved
    op = call.plan.op
    a_spec, b_spec = _cotangent_specs(a, b)
    # G from the weight-like operand: b of fwd and dgrad, the cotangent of wgrad (which
    # takes that place in fwd and dgrad; an FP32 one is rounded to bf16 by the GEMM).
    groups = (g if op == "grouped_wgrad" else b).shape[-3]
    if op != "grouped_wgrad":
        g = g.astype(_BF16)
    w_dtype = jnp.dtype(b.dtype).name

    def run(role, p, q, spec, out_dtype="bfloat16"):
        plan = _plan(role, p, q, groups, call, out_dtype=out_dtype)
        return _role(p, q, group_sizes, Call(plan, call.deterministic, spec, call.aligned))

    if op == "grouped_fwd":  # a = x, b = w
        da, db = run("grouped_dgrad", g, b, a_spec), run("grouped_wgrad", g, a, b_spec, w_dtype)
    elif op == "grouped_dgrad":  # a = dy, b = w
        da, db = run("grouped_fwd", g, b, a_spec), run("grouped_wgrad", a, g, b_spec, w_dtype)
    else:  # a = dy, b = x
        da, db = run("grouped_fwd", b, g, a_spec), run("grouped_dgrad", a, g, b_spec)
    return da.astype(a.dtype), db.astype(b.dtype), None


_role.defvjp(_role_fwd, _role_bwd)


def fwd(x, w, group_sizes, plan: Plan, *, deterministic: bool = True, out_spec=None, aligned: bool = False):
    """y [M, N] bf16, y[r] = x[r] . w[g(r)]^T: x [M, K] bf16, w [G, N, K] bf16 or an FP32
    master; rows past the groups are 0. plan: op "grouped_fwd". deterministic: for the
    plans of its backward. out_spec: y's PartitionSpec under Explicit axes (None: the
    rule's). aligned: x's rows are laid out already (Call.aligned; rows past the groups
    unspecified)."""
    _check(plan, "grouped_fwd")
    return _role(x, w, group_sizes, Call(plan, bool(deterministic), out_spec, bool(aligned)))


def dgrad(dy, w, group_sizes, plan: Plan, *, deterministic: bool = True, out_spec=None, aligned: bool = False):
    """dx [M, K] bf16, dx[r] = dy[r] . w[g(r)]: dy [M, N] bf16, w [G, N, K] bf16 or an FP32
    master; rows past the groups are 0 (aligned: as fwd's). plan: op "grouped_dgrad"."""
    _check(plan, "grouped_dgrad")
    return _role(dy, w, group_sizes, Call(plan, bool(deterministic), out_spec, bool(aligned)))


def wgrad(dy, x, group_sizes, plan: Plan, *, deterministic: bool = True, out_spec=None, aligned: bool = False):
    """dw [G, N, K] in plan.out_dtype from the FP32 sum, dw[g] = dy[rows of g]^T . x[rows of
    g]: dy [M, N], x [M, K] bf16; exactly 0 for an empty group. plan: op "grouped_wgrad"
    (G = plan.groups). aligned: dy and x laid out already, group_sizes the padded sizes, the
    rows in each group's padding 0 in dy or x (Call.aligned)."""
    _check(plan, "grouped_wgrad")
    return _role(dy, x, group_sizes, Call(plan, bool(deterministic), out_spec, bool(aligned)))


def _gated_kernel(plan: Plan, activation: str, aligned: bool, x, w, group_sizes):
    """(h, gu) of the gated grouped kernel (plan op "grouped_fwd_gated") on x, through the
    PaddedLayout unless aligned (_kernel's and _aligned_kernel's rules)."""
    if aligned:
        row_table, _ = _aligned_tables(group_sizes, x.shape[0], plan.tile[2])
        return gemm_lib.grouped_fwd_gated(x, w, row_table, plan, activation)
    layout = padded_layout(group_sizes, x.shape[0], k_tile=plan.tile[2])
    h, gu = gemm_lib.grouped_fwd_gated(layout.lay_out(x), w, layout.row_table, plan, activation)
    return layout.gather(h), layout.gather(gu)


def fwd_gated(
    x, w, group_sizes, plan: Plan, activation: str, block: int, *, deterministic: bool = True, aligned: bool = False
):
    """(h [M, F], gu [M, 2F]) bf16: the grouped forward over w [G, 2F, K] bf16, each group's
    gate and up rows interleaved in blocks of `block` (reference.interleave, axis 1), gu = x
    . w[g]^T (named remat.PREACTIVATION_NAME) and h = reference.gate(g, u, activation); rows
    past the groups are 0 (aligned: unspecified, as fwd's).

    For a plan of op "grouped_fwd_gated" (planner.grouped.plan_grouped_gated) on unbatched
    operands that need no partitioning, one custom call writes gu and h from the accumulator
    tile (h then named remat.ACTIVATION_NAME); otherwise, and under vmap or a partitioning
    rule, fwd writes gu and an XLA pass makes h: the same values up to the FP32 rounding of
    the activation. deterministic: for the plans of the backward of second order."""
    store_plan = plan.unfused()
    _check(store_plan, "grouped_fwd")

    def store_then_gate(x, w, group_sizes):
        gu = fwd(x, w, group_sizes, store_plan, deterministic=deterministic, aligned=aligned)
        gu = remat.name_preactivation(gu)
        return reference.gate(*reference.deinterleave(gu, -1, block), activation), gu

    if plan.op != "grouped_fwd_gated" or block != contract.GATE_BLOCK:
        return store_then_gate(x, w, group_sizes)

    def gated_call(x, w, group_sizes):
        cuda = functools.partial(_gated_kernel, plan, activation, aligned)
        h, gu = jax.lax.platform_dependent(
            x.astype(_BF16), w.astype(_BF16), group_sizes, default=store_then_gate, cuda=cuda
        )
        return remat.name_activation(h), remat.name_preactivation(gu)

    return fused_or(gated_call, store_then_gate, (True, True), x, w, group_sizes)
