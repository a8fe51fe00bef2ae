"""The wider ping-pong fwd/dgrad variants (128 x 160, 176, 192, 208) on CPU: the variant table,
the planner's forcing of them, their lowering, a model of the kernel's turn barriers, and
the core benchmark family's case list and arms (benchmarks/families/core.py)."""

import dataclasses
import importlib.util
import os
import tempfile

import jax
import jax.numpy as jnp
import pytest

import jax_cake as jc
from helpers import H200, faked_device
from jax_cake import contract
from jax_cake.planner import choose, variants

WIDE = [v for v in variants.VARIANTS if v.schedule == "pingpong" and v.tile_n != 128 and v.store == "plain"]
GATED_WIDE = [v for v in variants.VARIANTS if v.schedule == "pingpong" and v.activation is not None]
LLAMA = [(4096, 14336), (14336, 4096), (4096, 4096), (4096, 1024)]


def test_wide_pingpong_variants_are_in_the_table():
    assert {(v.program, v.tile_n, v.cluster) for v in WIDE} == {
        ("fwd", 192, (1, 1)),
        ("fwd", 192, (2, 1)),
        ("fwd", 160, (2, 1)),
        ("fwd", 176, (2, 1)),
        ("fwd", 208, (2, 1)),
        ("dgrad", 192, (1, 1)),
        ("dgrad", 192, (2, 1)),
        ("dgrad", 160, (2, 1)),
    }
    for v in WIDE:
        assert (v.tile_m, v.tile_k, v.out_dtype, v.store, v.cluster_n) == (128, 64, "bfloat16", "plain", 1)
        assert v.name.endswith("_pp") and f"128x{v.tile_n}x64_c{v.cluster_m}x1" in v.name
        assert variants.find_variant(v.program, v.tile, v.cluster, "bfloat16", schedule="pingpong") == v
        assert variants.supports(v.program, v.tile, v.cluster, "bfloat16", 1, contract.REDUCTION_NONE, "pingpong")
        # no cooperative twin: the ranking never offers these tiles for schedule "tiles"
        assert not variants.supports(v.program, v.tile, v.cluster, "bfloat16", 1, 0, "tiles")
        assert v.tile not in choose.compiled_tiles(v.program)


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed")
def test_wide_pingpong_shared_memory_and_registers():
    """Stages fill shared memory after two epilogue buffers; buffers take the rest; the
    register split is 40 / 232 for accumulators of 160 / 176 / 192 registers per thread,
    24 / 240 for 208. 128 x 176 and 128 x 208 (no multiples of 32 columns) store
    sub-tiles of 16 columns."""
    from jax_cake.kernels.gemm_sm90 import GemmSm90

    for v in WIDE:
        g = GemmSm90(v)
        stage = (v.tile_m + v.tile_n) * v.tile_k * 2
        assert g.epi_tile == (128, 16 if v.tile_n in (176, 208) else 32), v.name
        buf = v.tile_m * g.epi_tile[1] * 2
        used = g.ab_stage * stage + g.epi_buffers * buf
        assert g.shared_epi and g.epi_buffers == g.epi_stage >= 2, v.name
        assert used + 2048 <= g.smem_capacity < used + 2048 + min(stage, buf) or g.epi_stage == v.tile_n // g.epi_tile[1]
        assert (g.ab_stage, g.epi_stage) == {208: (5, 3), 192: (5, 3), 176: (5, 8), 160: (5, 5)}[v.tile_n], v.name
        assert (g.producer_regs, g.consumer_regs) == ((24, 240) if v.tile_n == 208 else (40, 232)), v.name
    # the 128 x 128 ping-pong keeps its per-warpgroup buffers (measured layout)
    old = GemmSm90(variants.find_variant("fwd", (128, 128, 64), (1, 1), "bfloat16", schedule="pingpong"))
    assert (old.shared_epi, old.ab_stage, old.epi_stage, old.epi_buffers) == (False, 5, 4, 8)
    with pytest.raises(ValueError, match="pingpong"):
        GemmSm90(variants.GemmVariant("fwd", 128, 256, schedule="pingpong"))
    with pytest.raises(ValueError, match="192"):
        GemmSm90(variants.GemmVariant("fwd", 128, 192))


