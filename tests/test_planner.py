"""The planner: device lookup, plans on the faked H200, fallbacks, and the sm_107a verdicts."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice

import jax_cake as jc
from jax_cake import contract
from jax_cake.planner import DeviceInfo, tables, variants
from jax_cake.planner.device import from_jax_device
from jax_cake.planner.choose import PingPong, compiled_tiles, pingpong_rule, tail_splits
from jax_cake.planner.variants import split_tail_slots
from helpers import H200, faked_device


def _r200(sms):
    return DeviceInfo("cuda", "NVIDIA R200", "sm_107a", sms)


# --- device lookup ------------------------------------------------------------------------


def test_device_from_abstract_mesh_and_default():
    with faked_device():
        p = jc.plan("fwd", tokens=1024, d_in=512, d_out=512)
    assert p.uses_kernel and "H200" in p.device and "132 SMs" in p.device
    p = jc.plan("fwd", tokens=1024, d_in=512, d_out=512)  # jax.devices()[0] is a CPU here
    assert not p.uses_kernel and "no CUDA GPU" in p.reason


@pytest.mark.parametrize(
    "kind,arch",
    [
        ("NVIDIA H200", "sm_90a"),
        ("NVIDIA H100 80GB HBM3", "sm_90a"),
        ("NVIDIA A100-SXM4-80GB", "sm_80"),
        ("NVIDIA GB200", "sm_100a"),
        ("NVIDIA R200", "sm_107a"),
    ],
)
def test_arch_from_kind_name(kind, arch):
    assert from_jax_device(AbstractDevice(kind, 100, "cuda")).arch == arch


def test_plan_is_frozen_and_hashable():
    with faked_device():
        p = jc.plan("wgrad", tokens=16172, d_in=4096, d_out=48, out_dtype=jnp.float32)
    assert hash(p) == hash(dataclasses.replace(p))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.splits = 2


# --- fallbacks say why ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "device,words",
    [
        (AbstractDevice("NVIDIA A100-SXM4-80GB", 108, "cuda"), ["no jax_cake kernels are built for sm_80"]),
        (AbstractDevice("cpu", None, "cpu"), ["no CUDA GPU"]),
    ],
)
def test_unsupported_device_runs_xla_and_says_why(device, words):
    p = jc.plan("fwd", tokens=1024, d_in=512, d_out=512, device=device)
    assert p.backend == "xla" and p.program is None
    text = jc.explain(p)
    assert "runs the XLA path" in text
    for w in words:
        assert w in text


@pytest.mark.parametrize("op", ["fwd", "wgrad", "router_fwd", "router_dgrad", "router_wgrad"])
def test_a_gpu_of_unknown_sm_count_runs_xla_and_says_why(op):
    """Every op, the router's too (it once divided by the missing count)."""
    p = jc.plan(op, tokens=4096, d_in=512, d_out=256, device=AbstractDevice("NVIDIA H200", None, "cuda"))
    assert not p.uses_kernel and "the SM count of NVIDIA H200 is unknown" in jc.explain(p)


def test_force_gemm_pins_only_the_gemm_it_names():
    """force(gemm=...) leaves every other plan the planner's own: a grouped GEMM's reason
    and a fused accumulating wgrad's raster."""
    from jax_cake.planner.accumulate import plan_accumulate

    sizes = dict(tokens=4096, d_in=512, d_out=256)
    with jc.planner.force("xla", gemm=("fwd", 1, 1, 1)):
        grouped = jc.plan("grouped_fwd", **sizes, groups=8, device=H200)
    assert grouped.uses_kernel and "forced" not in grouped.reason, grouped.reason
    for size in (sizes, dict(tokens=8192, d_in=4096, d_out=1024)):  # the second: a table xla row
        own = plan_accumulate(**size, device=H200)
        with jc.planner.force("det", raster="n", gemm=("fwd", 1, 1, 1)):
            assert plan_accumulate(**size, device=H200) == own
    with jc.planner.force("det", raster="n"):
        assert plan_accumulate(**sizes, device=H200).raster == "n"


def test_unaligned_shape_runs_xla_and_says_why():
    p = jc.plan("fwd", tokens=37, d_in=20, d_out=12, device=H200)
    assert not p.uses_kernel and "multiples of 8" in jc.explain(p)


@pytest.fixture
def router_kernels_enabled(monkeypatch):
    monkeypatch.setattr(jc.planner.choose, "ROUTER_KERNELS_ENABLED", True)


def test_router_kernels_can_be_held_back(monkeypatch):
    monkeypatch.setattr(jc.planner.choose, "ROUTER_KERNELS_ENABLED", False)
    p = jc.plan("router_fwd", tokens=16384, d_in=4096, d_out=256, out_dtype=jnp.float32, device=H200)
    assert not p.uses_kernel and "held back" in p.reason and "BF16x3" in p.reason


@pytest.mark.parametrize("d", [4096, 7168])
def test_router_plans_use_the_fused_bf16x3_kernels(d, router_kernels_enabled):
    sizes = dict(tokens=16384, d_in=d, d_out=256, out_dtype=jnp.float32, device=H200)
    fwd = jc.plan("router_fwd", **sizes)
    wgrad = jc.plan("router_wgrad", **sizes, deterministic=False)
    assert fwd.uses_kernel and fwd.tile in compiled_tiles("router_fwd") and "BF16x3" in fwd.reason
    assert wgrad.algorithm == "det" and wgrad.deterministic  # the router has no split-K program
    assert wgrad.ctas >= 100  # splits over K = T fill the H200 where the tiles alone do not
    assert wgrad.workspace_bytes == (wgrad.splits * 256 * d * 4 if wgrad.splits > 1 else 16)


@pytest.mark.parametrize("experts", [8, 16, 64])
def test_router_with_few_experts_runs_xlas_bf16x3_dot(experts, router_kernels_enabled):
    """Up to ROUTER_XLA_MAX_EXPERTS experts every router GEMM is XLA's (its BF16x3 dot was
    faster there), from 64 up the fused kernels; the reason says which and why."""
    sizes = dict(tokens=16384, d_in=4096, d_out=experts, out_dtype=jnp.float32, device=H200)
    plans = [jc.plan(op, **sizes) for op in ("router_fwd", "router_dgrad", "router_wgrad")]
    few = experts <= jc.planner.choose.ROUTER_XLA_MAX_EXPERTS
    assert [p.uses_kernel for p in plans] == [not few] * 3, [jc.explain(p) for p in plans]
    if few:
        assert all(f"E={experts} experts" in p.reason and "BF16_BF16_F32_X3" in p.reason for p in plans)


