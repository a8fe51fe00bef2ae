"""benchmarks.bench --family=model on CPU at tiny sizes: every case runs both arms and reports
matching losses; the table, CSV and header; the CLI end to end with the cold row."""

import csv
import math
import os
import subprocess
import sys
import tempfile

import jax
import pytest

from benchmarks import harness
from benchmarks.families import model as mb
from helpers import REPO, rel_err


TINY = mb.Sizes(
    skinny_tokens=37,
    skinny_d=64,
    skinny_heads=(8, 16, 8, 16),
    block_tokens=32,
    d_model=64,
    d_q=64,
    d_kv=16,
    d_ff=128,
    blocks=1,
    mlp_tokens=32,
    router_tokens=64,
    router_d=64,
    router_experts=16,
    top_k=4,
    moe_tokens=64,
    moe_d=64,
    moe_d_ff=128,
    moe_experts=4,
    moe_top_k=2,
)
TINY_FLAGS = [
    f"--{name}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
    for name, v in ((f, getattr(TINY, f)) for f in mb.SIZE_FLAGS)
]


def test_every_case_runs_both_arms_with_matching_losses():
    timed = [c for c in mb.DEFAULT_CASES if c != "cold"]
    samples = mb.collect(timed, TINY, mode="g", run=0, steps=1, groups=2, flush_mb=1, timer_kind="wall")
    arms = {(s["case"], s["arm"]) for s in samples}
    assert arms == {("skinny", a) for a in ("xla", "separate", "fused")} | {
        (c, a) for c in ("block", "block_remat", "mlp", "router", "moe", "moe_capacity") for a in ("xla", "jax_cake")
    } | {("mlp", "composed")}
    for s in samples:
        assert len(s["groups_us"]) == 2 and all(g > 0 for g in s["groups_us"]), s
        assert s["temp_bytes"] >= 0 and math.isfinite(s["loss"]), s
    rows = mb.table_rows(samples)
    assert [r["step"] for r in rows] == [
        mb.case_label("skinny", TINY) + " (separate)",
        mb.case_label("skinny", TINY) + " (fused)",
        mb.case_label("block", TINY),
        mb.case_label("block_remat", TINY),
        mb.case_label("mlp", TINY),
        mb.case_label("mlp", TINY) + " (composed)",
        mb.case_label("router", TINY),
        mb.case_label("moe", TINY),
        mb.case_label("moe_capacity", TINY),
    ]
    for r in rows:  # the same model, init and data: only the GEMMs' rounding differs (and
        # the capacity layer drops copies: its loss differs, more than rounding)
        if r["step"] != mb.case_label("moe_capacity", TINY):
            assert r["loss rel diff"] < 1e-2, r
        assert r["XLA/jax_cake"] == pytest.approx(r["XLA ms"] / r["jax_cake ms"])


def test_fused_and_separate_skinny_arms_compute_the_same_step():
    case = mb.make_case("skinny", TINY, True)
    x, params, opt = case.inputs()
    sep, fused = (jax.jit(mb.train_step(case.loss(arm)))(x, params, opt) for arm in ("separate", "fused"))
    assert float(sep[2]) == pytest.approx(float(fused[2]), rel=1e-2)
    for a, b in zip(jax.tree.leaves(sep[1]), jax.tree.leaves(fused[1])):  # Adam moments from dw
        assert a.dtype == b.dtype == jax.numpy.float32
    # Adam's first moment after one step is (1 - b1) dw: every head's FP32 dw, arm against arm
    m_sep, m_fused = jax.tree.leaves(sep[1][0]), jax.tree.leaves(fused[1][0])
    assert len(m_sep) == len(m_fused) == len(TINY.skinny_heads)
    for a, b in zip(m_sep, m_fused):
        assert rel_err(b, a) < 1e-5
    assert rel_err(fused[3], sep[3]) < 1e-2  # dx, bf16


def _sample(case, arm, run, groups, loss=1.0, temp=2**20, mode="g"):
    return dict(case=case, label=case, arm=arm, run=run, mode=mode, groups_us=groups, loss=loss, temp_bytes=temp)