def test_gated_pingpong_variants_are_in_the_table():
    assert {(v.program, v.tile, v.cluster, v.store) for v in GATED_WIDE} == {
        ("fwd", (128, 192, 64), cluster, f"gated_{act}") for cluster in ((1, 1), (2, 1)) for act in ("silu", "gelu")
    }
    for v in GATED_WIDE:
        assert v.name.endswith(f"_{v.store}_pp")
        assert variants.find_variant("fwd", v.tile, v.cluster, "bfloat16", v.store, "pingpong") == v


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed")
def test_gated_pingpong_shares_the_epilogue_ring():
    """The gated 128 x 192 ping-pong tile has the plain one's layout: 5 A/B stages and 3
    shared epilogue buffers (its 9 stores per tile start on a drained ring), 40 / 232
    registers; the gated store is refused with a split tail."""
    from jax_cake.kernels.gemm_sm90 import GemmSm90

    for v in GATED_WIDE:
        g = GemmSm90(v)
        assert g.activation == v.activation and g.shared_epi
        assert (g.ab_stage, g.epi_stage, g.epi_buffers) == (5, 3, 3), v.name
        assert (g.producer_regs, g.consumer_regs) == (40, 232)
    with pytest.raises(ValueError, match="gated"):
        GemmSm90(variants.GemmVariant("fwd", 128, 256, store="gated_silu", schedule="split_tail"))


@pytest.mark.parametrize("op", ["fwd", "dgrad"])
@pytest.mark.parametrize("d_in, d_out", LLAMA)
def test_force_reaches_every_pingpong_variant(op, d_in, d_out):
    arms = [
        dict(tile=v.tile, schedule="pingpong", cluster=v.cluster)
        for v in variants.VARIANTS
        if v.program == op and v.schedule == "pingpong" and v.store == "plain"
    ]
    assert arms, op
    for arm in arms:
        with jc.planner.force("det", **arm):
            p = jc.plan(op, tokens=8192, d_in=d_in, d_out=d_out, device=H200)
        assert (p.tile, p.cluster, p.schedule) == (arm["tile"], arm["cluster"], "pingpong"), jc.explain(p)
        assert p.ffi_attributes()["schedule"] == contract.SCHEDULE_PINGPONG


def test_forced_tile_needs_a_forced_schedule_for_fwd_and_dgrad(kernel_rules_only):
    args = dict(tokens=8192, d_in=14336, d_out=4096, device=H200)
    with jc.planner.force("det", tile=(128, 192, 64)):  # alone: the wgrad tile, as before
        assert jc.plan("fwd", **args).tile == (128, 256, 64)
    with jc.planner.force("det", tile=(128, 128, 64), schedule="tiles"):
        p = jc.plan("fwd", **args)
        assert (p.tile, p.schedule) == ((128, 128, 64), "tiles")
    with jc.planner.force("det", tile=(128, 256, 64), schedule="pingpong"):  # no such pp: the 128 x 128 one
        assert jc.plan("dgrad", **args).tile == (128, 128, 64)
    with jc.planner.force("det", tile=(128, 160, 64), schedule="pingpong", cluster=(1, 1)):
        p = jc.plan("fwd", **args)  # compiled in pairs only
        assert (p.tile, p.cluster) == ((128, 160, 64), (2, 1)), jc.explain(p)
        p = jc.plan("dgrad", **args)
        assert (p.tile, p.cluster) == ((128, 160, 64), (2, 1)), jc.explain(p)
    for width in (176, 208):  # fwd only, in pairs
        with jc.planner.force("det", tile=(128, width, 64), schedule="pingpong"):
            p = jc.plan("fwd", **args)
            assert (p.tile, p.cluster, p.schedule) == ((128, width, 64), (2, 1), "pingpong"), jc.explain(p)
            assert jc.plan("dgrad", **args).tile != (128, width, 64)
    # the wide rule never offers 128 x 176 or 208 (their wins on the H200 are per shape,
    # which its tile score cannot tell apart; the plan table's tile rows name them, and
    # kernel_rules_only leaves those out): fused QKV's pick stays 128 x 160, the
    # 4096 -> 28672 up projection's 128 x 192
    assert jc.plan("fwd", tokens=8192, d_in=4096, d_out=6144, device=H200).tile == (128, 160, 64)
    assert jc.plan("fwd", tokens=8192, d_in=4096, d_out=28672, device=H200).tile == (128, 192, 64)