def test_router_variants_put_the_on_chip_split_operand_in_registers():
    """x is the only operand split on chip; it must be the kernel's A (wgmma takes only A from
    registers), so wgrad runs transposed, and B always arrives pre-split."""
    from jax_cake.planner import router_variants as rv

    for v in rv.VARIANTS:
        first_pre, second_pre = rv.PRESPLIT[v.program]  # FFI operand order: (g|x, w|x)
        a_pre, b_pre = (second_pre, first_pre) if v.transposed else (first_pre, second_pre)
        assert (v.a_presplit, v.b_presplit) == (a_pre, b_pre)
        assert v.b_presplit and v.a_in_registers == (not v.a_presplit)
    wgrad = rv.find_variant("wgrad", (128, 128, 32))
    assert wgrad.transposed and wgrad.a_in_registers and wgrad.c_major == "m"
    assert not rv.find_variant("dgrad", (128, 128, 32)).a_in_registers


def test_batched_fwd_with_128_outputs_runs_128_wide_tiles():
    """512 -> 128 (MLA head rows): a 128 x 128 fwd tile covers N = 128 whole; 128 x 64 tiles
    ran 228 us against 178 at B = 128, T = 4096 on the H200 (docs/benchmarks.md)."""
    p = jc.plan("fwd", tokens=4096, d_in=512, d_out=128, batch=128, device=H200)
    assert p.uses_kernel and p.tile == (128, 128, 64)
    p = jc.plan("fwd", tokens=16384, d_in=4096, d_out=4096, device=H200)
    assert p.tile == (128, 256, 64)  # wide outputs keep the 128 x 256 tile


def test_router_unaligned_shape_runs_xla_and_says_why(router_kernels_enabled):
    p = jc.plan("router_fwd", tokens=37, d_in=30, d_out=256, out_dtype=jnp.float32, device=H200)
    assert not p.uses_kernel and "multiples of 8" in p.reason and "BF16x3" in p.reason
    p = jc.plan("router_fwd", tokens=37, d_in=516, d_out=256, out_dtype=jnp.float32, device=H200)
    assert not p.uses_kernel and "multiples of 8" in p.reason  # 16-byte rows of the bf16 hi/lo parts


# --- H200 plans ---------------------------------------------------------------------------


@pytest.mark.parametrize("t", [16172, 16231, 16384])
@pytest.mark.parametrize(
    "d_in,d_out",
    [(4096, 32), (4096, 48), (4096, 64), (4096, 512), (4096, 1024), (4096, 4096), (5120, 48), (5120, 1024)],
)
@pytest.mark.parametrize("out", ["float32", "bfloat16"])
def test_h200_plans_fill_the_machine_and_stay_reproducible(t, d_in, d_out, out, kernel_rules_only):
    for deterministic in (True, False):
        p = jc.plan("wgrad", tokens=t, d_in=d_in, d_out=d_out, out_dtype=out, deterministic=deterministic, device=H200)
        assert p.uses_kernel and p.tile in compiled_tiles("wgrad")
        # Without the table's measured rows (kernel_rules_only): deterministic=False runs det too.
        assert p.algorithm == "det" and p.deterministic
        assert p.ctas >= 64, jc.explain(p)
        if p.reduction == "ordered":
            assert p.workspace_bytes >= p.splits * d_out * d_in * 4
        if p.reduction == "split_tail":
            tm, tn, _ = p.tile
            tiles = math.ceil(d_out / tm) * math.ceil(d_in / tn)
            assert p.workspace_bytes >= split_tail_slots(tiles, p.splits, 132) * tm * tn * 4 > 0
        assert p.out_dtype == out


def test_deterministic_false_follows_a_measured_split_row():
    row = dict(
        d_in=4096,
        d_out=48,
        out="float32",
        min_tokens=16000,
        max_tokens=17000,
        program="split",
        splits=8,
        exclude_tokens=[16231],
        source="synthetic test row",
    )
    table = tables.parse({"arch": "sm_90a", "sm_ranges": [{"min_sms": 132, "max_sms": 132, "rows": [row]}]})
    with tables.use_table(table):
        split = jc.plan(
            "wgrad", tokens=16172, d_in=4096, d_out=48, out_dtype=jnp.float32, deterministic=False, device=H200
        )
        excluded = jc.plan(
            "wgrad", tokens=16231, d_in=4096, d_out=48, out_dtype=jnp.float32, deterministic=False, device=H200
        )
        det = jc.plan(
            "wgrad", tokens=16172, d_in=4096, d_out=48, out_dtype=jnp.float32, deterministic=True, device=H200
        )
        other_sms = jc.plan(
            "wgrad",
            tokens=16172,
            d_in=4096,
            d_out=48,
            out_dtype=jnp.float32,
            deterministic=False,
            device=AbstractDevice("NVIDIA H100", 114, "cuda"),
        )
    assert split.algorithm == "split" and split.reduction == "arrival" and split.splits == 8 and not split.deterministic
    assert split.workspace_bytes == 16  # FP32 dw takes the atomics itself
    assert "synthetic test row" in jc.explain(split)
    assert excluded.algorithm == "det" and "excluded" in excluded.reason
    assert det.algorithm == "det" and det.deterministic
    assert other_sms.algorithm == "det"


def test_force_selects_the_arm_for_the_benchmark():
    with jc.planner.force("split", splits=6):
        p = jc.plan("wgrad", tokens=16384, d_in=4096, d_out=64, out_dtype=jnp.bfloat16, device=H200)
    assert p.algorithm == "split" and p.splits == 6 and p.workspace_bytes == 64 * 4096 * 4
    with jc.planner.force("xla"):
        assert not jc.plan("fwd", tokens=64, d_in=64, d_out=64, device=H200).uses_kernel
    with pytest.raises(ValueError, match="program must be"):
        with jc.planner.force("fast"):
            pass


def test_table_rejects_bad_rows():
    bad = {
        "arch": "sm_90a",
        "sm_ranges": [
            {
                "min_sms": 1,
                "max_sms": None,
                "rows": [dict(d_in=8, d_out=8, out="float16", min_tokens=1, max_tokens=2, program="split")],
            }
        ],
    }
    with pytest.raises(ValueError, match="out 'float16'"):
        tables.parse(bad)


