"""Plan-table tile rows: a fwd or dgrad det row naming the variant measured fastest at one
point. plan() runs that tile, schedule and cluster exactly there, under both values of
`deterministic` and under force("det"); a force() pin of the tile, schedule or cluster wins;
a variant the build lacks keeps the rule's pick; the fused planners keep the rule; the
CUDA lowering carries the row's variant."""

import re

import jax
import jax.numpy as jnp
import pytest

import jax_cake as jc
from jax_cake import contract
from jax_cake.planner import tables, variants
from helpers import H200, cuda_text, custom_call_lines

SOURCE = "jax_cake.tools.tune_tiles 2026-12-05 on NVIDIA H200 (132 SMs)"
QKV = dict(d_in=4096, d_out=6144)  # the fused QKV projection of Llama-3-8B
UP = dict(d_in=4096, d_out=28672)  # its fused gate/up projection


def tile_row(op="fwd", d_in=4096, d_out=6144, lo=8192, hi=8192, tile=(128, 176, 64), **extra):
    row = dict(
        op=op,
        d_in=d_in,
        d_out=d_out,
        out="bfloat16",
        min_tokens=lo,
        max_tokens=hi,
        program="det",
        exclude_tokens=[],
        tile=list(tile),
        schedule="pingpong",
        cluster=[2, 1],
        ratio=1.017,
        source=SOURCE,
        evidence="...",
    )
    row.update(extra)
    return row


def xla_row(**extra):
    row = dict(op="fwd", d_in=4096, d_out=96, out="bfloat16", min_tokens=16384, max_tokens=16384, program="xla")
    return {**row, "exclude_tokens": [], "ratio": 0.93, "source": "jax_cake.tools.tune 2026-12-02", **extra}


def table_of(*rows, sms=132):
    return tables.parse({"arch": "sm_90a", "sm_ranges": [{"min_sms": sms, "max_sms": sms, "rows": list(rows)}]})


EMPTY = table_of()


def plan_at(op, tokens, shape=QKV, **kwargs):
    return jc.plan(op, tokens=tokens, **shape, device=H200, **kwargs)


def variant_of(p):
    return (p.tile, p.schedule, p.cluster)


def rule_pick(op, tokens, shape=QKV):
    with tables.use_table(EMPTY):
        return plan_at(op, tokens, shape)


def test_the_row_variants_exist():
    """The variants these tests name, and one they rely on being absent."""
    for op, tile, cluster, schedule in (
        ("fwd", (128, 176, 64), (2, 1), "pingpong"),
        ("fwd", (128, 208, 64), (2, 1), "pingpong"),
        ("dgrad", (128, 160, 64), (2, 1), "pingpong"),
        ("dgrad", (128, 192, 64), (1, 1), "pingpong"),
    ):
        assert variants.supports(op, tile, cluster, "bfloat16", 1, contract.REDUCTION_NONE, schedule=schedule)
    assert not any(v.tile_n == 240 for v in variants.VARIANTS)
    assert not variants.supports("fwd", (128, 176, 64), (1, 1), "bfloat16", 1, 0, schedule="pingpong")


# --- parsing ------------------------------------------------------------------------------------


def test_a_tile_row_parses_with_its_variant():
    (row,) = table_of(tile_row()).sm_ranges[0].rows
    assert (row.op, row.program, row.tile, row.schedule, row.cluster, row.ratio) == (
        "fwd",
        "det",
        (128, 176, 64),
        "pingpong",
        (2, 1),
        1.017,
    )
    (legacy,) = table_of(xla_row()).sm_ranges[0].rows
    assert (legacy.schedule, legacy.cluster) == (None, None)


@pytest.mark.parametrize(
    "row,words",
    [
        (xla_row(schedule="pingpong"), "schedule 'pingpong' belongs to fwd/dgrad det rows with a tile only"),
        (xla_row(cluster=[2, 1]), "cluster [2, 1] belongs to fwd/dgrad det rows with a tile only"),
        ({**tile_row(), "tile": None}, "schedule 'pingpong' belongs to fwd/dgrad det rows with a tile only"),
        (tile_row(op="wgrad"), "names a fwd or dgrad variant, not wgrad"),
        (tile_row(schedule="zigzag"), "schedule 'zigzag' is not one of ('tiles', 'pingpong')"),
        (tile_row(schedule="split_tail"), "schedule 'split_tail' is not one of"),
        (tile_row(schedule=None), "schedule None is not one of"),
        (tile_row(cluster=[1, 2]), "cluster [1, 2] is not [1, 1] or [2, 1]"),
        (tile_row(cluster=None), "cluster None is not [1, 1] or [2, 1]"),
        (tile_row(tile=(128, 176)), "tile [128, 176] is not 3 positive ints"),
    ],
)
def test_bad_tile_rows_fail_loudly_naming_the_table_and_field(row, words):
    with pytest.raises(ValueError, match=re.escape(words)) as e:
        table_of(row)
    assert str(e.value).startswith("plan table sm_90a: ")