def test_an_arm_that_fails_is_reported_and_the_others_are_timed():
    """An arm that cannot compile or run (a baseline out of memory, say) gets its failure as
    the row's status and no time; the other arm is still timed and reported."""
    good = mb.make_case("mlp", TINY, True)

    def loss(arm):
        if arm == "xla":

            def fails(params, x):
                raise MemoryError("RESOURCE_EXHAUSTED: out of memory while trying to allocate 60 GiB")

            return fails
        return good.loss(arm)

    case = mb.Case(good.name, good.label, ("xla", "jax_cake"), good.inputs, loss)
    timer = harness.make_timer("wall", harness.flush_buffer(1), 1)
    out = mb.measure_case(case, timer, steps=1, groups=2)
    assert out["xla"] == {"status": "failed: MemoryError: RESOURCE_EXHAUSTED: out of memory while trying to allocate 60 GiB"}
    assert out["jax_cake"]["status"] == "ok" and len(out["jax_cake"]["groups_us"]) == 2
    samples = [dict(case="mlp", label=good.label, arm=a, mode="g", run=0, **r) for a, r in out.items()]
    (row,) = mb.table_rows(samples)
    assert row["XLA ms"] is None and row["XLA/jax_cake"] is None and row["jax_cake ms"] > 0
    assert row["XLA temp MiB"] is None and row["loss rel diff"] is None
    assert row["status"].startswith("XLA failed: MemoryError: RESOURCE_EXHAUSTED")


def test_rows_are_medians_over_runs_of_group_medians():
    samples = [
        _sample("mlp", "xla", 0, [3000.0, 1000.0, 2000.0], loss=2.0, temp=3 * 2**20),
        _sample("mlp", "xla", 1, [4000.0, None, 4000.0], loss=2.0, temp=3 * 2**20),
        _sample("mlp", "jax_cake", 0, [1000.0, 1000.0, 1000.0], loss=2.002),
        _sample("mlp", "jax_cake", 1, [2000.0, 2000.0, 2000.0], loss=2.002),
    ]
    cold = [
        dict(case="cold", arm="xla", run=0, seconds=10.0, loss=2.0),
        dict(case="cold", arm="jax_cake", run=0, seconds=8.0, loss=2.002),
        dict(case="cold", arm="xla", run=1, seconds=12.0, loss=2.0),
        dict(case="cold", arm="jax_cake", run=1, seconds=10.0, loss=2.002),
    ]
    mlp, cold_row = mb.table_rows(samples, cold, "MLP")
    assert mlp["XLA ms"] == pytest.approx(3.0)  # runs: median(1,2,3) = 2 and median(4,4) = 4
    assert mlp["jax_cake ms"] == pytest.approx(1.5)
    assert mlp["XLA/jax_cake"] == pytest.approx(2.0)
    assert mlp["loss rel diff"] == pytest.approx(1e-3)
    assert (mlp["XLA temp MiB"], mlp["jax_cake temp MiB"]) == (3.0, 1.0)
    assert cold_row["step"] == "cold first step, fresh process: MLP"
    assert (cold_row["XLA ms"], cold_row["jax_cake ms"]) == (11000.0, 9000.0)

    header = dict(gpu="H200", sms=132, driver="1", jax="0.0", date="2026-01-01", timer=harness.DEVICE_LABEL)
    protocol = dict(runs=2, groups=3, steps=1, deterministic=True, cold_runs=2)
    text = mb.markdown(mb.header_line(header, "python -m benchmarks.bench --family=model --cases=mlp", protocol), [mlp])
    first = text.splitlines()[0]
    for words in ("GPU H200, 132 SMs", "jax 0.0", "2026-01-01", "`python -m benchmarks.bench --family=model --cases=mlp`"):
        assert words in first
    assert "| mlp | g | 3.000 | 1.500 | 2.000 | 1.0e-03 | 3.000 | 1.000 |" in text