# --- the upstream sm_107a verdicts (FlashInfer #8363 / #8438), FP32 K1 rows ----------------

# Points where the deterministic program runs under deterministic=False.
SM107_DET = [
    # #8363, 208 SMs
    *[
        (208, d_in, d_out, t)
        for d_in, d_out in [(4096, 48), (4096, 64), (4096, 512), (5120, 48)]
        for t in (16231, 16384)
    ],
    (208, 4096, 1024, 16231),
    (208, 5120, 64, 16231),
    # #8363, 212 SMs
    *[(212, d_in, d_out, t) for d_in, d_out in [(4096, 512), (5120, 512)] for t in (16231, 16384)],
    (212, 4096, 1024, 16231),
    (212, 5120, 48, 16231),
    (212, 5120, 64, 16231),
    *[(212, 4096, 4096, t) for t in (16172, 16231, 16300, 16384)],  # every token count 16172..16384
    # #8363 entries for 216+ SMs, confirmed by #8438 on 216-SM parts, and #8438's six more
    *[
        (sms, d_in, d_out, t)
        for sms in (216, 224)
        for d_in, d_out, t in [
            (4096, 48, 16231),
            (4096, 48, 16384),
            (4096, 512, 16231),
            (4096, 512, 16384),
            (4096, 1024, 16231),
            (5120, 48, 16231),
            (5120, 64, 16231),
            (4096, 32, 16231),
            (4096, 64, 16231),
            (4096, 64, 16384),
            (5120, 48, 16384),
            (5120, 64, 16384),
        ]
    ],
]

# Points that keep the split program.
SM107_SPLIT = [
    (208, 5120, 1024, 16384),  # kept by the second measurement (commit 91c6b64)
    (208, 4096, 48, 16172),
    (208, 4096, 1024, 16172),
    (208, 4096, 1024, 16384),
    (212, 4096, 1024, 16172),
    (212, 4096, 512, 16172),
    (212, 5120, 48, 16384),
    (216, 4096, 1024, 16172),
    (216, 4096, 1024, 16384),
    (216, 4096, 32, 16172),
    (216, 4096, 32, 16384),
]


@pytest.mark.parametrize("sms,d_in,d_out,t", SM107_DET)
def test_sm107a_deterministic_verdicts(sms, d_in, d_out, t):
    v = tables.verdict("sm_107a", sms, d_in, d_out, "float32", t)
    assert v.program == "det", v.why


@pytest.mark.parametrize("sms,d_in,d_out,t", SM107_SPLIT)
def test_sm107a_split_verdicts(sms, d_in, d_out, t):
    v = tables.verdict("sm_107a", sms, d_in, d_out, "float32", t)
    assert v.program == "split", v.why


def test_sm107a_216_sm_4096_to_1024_is_the_192_wide_one_split_program():
    exact = tables.verdict("sm_107a", 216, 4096, 1024, "float32", 16384).row
    assert (exact.tile[1], exact.splits, exact.raster, exact.ctas) == (192, 1, "m", 176)
    above = tables.verdict("sm_107a", 220, 4096, 1024, "float32", 16384).row
    assert (above.tile[1], above.splits, above.ctas) == (256, 1, 128)


def test_sm107a_bf16_5120_to_1024_on_216_sms():
    assert tables.verdict("sm_107a", 216, 5120, 1024, "bfloat16", 16231).program == "det"
    assert tables.verdict("sm_107a", 216, 5120, 1024, "bfloat16", 16384).program == "split"


def test_sm107a_outside_the_measured_rows_is_deterministic():
    assert tables.verdict("sm_107a", 200, 4096, 48, "float32", 16172).program == "det"  # no 200-SM range
    assert tables.verdict("sm_107a", 208, 4096, 48, "float32", 8192).program == "det"  # token count not measured


def test_sm107a_plan_explains_the_verdict_but_runs_xla_here():
    p = jc.plan(
        "wgrad", tokens=16231, d_in=4096, d_out=48, out_dtype=jnp.float32, deterministic=False, device=_r200(208)
    )
    text = jc.explain(p)
    assert not p.uses_kernel
    assert "no jax_cake kernels are built for sm_107a" in text and "verdict for deterministic=False here: det" in text


def test_gpu_fallback_is_logged_once(caplog):
    device = AbstractDevice("NVIDIA L40S", 142, "cuda")
    with caplog.at_level("WARNING"):
        for _ in range(3):
            jc.plan("fwd", tokens=64, d_in=64, d_out=64, device=device)
    messages = [r.getMessage() for r in caplog.records if "NVIDIA L40S" in r.getMessage()]
    assert len(messages) == 1 and "no jax_cake kernels are built for sm_89" in messages[0]


def test_force_tile_is_honoured_when_compiled():
    small = min(compiled_tiles("wgrad"))
    with jc.planner.force("split", tile=small, splits=3):
        p = jc.plan("wgrad", tokens=16384, d_in=4096, d_out=512, out_dtype=jnp.float32, device=H200)
    assert p.tile == small and p.splits == 3
    with jc.planner.force("det", tile=(7, 7, 7)):  # not compiled: the heuristic's tile
        p = jc.plan("wgrad", tokens=16384, d_in=4096, d_out=512, out_dtype=jnp.float32, device=H200)
    assert p.tile in compiled_tiles("wgrad")