def test_forced_wide_pingpong_lowers_with_its_tile():
    def step(x, w):
        loss = lambda x, w: jnp.sum(jc.dense_projection(x, w).astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1))(x, w)

    specs = (jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((14336, 4096), jnp.bfloat16))
    with faked_device(), jc.planner.force("det", tile=(128, 192, 64), schedule="pingpong", cluster=(2, 1)):
        text = jax.jit(step).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    for op in ("fwd", "dgrad"):
        (call,) = [l for l in text.splitlines() if f"stablehlo.custom_call @jax_cake_{op}(" in l]
        for attr, want in (("tile_n", 192), ("cluster_m", 2), ("schedule", contract.SCHEDULE_PINGPONG)):
            assert f"{attr} = {want} : i64" in call, (op, call)


def _turn_model(num_items: int, cluster_id: int, num_clusters: int, shared_epi: bool = True):
    """Runs the consumer warpgroups' barrier program of gemm_sm90's ping-pong (the K-loop
    turn and the epilogue turn, with the kernel's barrier ids and thread counts: a 128-thread
    warpgroup waits, the other warpgroup or its store warp arrives) on a model of named
    barriers (a phase completes when its thread count is reached; more is an error).
    Returns (per warpgroup, the (event, item) order; barrier counts left)."""
    from jax_cake.kernels import gemm_sm90 as k

    mma, epi = k.MMA_TURN_BARRIER_ID, k.EPI_TURN_BARRIER_ID
    size = {mma: k.MMA_TURN_THREADS, mma + 1: k.MMA_TURN_THREADS, epi: k.EPI_TURN_THREADS, epi + 1: k.EPI_TURN_THREADS}
    warpgroup, store_warp = 128, 32  # the threads that arrive: a warpgroup, or one warp
    count = {b: 0 for b in size}
    phase = {b: 0 for b in size}
    progs = {}
    for w in (0, 1):
        ops = []
        items = list(range(cluster_id + w * num_clusters, num_items, 2 * num_clusters))
        if w == 1 and cluster_id < num_items:
            ops.append(("arrive", mma, warpgroup, None))  # warpgroup 1's their_turn: warpgroup 0's
            if shared_epi:
                ops.append(("arrive", epi, store_warp, None))  # its their_epi
        for item in items:
            ops.append(("wait", mma + w, warpgroup, ("mma", item)))
            if item + num_clusters < num_items:
                ops.append(("arrive", mma + 1 - w, warpgroup, None))
            if shared_epi:
                ops.append(("wait", epi + w, warpgroup, ("epi", item)))
                if item + num_clusters < num_items:
                    ops.append(("arrive", epi + 1 - w, store_warp, None))
        progs[w] = ops
    pc, blocked, log = {0: 0, 1: 0}, {0: None, 1: None}, []
    while True:
        moved = False
        for w in (0, 1):
            if blocked[w] is not None:
                b, ph, tag = blocked[w]
                if phase[b] == ph:
                    continue
                blocked[w] = None
                log.append(tag)
                moved = True
            while pc[w] < len(progs[w]) and blocked[w] is None:
                kind, b, n, tag = progs[w][pc[w]]
                pc[w] += 1
                moved = True
                count[b] += n
                assert count[b] <= size[b], f"barrier {b} over-arrived"
                ph = phase[b]
                if count[b] == size[b]:
                    count[b], phase[b] = 0, phase[b] + 1
                if kind == "wait":
                    if phase[b] == ph:
                        blocked[w] = (b, ph, tag)  # logged when the phase completes
                    else:
                        log.append(tag)
        if not moved:
            break
    assert all(pc[w] == len(progs[w]) and blocked[w] is None for w in (0, 1)), "the CTA hangs"
    return log, count


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed")
@pytest.mark.parametrize("num_items", [0, 1, 2, 3, 131, 132, 133, 264, 4097])
@pytest.mark.parametrize("cluster_id, num_clusters", [(0, 132), (5, 132), (131, 132), (0, 66), (65, 66)])
def test_epilogue_turns_alternate_without_stray_arrivals(num_items, cluster_id, num_clusters):
    log, count = _turn_model(num_items, cluster_id, num_clusters)
    assert all(c == 0 for c in count.values()), count
    mine = list(range(cluster_id, num_items, num_clusters))
    assert [i for kind, i in log if kind == "mma"] == mine
    assert [i for kind, i in log if kind == "epi"] == mine  # the epilogues in tile order too


