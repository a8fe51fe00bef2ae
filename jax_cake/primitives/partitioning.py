"""Sharding rules for the jax_cake GEMMs under `jax.jit` with sharded operands.

Every GEMM primitive (jax_cake.primitives) is an einsum over named factors:

    fwd           "b t k, b o k -> b t o"     router_fwd    "t k, e k -> t e"
    dgrad         "b t o, b o k -> b t k"     router_dgrad  "t e, e k -> t k"
    wgrad         "b t o, b t k -> b o k"     router_wgrad  "t e, t k -> e k"

A factor that is in an operand but not in the result is contracted. One rule (`decide`)
turns the operands' shardings into the shardings each operand is computed with, the
result's sharding and the reduction over the mesh axes of the contracted factors:

- The first operand (x, or dy: the activations) keeps its sharding: it is never gathered.
  Weight gradients (both operands activations) keep the token factor's sharding first.
- A factor both operands share (the batch b, the contracted factor) takes the first
  operand's axes; where the first operand leaves it whole and the second one shards it on
  axes the first does not use, the first operand is sliced locally (it is replicated on
  those axes, so this moves no data).
- The second operand's free factor keeps its axes up to the first one the first operand
  already uses (FSDP: w sharded on the token axis is gathered there, x is not).
- A factor left whole that the result is wanted sharded on (a consumer's sharding, or
  out_sharding) is sliced locally where its operand is replicated on those axes.
- Contracted factors sharded on mesh axes give one psum over them, or a reduce-scatter
  (psum_scatter) where the result is wanted sharded on those axes (FSDP weight grads,
  sequence-parallel outputs).

Two ways run the rule:

- Auto axes (and GSPMD): `jax.experimental.custom_partitioning` with a Shardy
  `sharding_rule` and the GSPMD callbacks. The partition callback receives the per-shard
  shapes; the local function plans the GEMM for those shapes and the mesh's device.
- Explicit axes (`jax.sharding.AxisType.Explicit`, `jax.set_mesh`): the shardings are in
  the operands' types. The operands are resharded (`jax.sharding.reshard`) and the local
  GEMM runs in `jax.shard_map` with the reduction there. The result's type carries the
  sharding the rule gives.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any, Protocol

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cake import logs
from jax_cake.planner import device as device_lib

Axes = tuple[str, ...]  # the mesh axes one dimension is sharded on, major first
Spec = tuple[Axes, ...]  # one Axes per dimension


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One GEMM as an einsum over factors: "a-factors, b-factors -> result-factors"."""

    name: str
    rule: str

    @functools.cached_property
    def factors(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        lhs, result = self.rule.split("->")
        a, b = lhs.split(",")
        return tuple(a.split()), tuple(b.split()), tuple(result.split())

    @property
    def tokens_contracted(self) -> bool:
        """A weight gradient: both operands are activations, contracted over the tokens."""
        return "t" in self.contracted

    @functools.cached_property
    def contracted(self) -> tuple[str, ...]:
        a, b, result = self.factors
        return tuple(f for f in dict.fromkeys(a + b) if f not in result)


GEMMS = {
    g.name: g
    for g in (
        Gemm("fwd", "b t k, b o k -> b t o"),
        Gemm("dgrad", "b t o, b o k -> b t k"),
        Gemm("wgrad", "b t o, b t k -> b o k"),
        Gemm("router_fwd", "t k, e k -> t e"),
        Gemm("router_dgrad", "t e, e k -> t k"),
        Gemm("router_wgrad", "t e, t k -> e k"),
    )
}


@dataclasses.dataclass(frozen=True)
class Decision:
    """How one GEMM runs on a mesh: operand and result shardings, the reduction."""

    arg_specs: tuple[Spec, Spec]
    out_spec: Spec
    psum_axes: Axes = ()  # all-reduce over these axes
    scatter_dim: int | None = None  # reduce-scatter the result's dim over scatter_axes
    scatter_axes: Axes = ()

    @property
    def reduces(self) -> bool:
        return bool(self.psum_axes or self.scatter_axes)


def normalize(spec: Any, ndim: int) -> Spec:
    """A PartitionSpec (or None) as one tuple of mesh axes per dimension."""
    entries = list(spec) if spec is not None else []
    entries += [None] * (ndim - len(entries))
    out = []
    for e in entries[:ndim]:
        if e is None or e is P.UNCONSTRAINED:
            out.append(())
        elif isinstance(e, str):
            out.append((e,))
        else:
            out.append(tuple(e))
    return tuple(out)


def to_pspec(spec: Spec) -> P:
    return P(*[None if not axes else axes[0] if len(axes) == 1 else axes for axes in spec])


def decide(gemm: Gemm, axis_sizes: dict[str, int], shapes, specs, out_request: Any = None) -> Decision:
    """The rule of the module docstring for operands of global `shapes` sharded by `specs`.

    `out_request`: the result sharding a consumer wants (a PartitionSpec), or None. It only
    turns a psum into a reduce-scatter; the result's sharding otherwise follows the rule.
    """
    fa, fb, fr = gemm.factors
    sa, sb = normalize(specs[0], len(fa)), normalize(specs[1], len(fb))
    size = dict(zip(fa, shapes[0])) | dict(zip(fb, shapes[1]))

    def parts(axes) -> int:
        return math.prod(axis_sizes[a] for a in axes)

    def even(f, axes) -> Axes:  # the longest prefix of axes that tiles the factor evenly
        axes = tuple(axes)
        while axes and size[f] % parts(axes):
            axes = axes[:-1]
        return axes

    fac: dict[str, Axes] = {}
    used: set[str] = set()

    def assign(f, axes):
        keep: list[str] = []
        for a in axes:
            if a in used:
                break
            keep.append(a)
        fac[f] = even(f, keep)
        used.update(fac[f])

    shared = [f for f in fa if f in fb]
    if gemm.tokens_contracted:  # weight gradients: the token factor first, from either operand
        for f in shared:
            assign(f, sa[fa.index(f)] or sb[fb.index(f)])
    for f, axes in zip(fa, sa):
        if f not in fac:
            assign(f, axes)
    for f, axes in zip(fb, sb):
        if f not in fac:
            assign(f, axes)  # the second operand's free factors: gathered where taken
        elif not fac[f] and axes and not used & set(axes):
            assign(f, axes)  # a shared factor the first operand leaves whole: slice it there
    request = normalize(out_request, len(fr)) if out_request is not None else None
    if request is not None:  # a whole free factor the result is wanted sharded on: slice it
        for f, want in zip(fr, request):
            if not fac[f] and want and not used & set(want) and size[f] % parts(want) == 0:
                assign(f, want)

    out_spec = [fac[f] for f in fr]
    psum_axes = tuple(a for f in gemm.contracted for a in fac[f])
    scatter_dim, scatter_axes = None, ()
    if psum_axes and request is not None:
        for d, f in enumerate(fr):
            have = out_spec[d]
            extra = request[d][len(have) :]
            if (
                request[d][: len(have)] == have
                and extra
                and set(extra) <= set(psum_axes)
                and size[f] % parts(have + extra) == 0
            ):
                scatter_dim, scatter_axes = d, extra
                out_spec[d] = have + extra
                psum_axes = tuple(a for a in psum_axes if a not in extra)
                break
    return Decision(
        arg_specs=(tuple(fac[f] for f in fa), tuple(fac[f] for f in fb)),
        out_spec=tuple(out_spec),
        psum_axes=psum_axes,
        scatter_dim=scatter_dim,
        scatter_axes=scatter_axes,
    )


def reduce(y, decision: Decision):
    """The reduction of a local partial result (inside shard_map or a partition callback)."""
    if decision.scatter_axes:
        y = jax.lax.psum_scatter(y, decision.scatter_axes, scatter_dimension=decision.scatter_dim, tiled=True)
    if decision.psum_axes:
        y = jax.lax.psum(y, decision.psum_axes)
    return y


# --- Auto axes and GSPMD: custom_partitioning -----------------------------------------


class ShardGemm(Protocol):
    """The GEMM run on each shard (jax_cake.primitives.call.PlannedGemm): hashable (static
    under custom_partitioning), with the dtype of its result."""

    out_dtype: Any

    def __call__(self, a, b, device=None, reduce_dtype=None):
        """The result on these operands. device: None for the whole-array call (the plan made
        at trace time), else the device to plan the per-shard GEMM for. reduce_dtype: when
        set, the dtype the result is produced in before the reduction (FP32 for weight
        gradients, so partial sums are not rounded to bf16 before they are added)."""


def _spec_of(sharding, ndim: int):
    if sharding is None:
        return None
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    if sharding.is_fully_replicated:
        return P()
    return None  # not expressible on the mesh: computed replicated (correct, not fast)


def _mesh_decision(name: str, mesh, arg_shapes, result_shape) -> Decision:
    gemm = GEMMS[name]
    specs = [_spec_of(getattr(s, "sharding", None), len(s.shape)) for s in arg_shapes]
    request = _spec_of(getattr(result_shape, "sharding", None), len(result_shape.shape)) if result_shape else None
    return decide(gemm, dict(mesh.shape), [s.shape for s in arg_shapes], specs, request)


def _infer(name, local, mesh, arg_shapes, result_shape):
    del local
    d = _mesh_decision(name, mesh, arg_shapes, None)
    return NamedSharding(mesh, to_pspec(d.out_spec))


def _propagate_user(name, local, mesh, user_shape):
    del name, local, mesh
    return user_shape.sharding


def _device_of(mesh) -> device_lib.DeviceInfo:
    """The device the per-shard GEMMs are planned for: the mesh's, else (a mesh the
    partitioner hands over without devices: jit under `jax.set_mesh` on unsharded operands)
    the one a trace would plan for."""
    first = mesh.devices.flat[0]
    return device_lib.current() if first is None else device_lib.from_jax_device(first)


def _partition(name, local, mesh, arg_shapes, result_shape):
    d = _mesh_decision(name, mesh, arg_shapes, result_shape)
    device = _device_of(mesh)
    out_dtype = result_shape.dtype

    def lower_fn(a, b):
        if not d.reduces:
            return local(a, b, device, None)
        return reduce(local(a, b, device, _reduce_dtype(out_dtype)), d).astype(out_dtype)

    arg_shardings = tuple(NamedSharding(mesh, to_pspec(s)) for s in d.arg_specs)
    return mesh, lower_fn, NamedSharding(mesh, to_pspec(d.out_spec)), arg_shardings


def _reduce_dtype(dtype):
    import jax.numpy as jnp

    return jnp.float32 if jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)) else dtype