@pytest.mark.parametrize("out", ["float32", "bfloat16"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_every_wgrad_plan_names_a_program_the_library_holds(out, deterministic):
    """A tile may exist for one output dtype or split form only; plans must respect that."""
    from jax_cake.planner import variants

    for t in (37, 1011, 16172, 16384):
        for d_in, d_out in [(4096, 48), (4096, 512), (5120, 1024), (4096, 4096), (128, 512)]:
            for program in ("det", "split") if not deterministic else ("det",):
                with jc.planner.force(program):
                    p = jc.plan("wgrad", tokens=t, d_in=d_in, d_out=d_out, out_dtype=out, device=H200)
                reduction = int(p.ffi_attributes()["reduction"])
                assert variants.supports("wgrad", p.tile, p.cluster, out, p.splits, reduction), jc.explain(p)


@pytest.mark.parametrize(
    "op, t, d_in, d_out, batch, out, pair",
    [
        # compute bound (N >= 1024, K >= 512): CTA pairs measured 1-3.5 % faster
        ("fwd", 16384, 4096, 4096, 1, "bfloat16", True),
        ("dgrad", 16172, 4096, 4096, 1, "bfloat16", True),
        ("fwd", 16172, 5120, 1024, 1, "bfloat16", True),
        ("wgrad", 16384, 4096, 512, 1, "float32", True),
        # N = 512, skinny K, or the batched 128 -> 512 forward (K = 128): no gain measured
        ("fwd", 16384, 4096, 512, 1, "bfloat16", False),
        ("dgrad", 16384, 4096, 48, 1, "bfloat16", False),
        ("fwd", 4096, 128, 512, 128, "bfloat16", False),
        ("wgrad", 16172, 4096, 48, 1, "float32", False),
        # one M tile: no pair to share with
        ("fwd", 100, 4096, 4096, 1, "bfloat16", False),
    ],
)
def test_cluster_pairs_only_where_they_measured_faster(op, t, d_in, d_out, batch, out, pair, kernel_rules_only):
    from jax_cake.planner import variants

    p = jc.plan(op, tokens=t, d_in=d_in, d_out=d_out, batch=batch, out_dtype=out, device=H200)
    assert p.cluster == ((2, 1) if pair else (1, 1)), jc.explain(p)
    assert p.ffi_attributes()["cluster_m"] == p.cluster[0]
    assert ("cluster 2x1" in p.reason) == pair
    store_out = out if op == "wgrad" else "bfloat16"
    codes = {"none": 0, "ordered": 1, "arrival": 2}
    assert variants.supports(op, p.tile, p.cluster, store_out, p.splits, codes[p.reduction]), jc.explain(p)


def test_det_splits_fill_the_last_wave_only_when_compute_bound():
    from jax_cake.planner.choose import det_splits

    k = 16384  # 256 K tiles of 64
    # memory bound (default): one CTA per SM when the tiles fill less than half the SMs
    assert det_splits(32, k, 64, 132) == 4
    assert det_splits(160, k, 64, 132) == 1
    # compute bound: the fewest splits that fill the last wave to 90 %
    assert det_splits(160, k, 64, 132, fill_waves=True) == 3  # 480 CTAs: 4 waves at 91 %
    assert det_splits(320, k, 64, 132, fill_waves=True) == 2  # 640 CTAs: 5 waves at 97 %
    assert det_splits(256, k, 64, 132, fill_waves=True) == 1  # 2 waves at 97 % already
    # splits never shorter than 8 K tiles
    assert det_splits(160, 64 * 16, 64, 132, fill_waves=True) == 2


@pytest.mark.parametrize(
    "d_in, d_out, out, tile, splits, reduction",
    [
        # 128 x 160 tiles: 32 N tiles of 5120, so 128 / 256 CTAs are full waves
        (5120, 512, "float32", (128, 160, 64), 1, "none"),
        (5120, 512, "bfloat16", (128, 160, 64), 1, "none"),
        # 160 tiles of 128 x 256: a whole wave, then the 28 tail tiles cut into 4 K pieces
        # (fp32 dw: the total-in-dw tile, pieces of 64 K tiles)
        (5120, 1024, "float32", (128, 256, 64), 4, "split_tail"),
        (5120, 1024, "bfloat16", (128, 256, 64), 4, "split_tail"),
        # 96 tiles of 128 x 128: 4 ordered splits make 384 CTAs, 3 waves at 97 %
        (3072, 512, "float32", (128, 128, 64), 4, "ordered"),
    ],
)
def test_compute_bound_wgrad_fills_its_waves(d_in, d_out, out, tile, splits, reduction):
    """64-row tiles (one consumer warpgroup) ran 217 us at 5120 -> 512 FP32 against 143 us
    for 128 x 128 with 3 ordered splits and 123 us for 128 x 160 (H200, 2026-11-30)."""
    p = jc.plan("wgrad", tokens=16384, d_in=d_in, d_out=d_out, out_dtype=out, device=H200)
    assert (p.tile, p.splits, p.reduction) == (tile, splits, reduction), jc.explain(p)
    assert p.deterministic


def test_split_tail_pieces_and_workspace():
    # (splits, tail time in whole-tile times) for the last partial wave
    assert tail_splits(160, 132, 256) == (4, 0.25)  # 28 tail tiles -> 112 pieces, one wave
    assert tail_splits(320, 132, 256) == (2, 0.5)  # 56 -> 112 pieces (4 pieces: two waves, no better)
    assert tail_splits(264, 132, 256) == (1, 0.0)  # no tail
    assert tail_splits(100, 132, 256) == (1, 1.0)  # 2-4 pieces of 100 tiles: no faster
    assert tail_splits(160, 132, 16) == (2, 0.5)  # pieces keep >= 8 K tiles
    # the workspace holds (splits - 1) partial tiles per tail tile; the grid is
    # min(SMs, tiles * splits), so fewer tiles than SMs are all tail
    assert split_tail_slots(160, 4, 132) == 28 * 3
    assert split_tail_slots(64, 2, 132) == 64
    assert split_tail_slots(264, 2, 132) == 0


def _split_tail_items(tiles: int, splits: int, k_tiles: int, sm_count: int):
    """The split tail's work items as gemm_sm90 walks them (GemmSm90._item and _k_range):
    (item, tile, piece, first K tile, K tile count), in item order."""
    grid = min(sm_count, tiles * splits)
    rem = tiles % grid
    dp = tiles - rem
    items = []
    for item in range(dp + rem * splits):
        tail = max(item - dp, 0)
        tile, piece = min(item, dp) + tail % max(rem, 1), tail // max(rem, 1)
        pieces = splits if item >= dp else 1
        per = -(-k_tiles // pieces)
        k0 = piece * per
        items.append((item, tile, piece, k0, max(min(per, k_tiles - k0), 0)))
    return grid, rem, items


@pytest.mark.parametrize(
    "tiles, splits, k_tiles", [(160, 4, 256), (64, 2, 256), (80, 3, 253), (320, 2, 13), (133, 4, 9)]
)
def test_split_tail_schedule_covers_every_k_tile_once(tiles, splits, k_tiles):
    """The schedule the kernel docstring describes: every (tile, K tile) once, the last
    piece of a tile is its highest item (it waits only for earlier items: no deadlock on
    a persistent grid), and the hand-over slots fit the planner's workspace."""
    grid, rem, items = _split_tail_items(tiles, splits, k_tiles, 132)
    covered = sorted((tile, k) for _, tile, _, k0, cnt in items for k in range(k0, k0 + cnt))
    assert covered == [(t, k) for t in range(tiles) for k in range(k_tiles)]
    slots = set()
    for tile in range(tiles - rem, tiles):
        pieces = sorted((p, i) for i, t, p, _, _ in items if t == tile)
        assert [p for p, _ in pieces] == list(range(splits))
        assert pieces[-1][1] == max(i for _, i in pieces)  # the finisher comes last
        slots |= {p * rem + (tile - (tiles - rem)) for p, _ in pieces[:-1]}
    assert slots == set(range(split_tail_slots(tiles, splits, 132)))


def test_split_tail_needs_a_whole_wave():
    """With no whole wave the cut's overhead lost to smaller tiles (4096 -> 512 BF16: 98 us
    cut in two, 89 on 128 x 128; H200, 2026-11-30)."""
    p = jc.plan("wgrad", tokens=16384, d_in=4096, d_out=512, out_dtype="bfloat16", device=H200)
    assert p.reduction != "split_tail" and p.tile == (128, 128, 64), jc.explain(p)
    p = jc.plan("wgrad", tokens=16384, d_in=5120, d_out=1024, out_dtype="bfloat16", device=H200, deterministic=False)
    assert p.reduction == "split_tail" and p.deterministic, jc.explain(p)
    with jc.planner.force("det"):  # the benchmark's and tuner's det arm plans as det does
        assert jc.plan("wgrad", tokens=16384, d_in=5120, d_out=1024, out_dtype="bfloat16", device=H200).reduction == (
            "split_tail"
        )


@pytest.mark.parametrize(
    "t, d_in, d_out, batch, tile, splits",
    [
        (16172, 4096, 48, 1, (64, 128, 64), 4),
        (4096, 128, 512, 16, (64, 128, 64), 1),
        (16384, 5120, 128, 1, (64, 128, 64), 1),
    ],
)
def test_memory_bound_wgrad_keeps_64_row_tiles(t, d_in, d_out, batch, tile, splits):
    p = jc.plan("wgrad", tokens=t, d_in=d_in, d_out=d_out, batch=batch, out_dtype="float32", device=H200)
    assert (p.tile, p.splits) == (tile, splits), jc.explain(p)


@pytest.mark.parametrize(
    "op, t, d_in, d_out, batch, pingpong",
    [
        # dgrad with 64 <= K = d_out <= 1024 over N = d_in >= 4096: measured faster (H200)
        ("dgrad", 16172, 4096, 64, 1, True),
        ("dgrad", 16384, 5120, 512, 1, True),
        ("dgrad", 16231, 4096, 1024, 1, True),
        # K = 4096 (ping-pong 10-15 % slower), K < 64, fwd, wgrad, batched (N = 128, 512)
        ("dgrad", 16384, 4096, 4096, 1, False),
        ("dgrad", 16172, 4096, 48, 1, False),
        ("fwd", 16384, 4096, 512, 1, False),
        ("wgrad", 16384, 4096, 512, 1, False),
        ("dgrad", 4096, 512, 128, 128, False),
    ],
)
def test_pingpong_dgrad_only_where_it_measured_faster(op, t, d_in, d_out, batch, pingpong):
    from jax_cake.planner import variants

    p = jc.plan(op, tokens=t, d_in=d_in, d_out=d_out, batch=batch, out_dtype="bfloat16", device=H200)
    assert (p.schedule == "pingpong") == pingpong, jc.explain(p)
    assert ("ping-pong" in p.reason) == pingpong
    if pingpong:
        # CTA pairs by the cluster rule (K >= 512), as the cooperative tiles
        pair = (2, 1) if d_out >= 512 else (1, 1)
        assert (p.tile, p.cluster, p.ffi_attributes()["schedule"]) == ((128, 128, 64), pair, 2)
        assert variants.supports(op, p.tile, p.cluster, "bfloat16", 1, 0, schedule="pingpong")


def test_force_schedule_overrides_the_pingpong_rule():
    args = dict(tokens=16384, d_in=4096, d_out=512, out_dtype="bfloat16", device=H200)
    with jc.planner.force("det", schedule="tiles"):
        coop = jc.plan("dgrad", **args)
    with jc.planner.force("det", schedule="pingpong"):
        fwd = jc.plan("fwd", **args)
    with jc.planner.force("det", cluster=(1, 1)):
        single = jc.plan("dgrad", **args)
    with jc.planner.force("det", cluster=(2, 1)):
        skinny = jc.plan("dgrad", **{**args, "d_out": 64})
    assert (coop.schedule, coop.tile) == ("tiles", (128, 256, 64)), jc.explain(coop)
    assert (fwd.schedule, fwd.tile, fwd.cluster) == ("pingpong", (128, 128, 64), (1, 1))  # no fwd pp pair
    assert (single.schedule, single.cluster) == ("pingpong", (1, 1))
    assert (skinny.schedule, skinny.cluster) == ("pingpong", (2, 1)), jc.explain(skinny)
    assert jc.plan("dgrad", **args).schedule == "pingpong"  # the block restored the rule
    with pytest.raises(ValueError, match="schedule"):
        with jc.planner.force("det", schedule="stream_k"):
            pass
    with pytest.raises(ValueError, match="cluster"):
        with jc.planner.force("det", cluster=(1, 2)):
            pass


def test_pingpong_rule_says_whether_and_why():
    short_k = pingpong_rule("dgrad", 4096, 512)  # n = 4096, k = 512
    assert (short_k.chosen, short_k.tile) == (True, (128, 128, 64)) and "K=512" in short_k.why
    assert pingpong_rule("dgrad", 4096, 4096) == PingPong(False)  # a long K loop: the cooperative tiles
    assert pingpong_rule("dgrad", 512, 512) == PingPong(False)  # N < 4096
    assert pingpong_rule("fwd", 4096, 512) == PingPong(False)
    assert pingpong_rule("dgrad", 4096, 512, forced_schedule="tiles") == PingPong(False)
    forced = pingpong_rule("fwd", 4096, 4096, (128, 192, 64), forced_schedule="pingpong")
    assert forced == PingPong(True, (128, 192, 64), "128x192 ping-pong tiles (forced)")


@pytest.mark.parametrize(
    "op, d_in, d_out, want",
    [
        ("fwd", 4096, 14336, (128, 160, 64)),  # Llama-3-8B gate / up: measured fastest on 128 x 160
        ("dgrad", 14336, 4096, (128, 192, 64)),  # its input gradient: dgrad's 128 x 160 is left to force()
        ("fwd", 4096, 6144, (128, 160, 64)),  # fused QKV, GQA kv 1024: 160 fills its last wave better (a tie)
        ("fwd", 8192, 8192, (128, 192, 64)),  # Llama-3-70B attention out: 160's 52nd N tile is 1/5 full
        ("fwd", 4096, 28672, (128, 192, 64)),  # gate and up as one GEMM: 192 nearly divides 28672
        ("dgrad", 28672, 8192, (128, 192, 64)),
        ("fwd", 14336, 4096, None),  # the down projection: N = 4096 leaves the last wide tile part empty
        ("dgrad", 4096, 14336, None),  # the same N = 4096
        ("fwd", 4096, 4096, None),
        ("fwd", 2048, 14336, None),  # K = 2048 < _PINGPONG_WIDE_MIN_K: not measured
    ],
)
def test_wide_pingpong_rule_at_the_llama_shapes(kernel_rules_only, op, d_in, d_out, want):
    p = jc.plan(op, tokens=8192, d_in=d_in, d_out=d_out, device=H200)
    if want is not None:
        assert (p.schedule, p.tile, p.cluster) == ("pingpong", want, (2, 1)), jc.explain(p)
        assert "ping-pong" in p.reason and f"{want[0]}x{want[1]} tiles" in p.reason, jc.explain(p)
    else:
        assert (p.schedule, p.tile, p.cluster) == ("tiles", (128, 256, 64), (2, 1)), jc.explain(p)
    with jc.planner.force("det", schedule="tiles"):  # a forced schedule wins over the rule
        assert jc.plan(op, tokens=8192, d_in=d_in, d_out=d_out, device=H200).schedule == "tiles"


@pytest.mark.parametrize(
    "op, d_in, d_out, t, want",
    [
        ("fwd", 4096, 14336, 8192, "m8"),
        ("dgrad", 14336, 4096, 8192, "m8"),
        ("fwd", 4096, 512, 16384, "m8"),
        ("fwd", 4096, 384, 12288, "m8"),  # 3 N tiles: x read once per band, not per N tile
        ("fwd", 4096, 256, 16384, "m8"),  # one N tile: the band is the M-first walk
        ("dgrad", 256, 4096, 16384, "m8"),  # dgrad's N is d_in
        ("wgrad", 4096, 14336, 8192, "m16"),  # bf16 dw
        ("wgrad", 4096, 48, 16384, "m16"),  # one band covers all of M: the M-first walk
    ],
)
def test_raster_rule_walks_in_bands(op, d_in, d_out, t, want):
    out = "float32" if d_out == 48 else "bfloat16"
    p = jc.plan(op, tokens=t, d_in=d_in, d_out=d_out, out_dtype=out, device=H200)
    assert p.uses_kernel and p.raster == want, jc.explain(p)
    assert p.ffi_attributes()["raster"] == contract.raster_code(want)
    if op != "wgrad":
        assert contract.describe_raster(want) in p.reason
    with jc.planner.force("det", raster="n"):  # a pin wins over the rule
        pinned = jc.plan(op, tokens=t, d_in=d_in, d_out=d_out, out_dtype=out, device=H200)
    assert pinned.raster == "n" and pinned.ffi_attributes()["raster"] == contract.RASTER_N


@pytest.mark.parametrize("d_out, tile", [(48, (128, 64, 64)), (64, (128, 64, 64)), (192, (128, 256, 64))])
def test_the_streaming_fwd_tile_only_where_one_covers_n(d_out, tile):
    """The fwd 128 x 64 tile marks its x loads evict-first: kept where one N tile covers
    d_out (x read once), left out where x would be read again for each N tile."""
    with jc.planner.force("det"):
        p = jc.plan("fwd", tokens=16384, d_in=4096, d_out=d_out, device=H200)
    assert p.tile == tile, jc.explain(p)
    assert variants.find_variant("fwd", (128, 64, 64), (1, 1), "bfloat16").streams_x


def test_force_raster_names_a_walk():
    for bad in ("x", "m1", "m0", "m08", f"m{contract.RASTER_BAND_MAX + 1}", "n2", 8):
        with pytest.raises((ValueError, TypeError), match="raster"):
            with jc.planner.force("det", raster=bad):
                pass


def _pingpong_walk(num_items: int, cluster_id: int, num_clusters: int, k_tiles: int):
    """A model of one CTA's ping-pong consumers as gemm_sm90's kernel writes them: the
    turn barriers' event order and each warpgroup's stage counter per tile. Returns
    (tiles in MMA order with their first stage, arrivals left unmatched)."""
    items = {w: list(range(cluster_id + w * num_clusters, num_items, 2 * num_clusters)) for w in (0, 1)}
    stage = {0: 0, 1: k_tiles}  # warpgroup 1 first steps over warpgroup 0's first tile
    pending = {3: int(cluster_id < num_items), 4: 0}  # barrier 3 = warpgroup 0's turn
    order, pos = [], {0: 0, 1: 0}
    turn = 0
    while pos[0] < len(items[0]) or pos[1] < len(items[1]):
        w = turn
        assert pos[w] < len(items[w]), "a warpgroup waits for a turn nobody gives"
        mine, theirs = 3 + w, 4 - w
        assert pending[mine] == 1, f"barrier {mine}: {pending[mine]} arrivals at the wait"
        pending[mine] -= 1
        item = items[w][pos[w]]
        order.append((item, stage[w]))
        stage[w] += k_tiles  # its K loop
        if item + num_clusters < num_items:
            pending[theirs] += 1
        stage[w] += k_tiles  # step over the other warpgroup's next tile
        pos[w] += 1
        turn = 1 - w
    return order, pending


@pytest.mark.parametrize("num_items", [0, 1, 2, 3, 131, 132, 133, 264, 4096, 4097])
@pytest.mark.parametrize("cluster_id, num_clusters", [(0, 132), (5, 132), (131, 132), (0, 66), (65, 66)])
def test_pingpong_turns_alternate_and_stages_follow_the_producer(num_items, cluster_id, num_clusters):
    """Every turn-barrier wait meets exactly one arrival from the other warpgroup (none
    left over: a stray arrival would let a later wait through early, a missing one hangs
    the CTA), the tiles run in the producer's order, and each tile's first stage is where
    the producer put it (item index x K tiles)."""
    k_tiles = 8
    order, pending = _pingpong_walk(num_items, cluster_id, num_clusters, k_tiles)
    producer = list(range(cluster_id, num_items, num_clusters))
    assert [item for item, _ in order] == producer
    assert [first for _, first in order] == [j * k_tiles for j in range(len(producer))]
    assert pending == {3: 0, 4: 0}


def test_only_the_skinny_plans_stream_x_with_an_evict_first_hint():
    """The evict-first hint on x's loads measured 6-14 % faster on the skinny fwd / wgrad and
    10-14 % slower on the batched forwards (H200, 2026-11-30): the skinny dense plans run a
    variant that carries it, the batched and compute-bound ones do not."""
    from jax_cake.planner import variants

    assert {(v.program, v.tile[:2]) for v in variants.VARIANTS if v.streams_x} == {
        ("fwd", (128, 64)),
        ("wgrad", (64, 128)),
    }

    def variant(p):
        out = p.out_dtype if p.op == "wgrad" and p.reduction == "none" else "float32" if p.op == "wgrad" else "bfloat16"
        store = "add" if p.reduction == "arrival" else "plain"
        return variants.find_variant(p.op, p.tile, p.cluster, out, store, p.schedule)

    for t in (16172, 16231, 16384):
        for op, out in (("fwd", "bfloat16"), ("wgrad", "float32"), ("wgrad", "bfloat16")):
            p = jc.plan(op, tokens=t, d_in=4096, d_out=48, out_dtype=out, device=H200)
            assert variant(p).streams_x, jc.explain(p)
    for batch, d_in, d_out in ((128, 128, 512), (128, 512, 128), (16, 128, 512)):
        p = jc.plan("fwd", tokens=4096, d_in=d_in, d_out=d_out, batch=batch, device=H200)
        assert not variant(p).streams_x, jc.explain(p)
    p = jc.plan("fwd", tokens=16384, d_in=4096, d_out=4096, device=H200)
    assert not variant(p).streams_x, jc.explain(p)


@pytest.mark.parametrize("t, d_in, d_out", [(16172, 4096, 4096), (16384, 4096, 1024), (16231, 5120, 4096)])
def test_fp32_wgrad_on_128x256_keeps_its_total_in_the_output(t, d_in, d_out, kernel_rules_only):
    """Where 128 x 256 tiles fill their waves, fp32 dw runs the variant that adds its chains
    into dw itself (no workspace), and only without splits."""
    from jax_cake.planner import variants

    for det in (True, False):
        p = jc.plan("wgrad", tokens=t, d_in=d_in, d_out=d_out, out_dtype="float32", deterministic=det, device=H200)
        assert (p.tile, p.cluster, p.splits, p.reduction) == ((128, 256, 64), (1, 1), 1, "none"), jc.explain(p)
        assert p.workspace_bytes == 16
        assert variants.find_variant("wgrad", p.tile, p.cluster, "float32").promote_in == "output"
    # bf16 dw on the same tile needs no workspace; ordered split-K cannot use the variant
    p = jc.plan("wgrad", tokens=t, d_in=d_in, d_out=d_out, out_dtype="bfloat16", device=H200)
    assert p.workspace_bytes == 16 or p.reduction == "split_tail", jc.explain(p)
    assert not variants.supports("wgrad", (128, 256, 64), (1, 1), "bfloat16", 2, contract.REDUCTION_ORDERED)
    assert not variants.supports("wgrad", (128, 256, 64), (1, 1), "float32", 2, contract.REDUCTION_ARRIVAL)


def test_forcing_the_128x128_fp32_wgrad_tile_gives_the_register_program():
    with jc.planner.force("det", tile=(128, 128, 64)):
        p = jc.plan("wgrad", tokens=16384, d_in=4096, d_out=4096, out_dtype="float32", device=H200)
    assert (p.tile, p.cluster, p.splits, p.workspace_bytes) == ((128, 128, 64), (2, 1), 1, 16), jc.explain(p)
    from jax_cake.planner import variants

    assert variants.find_variant("wgrad", p.tile, p.cluster, "float32").promote_in == "registers"


def test_fp32_split_tail_pieces_stay_within_one_promotion_interval():
    """fp32 split-tail pieces keep their share of K in one wgmma chain, so the planner cuts
    the tail only while a piece is at most OUTPUT_PROMOTE_EVERY K tiles; longer K falls
    back to the 128 x 160 register program."""
    from jax_cake.planner import variants

    p = jc.plan("wgrad", tokens=16384, d_in=5120, d_out=1024, out_dtype="float32", device=H200)
    assert p.reduction == "split_tail" and p.tile == (128, 256, 64), jc.explain(p)
    assert -(-(16384 // 64) // p.splits) <= variants.OUTPUT_PROMOTE_EVERY
    long_t = 64 * 4 * variants.OUTPUT_PROMOTE_EVERY + 64  # 4 pieces of P + 1 K tiles
    p = jc.plan("wgrad", tokens=long_t, d_in=5120, d_out=1024, out_dtype="float32", device=H200)
    assert p.reduction != "split_tail" and p.tile == (128, 160, 64), jc.explain(p)
    p = jc.plan("wgrad", tokens=long_t, d_in=5120, d_out=1024, out_dtype="bfloat16", device=H200)
    assert p.reduction == "split_tail", jc.explain(p)


def test_force_gemm_pins_one_gemm_and_leaves_the_others_to_the_planner():
    """force(gemm=(op, m, n, k)): the down projection's dgrad (T 8192, d_ff 14336 -> 4096:
    m 8192, n 14336, k 4096) on the pinned cooperative tile; its forward, another dgrad and
    the wgrad keep the planner's plans."""
    down = dict(tokens=8192, d_in=14336, d_out=4096, device=H200)
    other = dict(tokens=8192, d_in=4096, d_out=28672, device=H200)
    free = {op: jc.plan(op, **down) for op in ("fwd", "dgrad", "wgrad")}
    free_other = jc.plan("dgrad", **other)
    pin = dict(tile=(128, 256, 64), schedule="tiles", cluster=(1, 1))
    with jc.planner.force("det", gemm=("dgrad", 8192, 14336, 4096), **pin):
        pinned = jc.plan("dgrad", **down)
        rest = {op: jc.plan(op, **down) for op in ("fwd", "wgrad")}
        pinned_other = jc.plan("dgrad", **other)
    assert (pinned.tile, pinned.schedule, pinned.cluster) == ((128, 256, 64), "tiles", (1, 1)), jc.explain(pinned)
    assert (free["dgrad"].tile, free["dgrad"].schedule) != (pinned.tile, pinned.schedule)
    assert rest == {op: free[op] for op in ("fwd", "wgrad")} and pinned_other == free_other
    # the gated gradient planner keeps a pin that names its GEMM, and ignores one that does not
    from jax_cake.planner.gated import GATED_TILE, plan_gate_grad

    grad = dict(tokens=8192, d_ff=14336, d_out=4096, activation="silu", device=H200, epilogue=True)
    with jc.planner.force("det", gemm=("dgrad", 8192, 14336, 4096), tile=(128, 192, 64), schedule="pingpong", cluster=(1, 1)):
        named = plan_gate_grad(**grad)
    with jc.planner.force("det", gemm=("fwd", 8192, 4096, 14336), tile=(128, 128, 64), schedule="pingpong"):
        unnamed = plan_gate_grad(**grad)
    assert (named.op, named.cluster) == ("dgrad_gated", (1, 1)), jc.explain(named)
    assert (unnamed.op, unnamed.tile, unnamed.cluster) == ("dgrad_gated", GATED_TILE, (2, 1)), jc.explain(unnamed)
    for bad in (("bwd", 1, 2, 3), ("fwd", 8192, 0, 4096), ("fwd", 8192, 4096)):
        with pytest.raises(ValueError, match="gemm"):
            with jc.planner.force("det", gemm=bad):
                pass


def test_wide_pingpong_rule_keeps_a_forced_cluster():
    """Under force(cluster=(1, 1)) the rule scores only wide tiles compiled in that cluster
    (128 x 160 is compiled in pairs only), so the force holds."""
    args = dict(tokens=8192, d_in=4096, d_out=14336, device=H200)
    with jc.planner.force("det", cluster=(1, 1)):
        p = jc.plan("fwd", **args)
    assert (p.tile, p.schedule, p.cluster) == ((128, 192, 64), "pingpong", (1, 1)), jc.explain(p)
    assert "cluster 1x1 (forced)" in p.reason
    assert jc.plan("fwd", **args).tile == (128, 160, 64)


def test_dgrad_rule_never_picks_the_128x160_pingpong():
    """The dgrad 128 x 160 ping-pong variant is reached by force() only."""
    for t in (4096, 8192, 16384):
        for n in range(1024, 57345, 512):
            p = jc.plan("dgrad", tokens=t, d_in=n, d_out=4096, device=H200)
            assert p.tile != (128, 160, 64), jc.explain(p)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(tokens=-1), ValueError, "tokens must be >= 0"),
        (dict(d_in=-8), ValueError, "d_in must be >= 0"),
        (dict(tokens=16.5), TypeError, "tokens must be an int"),
        (dict(d_out="4096"), TypeError, "d_out must be an int"),
        (dict(batch=True), TypeError, "batch must be an int"),
        (dict(out_dtype="float16"), ValueError, "out_dtype of fwd must be bfloat16"),
        (dict(out_dtype="float32"), ValueError, "out_dtype of fwd must be bfloat16"),
        (dict(out_dtype="not a dtype"), TypeError, "out_dtype must be a dtype"),
        (dict(out_dtype=None), TypeError, "out_dtype must be a dtype"),
        (dict(device="h200"), TypeError, "device must be a jax Device"),
    ],
)
def test_plan_rejects_bad_arguments_by_name(kwargs, error, match):
    args = dict(tokens=8192, d_in=4096, d_out=4096, device=H200) | kwargs
    with pytest.raises(error, match=match):
        jc.plan("fwd", **args)


def test_plan_takes_numpy_ints_and_empty_sizes():
    import numpy as np

    p = jc.plan("wgrad", tokens=np.int64(8192), d_in=np.int32(4096), d_out=4096, out_dtype=np.float32, device=H200)
    assert p == jc.plan("wgrad", tokens=8192, d_in=4096, d_out=4096, out_dtype="float32", device=H200)
    assert type(p.m) is int and type(p.k) is int
    assert not jc.plan("fwd", tokens=0, d_in=4096, d_out=4096, device=H200).uses_kernel
    with pytest.raises(ValueError, match="out_dtype of wgrad must be bfloat16 or float32"):
        jc.plan("wgrad", tokens=8192, d_in=4096, d_out=4096, out_dtype="float16", device=H200)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(splits=0), ValueError, "splits must be >= 1"),
        (dict(splits=-2), ValueError, "splits must be >= 1"),
        (dict(splits="4"), TypeError, "splits must be None or an int"),
        (dict(splits=True), TypeError, "splits must be None or an int"),
        (dict(tile=(7, 7)), TypeError, "tile must be None or"),
        (dict(tile=128), TypeError, "tile must be None or"),
        (dict(tile=(128, 0, 64)), ValueError, "tile sizes must be >= 1"),
    ],
)
def test_force_rejects_bad_pins_by_name(kwargs, error, match):
    with pytest.raises(error, match=match), jc.planner.force("det", **kwargs):
        pass