# ------------------------------------------------------------------ the core family (CPU side)
def test_core_bench_cases_and_arms():
    from benchmarks import harness as bench
    from benchmarks.families import core as core_bench

    pairs = bench.parse_pairs(core_bench.DEFAULT_PAIRS)
    assert pairs == LLAMA
    cases = core_bench.cases([8192], pairs)
    assert len(cases) == 8 and cases[0] == ("fwd", 8192, 4096, 14336) and cases[1][0] == "dgrad"
    assert core_bench.cases([4096, 8192], pairs[:1])[2] == ("fwd", 8192, 4096, 14336)
    with pytest.raises(ValueError, match="d_in:d_out"):
        bench.parse_pairs(["4096x1024"])
    for op in ("fwd", "dgrad"):
        arms = core_bench.variant_arms(op)
        assert arms[0].name == "xla" and arms[0].bench_arm == "xla"
        names = [a.name for a in arms]
        assert len(set(names)) == len(names) and len({a.bench_arm for a in arms}) == len(arms)
        wide = {(v.tile, v.cluster) for v in WIDE if v.program == op}
        assert wide <= {(a.tile, a.cluster) for a in arms if a.schedule == "pingpong"}
        assert (128, 256, 64) in {a.tile for a in arms if a.schedule == "tiles"}
        for a in arms[1:]:
            spec = bench.parse_arm(a.bench_arm)
            assert (spec.kind, spec.tile, spec.cluster, spec.schedule) == ("det", a.tile, a.cluster, a.schedule)
            assert variants.find_variant(op, a.tile, a.cluster, "bfloat16", schedule=a.schedule) is not None
    assert core_bench.flops(8192, 4096, 14336) == 2 * 8192 * 4096 * 14336


@pytest.mark.parametrize("op", ["fwd", "dgrad"])
def test_core_bench_arms_lower_to_their_variants(op):
    """Each forced arm's lowering names its tile / cluster / schedule (core_bench checks
    the same on the GPU before timing)."""
    from benchmarks import harness as bench
    from benchmarks.families import core as core_bench
    from benchmarks.families import dense

    specs = (
        jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16),
        jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16),
        jax.ShapeDtypeStruct((8192, 1024), jnp.bfloat16),
    )
    with faked_device():
        for arm in core_bench.variant_arms(op)[1:]:
            fn = bench.op_fn(op, dense.project(bench.parse_arm(arm.bench_arm)))
            core_bench.check_lowering(arm, op, fn, specs, platforms=("cuda",))