@functools.cache
def _partitioned(name: str):
    gemm = GEMMS[name]

    @functools.partial(custom_partitioning, static_argnums=(0, 1))
    def op(name, local, a, b):
        return local(a, b, None, None)

    op.def_partition(
        partition=_partition,
        infer_sharding_from_operands=_infer,
        propagate_user_sharding=_propagate_user,
        sharding_rule=gemm.rule,
        reduction_factors=gemm.contracted,
    )
    return op


def partitioned_call(name: str, local: ShardGemm, a, b):
    """local(a, b) under jit on any mesh with Auto axes: partitioned by GEMMS[name]'s rule."""
    return _partitioned(name)(name, local, a, b)


# --- Explicit axes: shard_map -----------------------------------------------------------


def explicit_mesh(*arrays):
    """The abstract mesh of the operands' types if it has an Explicit axis, else None
    (None operands, absent options, are skipped)."""
    for a in arrays:
        if a is None:
            continue
        mesh = jax.typeof(a).sharding.mesh
        if not mesh.empty and any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
            return mesh
    return None


def merge_leading(a):
    """a [..., n] -> [1, T, n], T the product of the leading dimensions. A reshape, not
    [None]: the transpose of a reshape is a reshape (no reduce). Under Explicit axes the
    merged T keeps the leading dimensions' sharding where they are sharded first (tokens
    sharded on the batch dimension); a sharded dimension after an unsharded one (sequence
    parallel: [B, S@axis, n]) has no sharding of T to go to, so those dimensions are
    gathered, with a log line."""
    shape = (1, math.prod(a.shape[:-1]), a.shape[-1])
    if explicit_mesh(a) is None:
        return jax.numpy.reshape(a, shape)
    spec = normalize(jax.typeof(a).sharding.spec, a.ndim)
    sharded = [bool(axes) for axes in spec[:-1]]
    if sharded == sorted(sharded, reverse=True):
        return jax.numpy.reshape(a, shape)
    logs.once(
        logging.WARNING,
        "jax_cake: an operand %s sharded %s has a sharded leading dimension after an unsharded one; "
        "its tokens are gathered for the GEMM (shard the first leading dimension to keep them local)",
        str(a.shape),
        str(to_pspec(spec)),
    )
    return jax.numpy.reshape(a, shape, out_sharding=to_pspec(((), (), spec[-1])))