# --- plan(): exactly the row's point ----------------------------------------------------------


@pytest.mark.parametrize("deterministic", [True, False])
def test_fwd_row_runs_its_variant_exactly_at_its_point(deterministic):
    rule = rule_pick("fwd", 8192)
    assert variant_of(rule) == ((128, 160, 64), "pingpong", (2, 1))  # what the row beats
    with tables.use_table(table_of(tile_row())):
        p = plan_at("fwd", 8192, deterministic=deterministic)
        elsewhere = [
            plan_at("fwd", 4096, deterministic=deterministic),  # another token count
            plan_at("fwd", 8192, shape=UP, deterministic=deterministic),  # another width
            plan_at("dgrad", 8192, deterministic=deterministic),  # another op
            jc.plan("fwd", tokens=8192, **QKV, batch=2, device=H200),  # another batch
            jc.plan("fwd", tokens=8192, **QKV, device=jax.sharding.AbstractDevice("NVIDIA H100", 114, "cuda")),
        ]
    assert variant_of(p) == ((128, 176, 64), "pingpong", (2, 1)), jc.explain(p)
    assert p.raster == rule.raster and p.algorithm == "det" and p.splits == 1 and p.deterministic
    attrs = p.ffi_attributes()
    assert (attrs["tile_n"], attrs["cluster_m"], attrs["schedule"]) == (176, 2, contract.SCHEDULE_PINGPONG)
    assert (
        "128x176 ping-pong tiles, cluster 2x1: the sm_90a plan table (132 SMs, fwd 4096 -> 6144 bfloat16, "
        "tokens 8192..8192) measured this variant fastest here "
        f"(1.017x the rule's 128x160 ping-pong tiles, cluster 2x1; {SOURCE})"
    ) in p.reason
    for q in elsewhere:
        assert q.uses_kernel and "plan table" not in q.reason, jc.explain(q)
    assert variant_of(elsewhere[0]) == variant_of(rule_pick("fwd", 4096))
    assert variant_of(elsewhere[0]) == ((128, 192, 64), "pingpong", (2, 1))


@pytest.mark.parametrize("deterministic", [True, False])
def test_dgrad_row_runs_its_variant(deterministic):
    down = dict(d_in=14336, d_out=4096)  # the down projection's dx: the rule's 128x192 c2x1
    assert variant_of(rule_pick("dgrad", 8192, down)) == ((128, 192, 64), "pingpong", (2, 1))
    row = tile_row("dgrad", **down, tile=(128, 160, 64), ratio=1.006)
    with tables.use_table(table_of(row)):
        p = plan_at("dgrad", 8192, down, deterministic=deterministic)
        fwd = plan_at("fwd", 8192, down, deterministic=deterministic)
    assert variant_of(p) == ((128, 160, 64), "pingpong", (2, 1)), jc.explain(p)
    assert "1.006x the rule's 128x192 ping-pong tiles, cluster 2x1" in p.reason
    assert variant_of(fwd) == variant_of(rule_pick("fwd", 8192, down))


def test_a_row_can_name_a_cooperative_or_unpaired_variant():
    row = tile_row("dgrad", tile=(128, 192, 64), cluster=[1, 1], ratio=None)  # the rule: 128x256 c2x1
    assert variant_of(rule_pick("dgrad", 8192)) == ((128, 256, 64), "tiles", (2, 1))
    with tables.use_table(table_of(row)):
        p = plan_at("dgrad", 8192)
    assert variant_of(p) == ((128, 192, 64), "pingpong", (1, 1)), jc.explain(p)
    assert p.reason.endswith(f"measured this variant fastest here ({SOURCE})")
    with tables.use_table(table_of(tile_row(tile=(128, 256, 64), schedule="tiles"))):
        p = plan_at("fwd", 8192)
    assert variant_of(p) == ((128, 256, 64), "tiles", (2, 1))
    assert "128x256 cooperative tiles, cluster 2x1: the sm_90a plan table" in p.reason