def test_cli_writes_markdown_and_csv_with_the_cold_row():
    with tempfile.TemporaryDirectory() as tmp:
        md, csv_path = os.path.join(tmp, "m.md"), os.path.join(tmp, "m.csv")
        subprocess.run(
            [sys.executable, "-m", "benchmarks.bench", "--family=model", "--cases=router,cold", "--cold_case=router"]
            + ["--runs=1", "--groups=1", "--cold_runs=1", "--flush_mb=1", f"--md={md}", f"--csv={csv_path}"]
            + TINY_FLAGS,
            cwd=REPO,
            check=True,
            capture_output=True,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )
        text = open(md).read()
        with open(csv_path) as f:
            rows = list(csv.DictReader(f))
    first = text.splitlines()[0]
    assert "host wall time (no GPU)" in first and f"jax {jax.__version__}" in first
    assert "command: `python -m benchmarks.bench --family=model --cases=router,cold" in first
    assert "cold: host wall time from process spawn" in first
    assert [r["step"] for r in rows] == [
        mb.case_label("router", TINY),
        "cold first step, fresh process: " + mb.case_label("router", TINY),
    ]
    assert list(rows[0]) == list(mb.COLUMNS)
    for r in rows:
        assert float(r["XLA ms"]) > 0 and float(r["jax_cake ms"]) > 0 and float(r["loss rel diff"]) < 1e-2
    assert float(rows[0]["XLA temp MiB"]) >= 0 and rows[1]["XLA temp MiB"] == ""


def test_the_kernel_breakdown_sums_each_kernel_per_step_without_the_flushes():
    events = [  # (start ns, end ns, name) of two steps, each ended by its flush
        (0, 4000, "jax_cake_fwd_128x256"),
        (4000, 5000, "loop_multiply_fusion"),
        (5000, 6000, "flush_xor_fusion"),
        (6000, 10000, "jax_cake_fwd_128x256"),
        (10000, 12000, "loop_multiply_fusion_3"),
        (12000, 12500, "input_reduce_fusion.2"),
        (12500, 13500, "flush_xor_fusion"),
    ]
    rows = harness.kernel_breakdown(events, {"flush_xor_fusion"}, steps=2)
    assert rows == [
        {"kernel": "jax_cake_fwd_128x256", "launches": 1.0, "us": 4.0},
        {"kernel": "loop_multiply_fusion", "launches": 1.0, "us": 1.5},
        {"kernel": "input_reduce_fusion", "launches": 0.5, "us": 0.25},
    ]
    top = harness.top_kernels(rows, 1)
    assert top[0] == rows[0] and top[1] == {"kernel": "(the other 2 kernels)", "launches": 1.5, "us": 1.75}
    assert harness.top_kernels(rows, 3) == rows


def test_top_kernels_lists_each_arms_busiest_kernels_after_the_table():
    case = mb.make_case("mlp", TINY, True)
    timer = harness.make_timer("wall", harness.flush_buffer(1), 1)
    out = mb.measure_case(case, timer, steps=1, groups=1, top_kernels=3)
    assert {arm: r["kernels"] for arm, r in out.items()} == {arm: None for arm in case.arms}  # no device timeline
    samples = [dict(case="mlp", label=case.label, arm=a, mode="g", run=0, **r) for a, r in out.items()]
    text = mb.kernels_markdown(samples)
    assert f"Kernels of one step: {case.label}, XLA (g):" in text and "n/a: host wall time" in text

    gpu = [  # what a GPU run brings back: run 0's breakdown is shown, run 1's not
        dict(case="moe", label="MoE", arm="jax_cake", mode="g", run=0, kernels=[
            {"kernel": "jax_cake_fwd", "launches": 2.0, "us": 300.0},
            {"kernel": "(the other 4 kernels)", "launches": 9.0, "us": 100.0},
        ]),
        dict(case="moe", label="MoE", arm="jax_cake", mode="g", run=1, kernels=[{"kernel": "x", "launches": 1.0, "us": 1.0}]),
    ]
    text = mb.kernels_markdown(gpu)
    assert text.count("Kernels of one step") == 1 and "Kernels of one step: MoE, jax_cake (g):" in text
    assert "| jax_cake_fwd | 2.000 | 300.0 | 75.0% |" in text and "| (the other 4 kernels) | 9.000 | 100.0 | 25.0% |" in text
    assert mb.kernels_markdown([{k: v for k, v in gpu[0].items() if k != "kernels"}]) == ""