def explicit_call(name: str, local: ShardGemm, a, b, *, mesh, device, out_request: Any = None):
    """local(a, b) on operands whose types carry Explicit shardings on `mesh`."""
    gemm = GEMMS[name]
    specs = [jax.typeof(v).sharding.spec for v in (a, b)]
    d = decide(gemm, dict(mesh.shape), [a.shape, b.shape], specs, out_request)
    a, b = (_reshard(v, to_pspec(s)) for v, s in zip((a, b), d.arg_specs))

    def body(a, b):
        if not d.reduces:
            return local(a, b, device, None)
        return reduce(local(a, b, device, jax.numpy.float32), d).astype(local.out_dtype)

    in_specs = tuple(to_pspec(s) for s in d.arg_specs)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=to_pspec(d.out_spec))(a, b)


def _reshard(v, spec: P, mesh=None):
    """v resharded to `spec` on `mesh`; without one, on v's own mesh where its type has one
    (a bare PartitionSpec needs a `jax.set_mesh` context, and a caller may pass
    Explicit-sharded arrays without one), else on the context's mesh."""
    sharding = jax.typeof(v).sharding
    if normalize(sharding.spec, v.ndim) == normalize(spec, v.ndim):
        return v
    if mesh is None and not sharding.mesh.empty:
        mesh = sharding.mesh
    return jax.sharding.reshard(v, spec if mesh is None else NamedSharding(mesh, spec))