def test_excluded_token_counts_keep_the_rule():
    with tables.use_table(table_of(tile_row(lo=4096, hi=16384, exclude_tokens=[8192]))):
        assert variant_of(plan_at("fwd", 8192)) == variant_of(rule_pick("fwd", 8192))
        assert plan_at("fwd", 16384).tile == (128, 176, 64)
        assert plan_at("fwd", 4096).tile == (128, 176, 64)


# --- force() and the benchmark's arms -----------------------------------------------------------


def test_forced_det_reads_the_row():
    """The benchmark's det arm times jax_cake's kernel as planned."""
    with tables.use_table(table_of(tile_row())):
        with jc.planner.force("det"):
            assert variant_of(plan_at("fwd", 8192)) == ((128, 176, 64), "pingpong", (2, 1))
        with jc.planner.force("det", gemm=("wgrad", 6144, 4096, 8192)):  # pins another GEMM only
            assert plan_at("fwd", 8192).tile == (128, 176, 64)
        with jc.planner.force("det", raster="n"):  # the walk is the planner's, the variant the row's
            p = plan_at("fwd", 8192)
            assert (p.tile, p.raster) == ((128, 176, 64), "n")


@pytest.mark.parametrize(
    "pins,want",
    [
        (dict(tile=(128, 192, 64), schedule="pingpong"), ((128, 192, 64), "pingpong", (2, 1))),
        (dict(tile=(128, 208, 64), schedule="pingpong"), ((128, 208, 64), "pingpong", (2, 1))),
        (dict(schedule="tiles"), ((128, 256, 64), "tiles", (2, 1))),
        (dict(cluster=(1, 1)), None),  # the rule's pick under that pin
        (dict(tile=(128, 64, 64)), None),  # a wgrad tile pin: fwd keeps the rule, not the row
    ],
)
def test_force_pins_win_over_the_row(pins, want):
    with jc.planner.force("det", **pins):
        with tables.use_table(EMPTY):
            rule = plan_at("fwd", 8192)
        with tables.use_table(table_of(tile_row())):
            p = plan_at("fwd", 8192)
    assert variant_of(p) == (want or variant_of(rule)), jc.explain(p)
    assert "plan table" not in p.reason


def test_forced_xla_still_runs_xla():
    with tables.use_table(table_of(tile_row())), jc.planner.force("xla"):
        assert not plan_at("fwd", 8192).uses_kernel


# --- what the build lacks, and the xla rows ------------------------------------------------------


@pytest.mark.parametrize(
    "row,named",
    [
        (tile_row(tile=(128, 240, 64)), "128x240 ping-pong tiles, cluster 2x1"),
        (tile_row(cluster=[1, 1]), "128x176 ping-pong tiles, cluster 1x1"),  # 176 is compiled in pairs only
        (tile_row("dgrad", tile=(128, 176, 64)), "128x176 ping-pong tiles, cluster 2x1"),  # fwd only
    ],
)
def test_a_variant_the_build_lacks_keeps_the_rule(row, named):
    op = row["op"]
    rule = rule_pick(op, 8192)
    with tables.use_table(table_of(row)):
        p = plan_at(op, 8192)
    assert variant_of(p) == variant_of(rule), jc.explain(p)
    assert p.reason.startswith(rule.reason)
    assert p.reason.endswith(
        f"; the sm_90a plan table (132 SMs, {op} 4096 -> 6144 bfloat16, tokens 8192..8192) names the {named}, "
        "which this build does not hold: the rule's pick runs"
    )


def test_xla_rows_are_unaffected():
    with tables.use_table(table_of(xla_row(), tile_row())):
        assert not plan_at("fwd", 16384, shape=dict(d_in=4096, d_out=96)).uses_kernel
        assert plan_at("fwd", 8192).tile == (128, 176, 64)
        with jc.planner.force("det"):  # a forced program never reads xla rows
            p = plan_at("fwd", 16384, shape=dict(d_in=4096, d_out=96))
            assert p.uses_kernel and "plan table" not in p.reason
    # the first matching row wins: an xla row before a tile row at the same point
    with tables.use_table(table_of(xla_row(d_out=6144, min_tokens=8192, max_tokens=8192), tile_row())):
        assert not plan_at("fwd", 8192).uses_kernel
        with jc.planner.force("det"):
            assert variant_of(plan_at("fwd", 8192)) == variant_of(rule_pick("fwd", 8192))


# --- the fused planners keep the rule ------------------------------------------------------------