def test_force_takes_numpy_ints():
    import numpy as np

    args = dict(tokens=16384, d_in=4096, d_out=1024, out_dtype="float32", device=H200)
    with jc.planner.force("split", splits=4, tile=(128, 128, 64)):
        want = jc.plan("wgrad", **args)
    with jc.planner.force("split", splits=np.int64(4), tile=[np.int32(128), 128, 64]):
        assert jc.plan("wgrad", **args) == want
    assert want.splits == 4 and want.tile == (128, 128, 64), jc.explain(want)


def test_symbolic_sizes_plan_the_xla_path_and_export():
    """A shape-polymorphic export (symbolic token count) plans XLA's dot, with the reason,
    on the GPU as on the CPU."""
    from jax import export

    (t,) = export.symbolic_shape("t")
    p = jc.plan("fwd", tokens=t, d_in=4096, d_out=4096, device=H200)
    assert not p.uses_kernel and "symbolic tokens" in p.reason, jc.explain(p)
    x = jax.ShapeDtypeStruct((t, 64), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    exported = export.export(jax.jit(jc.dense_projection))(x, w)
    assert str(exported.out_avals[0].shape) == "(t, 32)"


def test_explain_takes_a_plan_only():
    with pytest.raises(TypeError, match="explain: p must be a Plan"):
        jc.explain("x")