def reshard_to(v, spec):
    """v resharded to `spec` (its type's mesh, Explicit axes); v itself if it has it."""
    return _reshard(v, spec if isinstance(spec, P) else P(*spec))


# --- the operands' types: shard_map's varying axes, Explicit shardings ------------------


def varying_axes(a) -> frozenset:
    """The manual mesh axes `a` varies over (inside shard_map), else empty."""
    mat = getattr(jax.typeof(a), "mat", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def to_common_varying(*arrays):
    """Makes every operand varying over the union of their varying manual axes.

    Inside shard_map a replicated weight next to token-sharded activations would
    otherwise give the custom_vjp backward a cotangent whose manual axes do not match
    the input. pcast's transpose sums the gradient over the added axes, which
    is exactly the data-parallel weight-gradient reduction.
    """
    union = frozenset().union(*(varying_axes(a) for a in arrays))
    if not union:
        return arrays
    out = []
    for a in arrays:
        missing = tuple(sorted(union - varying_axes(a)))
        out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
    return tuple(out)


def explicit_specs(*arrays):
    """The operands' PartitionSpecs where their types carry Explicit shardings (None for a
    None operand), else None."""
    if explicit_mesh(*arrays) is None:
        return None
    return tuple(None if a is None else jax.typeof(a).sharding.spec for a in arrays)


def common_operands(*operands):
    """(operands, specs): the operands (arrays, or None for an absent one) made varying
    over the same manual axes (to_common_varying), and each one's PartitionSpec under
    Explicit axes (None elsewhere, and for an absent operand)."""
    common = iter(to_common_varying(*(v for v in operands if v is not None)))
    operands = tuple(None if v is None else next(common) for v in operands)
    return operands, explicit_specs(*operands) or (None,) * len(operands)


def to_specs(values, specs):
    """Each value resharded to its spec (Explicit axes), as it is where the spec (or the
    value) is None: a custom_vjp backward's cotangents in their primals' sharding types."""
    return tuple(v if v is None or spec is None else reshard_to(v, spec) for v, spec in zip(values, specs))


def apply_out_sharding(y, checked):
    """y with the sharding asked for (`checked`: (PartitionSpec, the caller's sharding) or
    None): a reshard where y's type or the asked-for mesh has Explicit axes (a constraint
    there is an assert, and y may be unsharded), a constraint otherwise."""
    if checked is None:
        return y
    spec, out_sharding = checked
    named = isinstance(out_sharding, NamedSharding)
    mesh = out_sharding.mesh if named else jax.sharding.get_abstract_mesh()
    if explicit_mesh(y) is None and not any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return jax.lax.with_sharding_constraint(y, out_sharding)
    return _reshard(y, spec, out_sharding.mesh if named else None)


def manual(*arrays) -> bool:
    """Inside shard_map over every mesh axis: the operands are already per-shard."""
    for a in arrays:
        mesh = jax.typeof(a).sharding.mesh
        if not mesh.empty and all(t == jax.sharding.AxisType.Manual for t in mesh.axis_types):
            return True
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and all(t == jax.sharding.AxisType.Manual for t in mesh.axis_types)


def one_device() -> bool:
    """Nothing to partition: one device in the process, or a one-device mesh in scope."""
    mesh = jax.sharding.get_abstract_mesh()
    return jax.device_count() == 1 or (not mesh.empty and mesh.size == 1)


def unpartitioned(*arrays) -> bool:
    """Whether a custom call may run on the operands as they are (no partitioning rule
    needed): nothing to partition, or inside shard_map over every mesh axis."""
    return manual(*arrays) or one_device()