def test_gated_and_residual_planners_keep_the_rule():
    """The gate/up projection is the plain fwd's GEMM, but its gated epilogue runs on its
    own tile: a fwd row there must not move it off (128 x 208 is no wide tile of
    choose.is_wide_tile, so the epilogue would become an XLA pass)."""
    from jax_cake.planner.gated import plan_gate_grad, plan_gated
    from jax_cake.planner.residual import plan_residual

    rows = (
        tile_row(**UP, tile=(128, 208, 64)),
        tile_row("dgrad", d_in=14336, d_out=4096, tile=(128, 160, 64)),
        tile_row(),
    )
    sizes = dict(tokens=8192, device=H200)

    def plans():
        return (
            plan_gated(**sizes, **UP, activation="silu"),
            plan_gate_grad(**sizes, d_ff=14336, d_out=4096, activation="silu", epilogue=True),
            plan_gate_grad(**sizes, d_ff=14336, d_out=4096, activation="silu"),  # held back: the plain dgrad
            plan_residual(**sizes, **QKV),
        )

    with tables.use_table(EMPTY):
        want = plans()
    with tables.use_table(table_of(*rows)):
        got = plans()
        assert plan_at("fwd", 8192, UP).tile == (128, 208, 64)  # the plain GEMM reads its row
    assert [p.op for p in got] == ["fwd_gated", "dgrad_gated", "dgrad", "fwd_residual"]
    assert got == want


def test_gated_projection_lowering_keeps_its_fused_kernels():
    """With rows at the gated projection's own GEMMs (the fwd over 2F, the dx over K = 2F,
    whose 128x160 dgrad has no gate_up_halves variant), the step still lowers to the fused
    calls on their tiles."""
    t, d_in, f = 8192, 4096, 14336
    rows = (tile_row(**UP, tile=(128, 208, 64)), tile_row("dgrad", **UP, tile=(128, 160, 64)))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((t, d_in), (f, d_in), (f, d_in))]

    def step(x, a, b):
        loss = lambda x, a, b: jnp.sum(jc.gated_projection(x, a, b, activation="silu").astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2))(x, a, b)

    with tables.use_table(table_of(*rows)):
        text = cuda_text(step, *args)
    (fused,) = custom_call_lines(text, "jax_cake_fwd_gated")
    assert "tile_n = 192 : i64" in fused
    (dx,) = custom_call_lines(text, "jax_cake_dgrad_gate_up")
    assert "tile_n = 160 : i64" not in dx


# --- the CUDA lowering --------------------------------------------------------------------------


def test_the_row_reaches_the_custom_call():
    def step(x, w):
        loss = lambda x, w: jnp.sum(jc.dense_projection(x, w).astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1))(x, w)

    args = (jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((6144, 4096), jnp.float32))
    with tables.use_table(table_of(tile_row())):
        text = cuda_text(step, *args)
    (fwd,) = custom_call_lines(text, "jax_cake_fwd")
    for attr, want in (("tile_m", 128), ("tile_n", 176), ("cluster_m", 2), ("schedule", contract.SCHEDULE_PINGPONG)):
        assert f"{attr} = {want} : i64" in fwd, fwd
    (dgrad,) = custom_call_lines(text, "jax_cake_dgrad")  # no dgrad row: the rule's 128x256
    assert "tile_n = 256 : i64" in dgrad


def test_shipped_tile_rows_name_compiled_variants_and_plan_them():
    """Every tile row of the shipped tables names a variant the library holds, and the
    shipped table's planner runs it at the row's point (the rule's pick elsewhere)."""
    import json
    from pathlib import Path

    shipped = Path(tables.__file__).parent / "tables"
    checked = 0
    for path in sorted(shipped.glob("*.json")):
        for rng in json.loads(path.read_text())["sm_ranges"]:
            for row in filter(tables.is_tile_row, rng["rows"]):
                tile, cluster = tuple(row["tile"]), tuple(row["cluster"])
                assert variants.supports(
                    row["op"], tile, cluster, "bfloat16", 1, contract.REDUCTION_NONE, schedule=row["schedule"]
                ), row
                if path.stem != "sm_90a":
                    continue
                shape = dict(d_in=row["d_in"], d_out=row["d_out"])
                p = plan_at(row["op"], row["min_tokens"], shape)
                assert variant_of(p) == (tile, row["schedule"], cluster), jc.explain(p)
                assert "measured this variant fastest" in p.reason
                checked += 1
    assert checked  # the sm_90a table's fwd 4096 -> 6144 row at T 8192