def test_core_bench_rows_pool_the_runs():
    """One CSV row per (op, shape, arm): the median over runs of each run's median group,
    every group run after run (tune_tiles pairs them by position), XLA's time over the arm's."""
    from benchmarks import harness as bench
    from benchmarks import tune_tiles
    from benchmarks.families import core as core_bench

    def sample(arm, tile, run, groups):
        shape = dict(op="fwd", T=8192, d_in=4096, d_out=14336, arm=arm, tile=tile, raster="", mode="g")
        kind = dict(cluster="2x1" if tile else "", schedule="pingpong" if tile else "xla")
        return {**shape, **kind, "max_err_rel": 0.0 if not tile else 0.001, "run": run, "groups_us": groups}

    samples = [
        sample("xla", "", 0, [100.0, 102.0, 98.0]),
        sample("128x192_pp_c2x1", "128x192x64", 0, [90.0, 91.0, 89.0]),
        sample("xla", "", 1, [110.0, 110.0, 110.0]),
        sample("128x192_pp_c2x1", "128x192x64", 1, [95.0, 95.0, 95.0]),
    ]
    header = dict(gpu="H200", sms=132, jax="0.11.2", date="2026-12-05")
    xla, arm = core_bench.rows(header, samples)
    assert (xla["us"], arm["us"]) == (105.0, 92.5)  # median of the runs' medians 100 and 110, 90 and 95
    assert arm["xla_over_arm"] == round(105.0 / 92.5, 4) and arm["ok"] and arm["tflops"] > 0
    assert arm["groups_us"] == "90.00 91.00 89.00 95.00 95.00 95.00"
    assert (arm["gpu"], arm["sms"], arm["jax"], arm["date"], arm["mode"]) == ("H200", 132, "0.11.2", "2026-12-05", "g")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "core.csv")
        bench.write_csv(path, core_bench.COLUMNS, [xla, arm])
        assert open(path).read().splitlines()[0] == ",".join(core_bench.COLUMNS)
        points, xla_arms, read = tune_tiles.read_csvs([path])  # what the tile tuner reads back
    ((point, (variant,)),) = points.items()
    assert variant.groups_us == (90.0, 91.0, 89.0, 95.0, 95.0, 95.0)
    assert xla_arms[point].us == 106.0  # tune_tiles: the median of the pooled groups
    assert read == dict(gpu="H200", sms="132", jax="0.11.2", date="2026-12-05")


def test_core_bench_raster_arms():
    """--rasters adds one arm per walk after each variant's planner-walk arm; --only keeps
    the matching variants; the lowering check compares the raster attribute too."""
    from benchmarks import harness as bench
    from benchmarks.families import core as core_bench
    from benchmarks.families import dense

    arms = core_bench.variant_arms("fwd", rasters=("m4", "n"), only="pp_c2")
    assert arms[0].name == "xla"
    assert {a.name for a in arms[1:]} >= {"128x192_pp_c2x1", "128x192_pp_c2x1_rm4", "128x192_pp_c2x1_rn"}
    assert all("pp_c2" in a.name for a in arms[1:])
    by_name = {a.name: a for a in arms}
    assert by_name["128x192_pp_c2x1"].raster is None
    spec = bench.parse_arm(by_name["128x192_pp_c2x1_rm4"].bench_arm)
    assert (spec.tile, spec.schedule, spec.cluster, spec.raster) == ((128, 192, 64), "pingpong", (2, 1), "m4")
    with pytest.raises(ValueError):
        core_bench.variant_arms("fwd", rasters=("m1",))
    specs = (
        jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16),
        jax.ShapeDtypeStruct((14336, 4096), jnp.bfloat16),
        jax.ShapeDtypeStruct((8192, 14336), jnp.bfloat16),
    )
    arm = by_name["128x192_pp_c2x1_rm4"]
    fn = bench.op_fn("fwd", dense.project(bench.parse_arm(arm.bench_arm)))
    with faked_device():
        core_bench.check_lowering(arm, "fwd", fn, specs, platforms=("cuda",))


def test_core_bench_lowering_check_catches_another_walk(monkeypatch):
    """A plan that walks otherwise than the arm names (here: the force replaced by one of
    bands of 16) fails the check."""
    from benchmarks import harness as bench
    from benchmarks.families import core as core_bench
    from benchmarks.families import dense

    arm = next(a for a in core_bench.variant_arms("fwd", rasters=("m4",)) if a.name == "128x192_pp_c2x1_rm4")
    other = dataclasses.replace(bench.parse_arm(arm.bench_arm), raster="m16")
    real = bench.planning_for
    monkeypatch.setattr(bench, "planning_for", lambda spec: real(other))
    fn = bench.op_fn("fwd", dense.project(other))
    specs = (
        jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16),
        jax.ShapeDtypeStruct((14336, 4096), jnp.bfloat16),
        jax.ShapeDtypeStruct((8192, 14336), jnp.bfloat16),
    )
    jax.clear_caches()
    with faked_device(), pytest.raises(RuntimeError, match="raster code 16"):
        core_bench.check_lowering(arm, "fwd", fn, specs, platforms=("cuda",))
