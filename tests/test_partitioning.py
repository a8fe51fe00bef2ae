"""jit with sharded inputs on 8 fake CPU devices: the partitioning rule of every GEMM.

Each case runs one compiled step (y and the vjp of a fixed cotangent) under Auto axes
(custom_partitioning, Shardy) and under Explicit axes (jax.set_mesh, shard_map), checks
values and gradients against the unsharded run, and reads the collectives of the
compiled HLO: the reduction the math needs and no all-gather of x.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_cake as jc
from jax_cake.primitives import partitioning
from helpers import rand, rel_err

BF16, F32 = jnp.bfloat16, jnp.float32
_COLLECTIVE = re.compile(
    r"= \(?([a-z0-9]+\[[0-9,]*\])[^=]*? (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)\("
)


def collectives(text: str) -> list[tuple[str, str]]:
    """(kind, result shape) of every non-scalar collective in compiled HLO text."""
    found = [(m.group(2), m.group(1)) for m in map(_COLLECTIVE.search, text.splitlines()) if m]
    return [(kind, shape) for kind, shape in found if not shape.endswith("[]")]


def _dims(shape: str) -> tuple[int, ...]:
    return tuple(int(d) for d in shape[shape.index("[") + 1 : -1].split(",") if d)


def _mesh(shape, names, explicit):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def _step(op):
    """(x, w, ct) -> (y, dx, dw): one forward and the vjp of the cotangent ct."""

    def step(x, w, ct):
        y, vjp = jax.vjp(op, x, w)
        if partitioning.explicit_mesh(y) is not None:  # the cotangent has y's type
            ct = jax.sharding.reshard(ct, jax.typeof(y).sharding.spec)
        return (y, *vjp(ct.astype(y.dtype)))

    return step


def _run(op, mesh, x, w, ct, x_spec, w_spec, ct_spec=P()):
    """The sharded step's outputs and compiled HLO text, plus the unsharded outputs.

    ct (y's cotangent) comes sharded as y is in a model (by ct_spec). Under Auto axes the
    outputs are asked for in those shardings (y as ct, dx as x, dw as w), as a training
    step's optimizer update would; under Explicit axes the types carry them."""
    named = lambda spec: NamedSharding(mesh, spec)
    explicit = partitioning.explicit_mesh(jax.device_put(x, named(P()))) is not None
    step = jax.jit(_step(op), out_shardings=None if explicit else tuple(map(named, (ct_spec, x_spec, w_spec))))
    args = (
        jax.device_put(x, NamedSharding(mesh, x_spec)),
        jax.device_put(w, NamedSharding(mesh, w_spec)),
        jax.device_put(ct, NamedSharding(mesh, ct_spec)),
    )
    with jax.set_mesh(mesh):
        compiled = step.lower(*args).compile()
        got = compiled(*args)
    return got, compiled.as_text(), step(x, w, ct)


def _close(got, want, tol):
    err = rel_err(got, want)
    assert err <= tol, err


def _check_values(got, want, w_dtype):
    (y, dx, dw), (ry, rdx, rdw) = got, want
    assert (y.dtype, dx.dtype, dw.dtype) == (ry.dtype, rdx.dtype, rdw.dtype)
    _close(y, ry, 1e-2)
    _close(dx, rdx, 1e-2)
    _close(dw, rdw, 1e-5 if w_dtype == F32 else 1e-2)


def _no_gather_of(calls, *shapes):
    gathered = {_dims(s) for kind, s in calls if kind == "all-gather"}
    for shape in shapes:
        assert tuple(shape) not in gathered and (1, *shape) not in gathered, calls


# --- dense_projection: DP, TP by column and by row, FSDP; Auto and Explicit ---------------

T, K, O = 64, 32, 16
DENSE_CASES = {
    # name: (mesh shape, names, x, w and y specs, the expected collectives {kind: [shapes]})
    "dp": ((8,), ("d",), P("d"), P(), P("d"), {"all-reduce": [(1, O, K)]}),  # dw
    "tp_col": ((8,), ("d",), P(), P("d"), P(None, "d"), {"all-reduce": [(1, T, K)]}),  # dx
    "tp_row": ((8,), ("d",), P(None, "d"), P(None, "d"), P(), {"all-reduce": [(1, T, O)]}),  # y
    # w gathered (forward, backward), dw reduce-scattered
    "fsdp": ((8,), ("d",), P("d"), P("d"), P("d"), {"all-gather": [(1, O, K)], "reduce-scatter": [(1, O // 8, K)]}),
    # dw summed over dp, dx over tp
    "dp_x_tp": (
        (4, 2),
        ("dp", "tp"),
        P("dp"),
        P("tp"),
        P("dp", "tp"),
        {"all-reduce": [(1, O // 2, K), (1, T // 4, K)]},
    ),
}


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize(
    "case,w_dtype",
    [(c, F32) for c in DENSE_CASES] + [("dp", BF16), ("fsdp", BF16), ("tp_row", BF16)],
)
def test_dense_projection_sharded_equals_unsharded(case, w_dtype, explicit):
    shape, names, x_spec, w_spec, y_spec, expected = DENSE_CASES[case]
    x, w, ct = rand(1, (T, K), BF16), rand(2, (O, K), w_dtype), rand(3, (T, O), F32)
    got, text, want = _run(jc.dense_projection, _mesh(shape, names, explicit), x, w, ct, x_spec, w_spec, y_spec)
    _check_values(got, want, w_dtype)
    calls = collectives(text)
    _no_gather_of(calls, (T, K), (T, O))
    kinds = {}
    for kind, s in calls:
        kinds.setdefault(kind, set()).add(_dims(s))
    assert set(kinds) == set(expected), calls
    for kind, shapes in expected.items():
        # XLA may keep a 1-sized leading axis or drop it
        assert all(s in kinds[kind] or s[1:] in kinds[kind] for s in shapes), (kind, calls)
    if explicit:  # each gradient's type carries its primal's sharding
        assert partitioning.normalize(jax.typeof(got[1]).sharding.spec, 2) == partitioning.normalize(x_spec, 2)
        assert partitioning.normalize(jax.typeof(got[2]).sharding.spec, 2) == partitioning.normalize(w_spec, 2)


@pytest.mark.parametrize("case", DENSE_CASES)
def test_explicit_shardings_without_a_mesh_context(case):
    """Explicit-axis arrays (jax.make_mesh's default) passed to jit with no `jax.set_mesh`:
    the resharding the rule asks for names its mesh, so it needs no context."""
    shape, names, x_spec, w_spec, y_spec, _ = DENSE_CASES[case]
    mesh = _mesh(shape, names, explicit=True)
    x, w, ct = rand(1, (T, K), BF16), rand(2, (O, K), F32), rand(3, (T, O), F32)

    def step(x, w, ct):
        y, vjp = jax.vjp(jc.dense_projection, x, w)
        return (y, *vjp(jax.sharding.reshard(ct, jax.typeof(y).sharding).astype(y.dtype)))

    args = [jax.device_put(v, NamedSharding(mesh, s)) for v, s in ((x, x_spec), (w, w_spec), (ct, y_spec))]
    _check_values(jax.jit(step)(*args), jax.jit(_step(jc.dense_projection))(x, w, ct), F32)


def _grads(fn):
    return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(fn(x, w).astype(F32) ** 2), argnums=(0, 1)))


def _same(got, want, rtol=1e-6):
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        _close(g, r, rtol)


OPS_OF_X_W = {
    "dense": jc.dense_projection,
    "fused": lambda x, w: jc.fused_projections(x, [w, 2 * w])[1],
    "gated": lambda x, w: jc.gated_projection(x, w, 0.5 * w),
    "swiglu": lambda x, w: jc.swiglu_mlp(x, w, 0.5 * w, w.T[:, : w.shape[0]]),
}


@pytest.mark.parametrize("op", OPS_OF_X_W)
def test_auto_axes_with_unsharded_operands(op):
    """jit under `jax.set_mesh` of an Auto mesh with operands that are not sharded, and a
    shard_map over one axis of two: the partitioner's mesh has no devices there, and the
    per-shard plans go to the default device."""
    x, w = rand(1, (T, K), BF16), rand(2, (O, K), F32)
    fn = OPS_OF_X_W[op]
    want = _grads(fn)(x, w)
    with jax.set_mesh(_mesh((8,), ("d",), False)):
        _same(_grads(fn)(x, w), want)
    mesh = _mesh((4, 2), ("d", "m"), False)
    y = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"), axis_names={"d"}))(x, w)
    _same(y, fn(x, w))


def test_out_sharding_reshards_unsharded_operands_under_explicit_axes():
    x, w, r = rand(1, (T, K), BF16), rand(2, (O, K), F32), rand(3, (T, O), BF16)
    with jax.set_mesh(_mesh((8,), ("d",), True)):
        y = jax.jit(lambda x: jc.dense_projection(x, w, out_sharding=P("d")))(x)
        y_res = jax.jit(lambda x: jc.dense_projection(x, w, residual=r, out_sharding=P(None, "d")))(x)
    assert jax.typeof(y).sharding.spec == P("d", None) and jax.typeof(y_res).sharding.spec == P(None, "d")
    _same(y, jc.dense_projection(x, w))
    _same(y_res, jc.dense_projection(x, w, residual=r))


@pytest.mark.parametrize("op", OPS_OF_X_W)
def test_sequence_parallel_activations_under_explicit_axes(op):
    """x [B, S, d] sharded on S (after an unsharded B): the tokens are gathered for the
    GEMM (no sharding of the merged T holds them), the values are the unsharded ones and
    dx keeps x's sharding."""
    x, w = rand(1, (4, 16, K), BF16), rand(2, (O, K), F32)
    fn = OPS_OF_X_W[op]
    want = _grads(fn)(x, w)
    with jax.set_mesh(_mesh((4, 2), ("d", "m"), True)):
        got = _grads(fn)(jax.device_put(x, P(None, "d")), w)
    _same(got, want)
    assert partitioning.normalize(jax.typeof(got[1][0]).sharding.spec, 3) == ((), ("d",), ())


def test_shape_polymorphic_export_under_a_mesh():
    """A symbolic token count plans the XLA path; under a mesh that GEMM is XLA's to
    partition (custom_partitioning lowers static shapes only)."""
    from jax import export

    (t,) = export.symbolic_shape("t")
    specs = jax.ShapeDtypeStruct((t, K), BF16), jax.ShapeDtypeStruct((O, K), F32)
    with jax.set_mesh(_mesh((8,), ("d",), False)):
        exported = export.export(jax.jit(lambda x, w: jc.dense_projection(x, w, out_sharding=P("d"))))(*specs)
        x, w = rand(1, (T, K), BF16), rand(2, (O, K), F32)
        named = lambda v, spec: jax.device_put(v, NamedSharding(jax.sharding.get_mesh(), spec))
        y = exported.call(named(x, P("d")), named(w, P()))
    assert str(exported.out_avals[0].shape) == f"(t, {O})"
    _same(y, jc.dense_projection(x, w))


# --- batched_projection and router_logits ---------------------------------------------------

BATCHED_CASES = {
    "expert_parallel": (P("d"), P("d"), set()),  # B over devices: everything local
    "dp_tokens": (P(None, "d"), P(), {"all-reduce"}),  # dw summed over the token shards
}  # y is sharded as x


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("case", BATCHED_CASES)
def test_batched_projection_sharded_equals_unsharded(case, explicit):
    x_spec, w_spec, kinds = BATCHED_CASES[case]
    x, w, ct = rand(4, (8, 32, K), BF16), rand(5, (8, O, K), F32), rand(6, (8, 32, O), F32)
    got, text, want = _run(jc.batched_projection, _mesh((8,), ("d",), explicit), x, w, ct, x_spec, w_spec, x_spec)
    _check_values(got, want, F32)
    calls = collectives(text)
    assert {k for k, _ in calls} == kinds, calls
    if kinds:
        assert (8, O, K) in {_dims(s) for _, s in calls}, calls


ROUTER_CASES = {
    "dp": (P("d"), P(), P("d"), (16, K)),  # dw [E, d] all-reduced
    "expert_parallel": (P(), P("d"), P(None, "d"), (64, K)),  # E over devices: dx [T, d] all-reduced
}


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("case", ROUTER_CASES)
def test_router_logits_sharded_equals_unsharded(case, explicit):
    x_spec, w_spec, y_spec, reduced = ROUTER_CASES[case]
    x, w, ct = rand(7, (64, K), F32), 0.1 * rand(8, (16, K), F32), rand(9, (64, 16), F32)
    (y, dx, dw), text, (ry, rdx, rdw) = _run(
        jc.router_logits, _mesh((8,), ("d",), explicit), x, w, ct, x_spec, w_spec, y_spec
    )
    for got, want in ((y, ry), (dx, rdx), (dw, rdw)):
        assert got.dtype == F32
        _close(got, want, 1e-5)
    calls = collectives(text)
    assert [(k, _dims(s)) for k, s in calls] == [("all-reduce", reduced)], calls


# --- out_sharding: a psum over d_in becomes a reduce-scatter ----------------------------------


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_out_sharding_turns_the_row_parallel_psum_into_a_reduce_scatter(explicit):
    mesh = _mesh((8,), ("d",), explicit)
    x, w = rand(10, (T, K), BF16), rand(11, (O, K), F32)
    f = jax.jit(lambda x, w: jc.dense_projection(x, w, out_sharding=P("d")))
    xs, ws = (jax.device_put(a, NamedSharding(mesh, P(None, "d"))) for a in (x, w))
    with jax.set_mesh(mesh):
        compiled = f.lower(xs, ws).compile()
        y = compiled(xs, ws)
    assert y.sharding.spec[0] == "d"
    assert {k for k, _ in collectives(compiled.as_text())} == {"reduce-scatter"}, collectives(compiled.as_text())
    _close(y, jc.dense_projection(x, w), 1e-2)


def test_out_sharding_is_validated_and_named():
    x, w = jax.ShapeDtypeStruct((T, K), BF16), jax.ShapeDtypeStruct((O, K), F32)
    trace = lambda **kw: jax.jit(lambda x, w: jc.dense_projection(x, w, **kw)).trace(x, w)
    with pytest.raises(TypeError, match="dense_projection: out_sharding must be"):
        trace(out_sharding="d")
    with pytest.raises(ValueError, match="out_sharding=.* no mesh is set"):
        trace(out_sharding=P("d"))
    mesh = _mesh((8,), ("d",), True)
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match="out_sharding=.* names mesh axis 'e'"):
            trace(out_sharding=P("e"))
        with pytest.raises(ValueError, match="out_sharding=.* more than the output's rank 2"):
            trace(out_sharding=P(None, None, "d"))
        with pytest.raises(ValueError, match="uses mesh axis 'd' twice"):
            trace(out_sharding=P("d", "d"))
        with pytest.raises(ValueError, match=r"splits output dimension 1 \(size 12\) into 8 parts"):
            jax.jit(lambda x, w: jc.dense_projection(x, w, out_sharding=P(None, "d"))).trace(
                x, jax.ShapeDtypeStruct((12, K), F32)
            )
    xb, wb = jax.ShapeDtypeStruct((2, T, K), BF16), jax.ShapeDtypeStruct((2, O, K), F32)
    with pytest.raises(TypeError, match="batched_projection: out_sharding must be"):
        jax.jit(lambda x, w: jc.batched_projection(x, w, out_sharding=1)).trace(xb, wb)


# --- the plan is made per shard, in the partition callback -----------------------------------


def test_partition_callback_plans_the_per_shard_shapes(monkeypatch):
    from jax_cake.primitives import call

    seen = []
    real = call.make_plan
    monkeypatch.setattr(call, "make_plan", lambda op, **kw: seen.append((op, kw["tokens"])) or real(op, **kw))
    mesh = _mesh((8,), ("d",), False)
    x, w = rand(12, (8 * 40, K), BF16), rand(13, (24, K), F32)
    ct = rand(14, (8 * 40, 24), F32)
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in ((x, P("d")), (w, P()), (ct, P("d")))]
    jax.jit(_step(jc.dense_projection)).lower(*args).compile()
    assert {("fwd", 40), ("dgrad", 40), ("wgrad", 40)} <= set(seen), seen


# --- the rule itself -----------------------------------------------------------------------------

SIZES = {"d": 8, "e": 2}


@pytest.mark.parametrize(
    "gemm,specs,arg_specs,out_spec,psum",
    [
        # data parallel: tokens keep their axis; wgrad sums over it
        ("fwd", (P(None, "d"), P()), (((), ("d",), ()), ((), (), ())), ((), ("d",), ()), ()),
        ("wgrad", (P(None, "d"), P(None, "d")), (((), ("d",), ()), ((), ("d",), ())), ((), (), ()), ("d",)),
        # FSDP: w's d_out shares x's token axis: w is gathered, x is not
        ("fwd", (P(None, "d"), P(None, "d")), (((), ("d",), ()), ((), (), ())), ((), ("d",), ()), ()),
        # x replicated, w sharded on d_in: x is sliced locally, the partial sums are added
        ("fwd", (P(), P(None, None, "d")), (((), (), ("d",)), ((), (), ("d",))), ((), (), ()), ("d",)),
        # 2 x 8 mesh: w's (e, d) d_out sharding keeps e only (d is x's)
        ("fwd", (P(None, "d"), P(None, ("e", "d"))), (((), ("d",), ()), ((), ("e",), ())), ((), ("d",), ("e",)), ()),
        # router, experts over e
        ("router_dgrad", (P("d"), P("e")), ((("d",), ("e",)), (("e",), ())), (("d",), ()), ("e",)),
    ],
)
def test_decide(gemm, specs, arg_specs, out_spec, psum):
    g = partitioning.GEMMS[gemm]
    shapes = [(2, 64, 32), (2, 16, 32)] if not gemm.startswith("router") else [(64, 16), (16, 32)]
    if gemm == "wgrad":
        shapes = [(2, 64, 16), (2, 64, 32)]
    d = partitioning.decide(g, SIZES, shapes, specs)
    assert (d.arg_specs, d.out_spec, d.psum_axes) == (arg_specs, out_spec, psum)


def test_decide_gathers_an_uneven_factor_and_scatters_where_asked():
    g = partitioning.GEMMS["wgrad"]
    uneven = partitioning.decide(g, SIZES, [(1, 60, 16), (1, 60, 32)], (P(None, "d"), P(None, "d")))
    assert uneven.arg_specs == (((), (), ()), ((), (), ())) and not uneven.reduces
    fsdp = partitioning.decide(g, SIZES, [(1, 64, 16), (1, 64, 32)], (P(None, "d"), P(None, "d")), P(None, "d"))
    assert (fsdp.scatter_dim, fsdp.scatter_axes, fsdp.psum_axes) == (1, ("d",), ())
    assert fsdp.out_spec == ((), ("d",), ())


def test_every_gemm_has_a_shardy_rule_with_its_contracted_factor():
    rules = {name: (g.rule, g.contracted) for name, g in partitioning.GEMMS.items()}
    assert rules == {
        "fwd": ("b t k, b o k -> b t o", ("k",)),
        "dgrad": ("b t o, b o k -> b t k", ("o",)),
        "wgrad": ("b t o, b t k -> b o k", ("t",)),
        "router_fwd": ("t k, e k -> t e", ("k",)),
        "router_dgrad": ("t e, e k -> t k", ("e",)),
        "router_wgrad": ("t e, t k -> e k", ("t",)),
    }


def test_gspmd_partitioner_runs_the_same_rule():
    """With Shardy off, the GSPMD callbacks give the same data-parallel program."""
    mesh = _mesh((8,), ("d",), False)
    x, w = rand(14, (T, K), BF16), rand(15, (O, K), F32)
    f = jax.jit(jax.grad(lambda x, w: jnp.sum(jc.dense_projection(x, w).astype(F32) ** 2), argnums=(0, 1)))
    want = f(x, w)
    args = (jax.device_put(x, NamedSharding(mesh, P("d"))), jax.device_put(w, NamedSharding(mesh, P())))
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        f = jax.jit(jax.grad(lambda x, w: jnp.sum(jc.dense_projection(x, w).astype(F32) ** 2), argnums=(0, 1)))
        compiled = f.lower(*args).compile()
        got = compiled(*args)
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)
    assert [(k, _dims(s)) for k, s in collectives(compiled.as_text())] == [("all-reduce", (1, O, K))]
    _close(got[0], want[0], 1e-2)
    _close(got[1], want[1], 1e-5)


# --- a sharded contraction: FP32 partial sums, one rounding -----------------------------------
# Tensor parallel over d_in (Megatron's row-parallel o and down projections): each shard's
# partial product is summed over the shards in FP32 and rounded once, as XLA's own dot does,
# so the gradients equal the unsharded ones to FP32 precision (bf16 partials cost 1.5e-3 in
# dw and 3.1e-3 in dx here).

D_IN = 256


def _contraction_sharded_cases():
    dense = lambda x, w: jc.dense_projection(x, w)
    fused = lambda x, w: jnp.concatenate(jc.fused_projections(x, (w[:16], w[16:])), axis=-1)
    kn = lambda x, w: jc.dot_general(x, w.T, (((1,), (0,)), ((), ())))  # Flax's [d_in, d_out] kernel
    batched = lambda x, w: jc.batched_projection(x.reshape(2, 32, D_IN), w.reshape(2, 24, D_IN)).reshape(64, 24)
    router = lambda x, w: jc.router_logits(x.astype(F32), w)
    return {
        "dense": (dense, (64, D_IN), (48, D_IN), F32),
        "dense_bf16_w": (dense, (64, D_IN), (48, D_IN), BF16),
        "fused": (fused, (64, D_IN), (48, D_IN), F32),
        "flax_kn": (kn, (64, D_IN), (48, D_IN), F32),
        "batched": (batched, (64, D_IN), (48, D_IN), F32),
        "router": (router, (64, D_IN), (48, D_IN), F32),
    }


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("case", list(_contraction_sharded_cases()))
def test_contraction_sharded_gradients_equal_the_unsharded_ones(case, explicit):
    op, x_shape, w_shape, w_dtype = _contraction_sharded_cases()[case]
    x, w = rand(40, x_shape, BF16), (0.05 * rand(41, w_shape, F32)).astype(w_dtype)

    def loss(x, w):
        return jnp.sum(op(x, w).astype(F32) ** 2)

    grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    want = grads(x, w)
    mesh = _mesh((8,), ("d",), explicit)
    args = [jax.device_put(a, NamedSharding(mesh, P(None, "d"))) for a in (x, w)]
    with jax.set_mesh(mesh):
        compiled = grads.lower(*args).compile()
        got = compiled(*args)
    # The partial products are summed over the shards in FP32: the reduction of y is FP32.
    reduced = [s for kind, s in collectives(compiled.as_text()) if kind in ("all-reduce", "reduce-scatter")]
    assert reduced and all(s.startswith("f32") for s in reduced), reduced
    (got_loss, (dx, dw)), (want_loss, (rdx, rdw)) = got, want
    assert (dx.dtype, dw.dtype) == (rdx.dtype, rdw.dtype)
    dw_tol = 1e-5 if w_dtype == F32 else 4e-3  # a bf16 dw is rounded once more
    assert rel_err(dw, rdw) <= dw_tol, (case, rel_err(dw, rdw))
    assert rel_err(dx, rdx) <= 2e-5, (case, rel_err(dx, rdx))
    assert abs(float(got_loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
