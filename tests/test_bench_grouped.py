"""benchmarks.bench --family=grouped on CPU: the routings, the arms' values (each against
float64 and the jax_cake arm), the table and CSV of a whole run, and the flags it refuses.
Nothing here is a timing."""

import csv
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import REPO
from benchmarks import harness
from benchmarks.families import grouped

TINY = grouped.GroupedPoint(rows=48, groups=4, d_in=32, d_out=16, out="float32")
SHAPE_COLUMNS = ("GPU", "SMs", "G", "M", "d_in -> d_out", "w", "routing", "op", "mode")


def tokamax_importable() -> bool:
    try:
        grouped.import_tokamax()
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("groups", [1, 4, 8, 32, 128])
@pytest.mark.parametrize("routing", grouped.ROUTINGS)
def test_routings_cover_every_row(routing, groups):
    sizes = grouped.group_sizes(routing, 16384, groups)
    assert sizes.dtype == np.int32 and sizes.shape == (groups,)
    assert int(sizes.sum()) == 16384 and sizes.min() >= 0
    if routing == "balanced":
        assert sizes.max() - sizes.min() <= 1
    if routing == "one":
        assert sizes[0] == 16384
    if routing == "skewed" and groups > 1:
        assert (sizes == 0).sum() == max(1, groups // 8), sizes
        assert sizes.max() > 16384 / groups  # skewed: the largest group above the balanced share
        np.testing.assert_array_equal(sizes, grouped.group_sizes(routing, 16384, groups))  # the fixed seed


def test_default_points_are_the_three_models_experts():
    points = grouped.parse_points(grouped.DEFAULT_POINTS, ["float32"])
    assert [(p.rows, p.groups, p.d_in, p.d_out) for p in points] == [
        (16384, 8, 4096, 14336),
        (16384, 8, 14336, 4096),
        (65536, 128, 2048, 768),
        (65536, 128, 768, 2048),
        (16384, 32, 7168, 2048),
        (16384, 32, 2048, 7168),
    ]
    assert points[0].flops("fwd") == 2 * 16384 * 4096 * 14336
    assert points[0].flops("fwd+bwd") == 3 * points[0].flops("fwd")


@pytest.mark.parametrize("routing", grouped.ROUTINGS)
@pytest.mark.parametrize("out", ["float32", "bfloat16"])
def test_every_arm_agrees(routing, out):
    """Each arm's y, dx and dw (one fwd+bwd) against float64 and against the jax_cake arm."""
    point = grouped.GroupedPoint(TINY.rows, TINY.groups, TINY.d_in, TINY.d_out, out)
    inputs = grouped.make_inputs(point, flush_mb=1)
    sizes = grouped.group_sizes(routing, point.rows, point.groups)
    broken, wrong = grouped.check_arms(grouped.ARMS, inputs, sizes)
    assert wrong == {}
    # no grouped kernel runs on the CPU: the kernels arm is reported, the others all pass
    assert broken.pop("kernels").startswith("no grouped kernel runs here (no grouped kernel for cpu")
    if tokamax_importable():
        assert broken == {}
    else:
        assert list(broken) == ["tokamax"] and broken["tokamax"].startswith("not importable")


def test_every_op_of_every_arm_gives_the_dtypes_of_its_contract():
    inputs = grouped.make_inputs(TINY, flush_mb=1)
    sizes = grouped.group_sizes("skewed", TINY.rows, TINY.groups)
    runnable = [a for a in grouped.ARMS if a != "kernels" and (a != "tokamax" or tokamax_importable())]
    for arm in runnable:
        x, ws, dy = grouped.arm_operands(arm, inputs, sizes)
        fwd, bwd, both = (jax.jit(grouped.arm_step(arm, op))(x, ws, dy) for op in grouped.OPS)
        assert fwd[0].dtype == jnp.bfloat16 and fwd[0].shape == (TINY.rows, TINY.d_out)
        dx, dw = bwd
        assert dx.dtype == jnp.bfloat16 and dx.shape == inputs.x.shape
        assert dw.dtype == jnp.float32 and dw.shape == ws[0].shape  # an FP32 master's gradient is FP32
        for a, b in zip((fwd[0], dx, dw), both):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_wrong_values_are_caught():
    """A ragged dot fed the wrong group sizes fails both checks."""
    inputs = grouped.make_inputs(TINY, flush_mb=1)
    sizes = grouped.group_sizes("skewed", TINY.rows, TINY.groups)
    real = grouped.forward

    def forward(arm):
        fn = real(arm)
        return (lambda x, w, s: fn(x, w, s[::-1])) if arm == "xla" else fn

    grouped.forward = forward
    try:
        broken, wrong = grouped.check_arms(("jax_cake", "xla"), inputs, sizes)
    finally:
        grouped.forward = real
    assert broken == {} and list(wrong) == ["xla"]
    assert "from float64" in wrong["xla"] and "from jax_cake's" in wrong["xla"]


def test_an_arm_that_fails_is_reported_not_dropped():
    inputs = grouped.make_inputs(TINY, flush_mb=1)
    real = grouped.forward

    def fails(x, w, sizes):
        raise RuntimeError("UNIMPLEMENTED: no fusion for this ragged dot")  # as XLA's compile errors read

    def forward(arm):
        return fails if arm == "xla_cudnn" else real(arm)

    grouped.forward = forward
    try:
        broken, wrong = grouped.check_arms(("jax_cake", "xla_cudnn"), inputs, grouped.group_sizes("one", 48, 4))
    finally:
        grouped.forward = real
    assert wrong == {} and list(broken) == ["xla_cudnn"]
    why = "failed to compile or run (RuntimeError: UNIMPLEMENTED: no fusion for this ragged dot)"
    assert broken["xla_cudnn"] == why


def test_report_medians_tflops_ratios_and_status():
    header = {"gpu": "H200", "sms": 132, "driver": "d", "jax": "0.11.2", "date": "2026-12-06"}
    header["timer"] = harness.DEVICE_LABEL
    point = grouped.GroupedPoint(16384, 8, 4096, 14336, "float32")
    base = {"rows": 16384, "groups": 8, "d_in": 4096, "d_out": 14336, "out": "float32", "routing": "skewed"}
    base.update(op="fwd", mode="g", sizes=[int(s) for s in grouped.group_sizes("skewed", 16384, 8)])
    samples = [
        {**base, "run": run, "arm": arm, "groups_us": [us * scale, us * scale * 3, us * scale / 3], "note": ""}
        for run, scale in enumerate((1.0, 1.2, 9.0))
        for arm, us in (("jax_cake", 2000.0), ("xla", 4000.0), ("dense", 1000.0))
    ]
    samples.append({**base, "run": 0, "arm": "xla_cudnn", "groups_us": None, "note": "failed to compile or run (X)"})
    samples.append({**base, "run": 0, "arm": "tokamax", "groups_us": None, "note": "not importable (Y)"})
    arms = list(grouped.ARMS)
    (row,) = grouped.table_rows(header, samples, arms)
    assert row["jax_cake us"] == pytest.approx(2400.0)
    assert row["jax_cake TFLOP/s"] == pytest.approx(point.flops("fwd") / 2400e-6 / 1e12)
    assert row["xla/jax_cake"] == pytest.approx(2.0) and row["dense/jax_cake"] == pytest.approx(0.5)
    assert "xla_cudnn us" not in row and "xla_cudnn/jax_cake" not in row
    assert row["status"] == "xla_cudnn: failed to compile or run (X); tokamax: not importable (Y)"
    columns = grouped.columns(arms)
    assert columns[: len(SHAPE_COLUMNS)] == list(SHAPE_COLUMNS) and columns[-1] == "status"
    assert {"dense@xla_cudnn us", "xla_cudnn/jax_cake", "tokamax TFLOP/s"} <= set(columns)


def run_cli(*argv: str) -> tuple[subprocess.CompletedProcess, str, list[dict]]:
    with tempfile.TemporaryDirectory() as tmp:
        md, csv_path = os.path.join(tmp, "g.md"), os.path.join(tmp, "g.csv")
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.bench", "--family=grouped", *argv, f"--md={md}", f"--csv={csv_path}"],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        if out.returncode:
            return out, "", []
        with open(csv_path) as f:
            return out, open(md).read(), list(csv.DictReader(f))


def test_a_whole_run_writes_markdown_and_csv():
    """Every routing and arm at a tiny point, graph mode: the xla_cudnn arm in its own child
    with the fusion flag (on CPU it compiles: XLA's CPU backend ignores the GPU flag)."""
    out, text, rows = run_cli(
        "--moe_points=48:4:32:16", "--modes=g", "--groups=1", "--steps=1", "--flush_mb=1", "--runs=1"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "host wall time (no GPU)" in text.splitlines()[0]
    assert "- G=4, M=48, skewed: largest group" in text
    columns = grouped.columns(list(grouped.ARMS))
    assert "| " + " | ".join(columns) + " |" in text
    assert len(rows) == len(grouped.ROUTINGS) * len(grouped.OPS)
    assert sorted((r["routing"], r["op"]) for r in rows) == sorted(
        (r, o) for r in grouped.ROUTINGS for o in grouped.OPS
    )
    for r in rows:
        assert list(r) == columns
        assert (r["G"], r["M"], r["d_in -> d_out"], r["w"], r["mode"]) == ("4", "48", "32 -> 16", "float32", "g")
        for arm in ("jax_cake", "xla", "xla_cudnn", "dense", "dense@xla_cudnn"):
            assert float(r[f"{arm} us"]) > 0
            flops = TINY.flops(r["op"])
            assert float(r[f"{arm} TFLOP/s"]) == pytest.approx(flops / float(r[f"{arm} us"]) / 1e6, rel=1e-9)
        assert float(r["xla/jax_cake"]) == pytest.approx(float(r["xla us"]) / float(r["jax_cake us"]), rel=1e-9)
        if tokamax_importable():
            assert float(r["tokamax us"]) > 0 and "tokamax: lowered to xla" in r["status"]
        else:
            assert r["tokamax us"] == "" and r["status"].startswith("tokamax: not importable")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--family=grouped", "--tokens=64"], "--family=grouped does not take --tokens"),
        (["--family=grouped", "--d_out=64"], "--family=grouped does not take --d_out"),
        (["--family=dense", "--moe_points=48:4:32:16"], "--family=dense does not take --moe_points"),
        (["--family=router", "--routings=one"], "--family=router does not take --routings"),
        (["--family=grouped", "--routings=zipf"], "--routings: ['zipf'] not in"),
        (["--family=grouped", "--ops=wgrad"], "--ops: ['wgrad'] not in"),
        (["--family=grouped", "--arms=cublas"], "--arms: ['cublas'] not in"),
        (["--family=grouped", "--moe_points=48:4:32"], "is not M:G:d_in:d_out"),
    ],
)
def test_flags_it_does_not_read_are_refused(argv, message):
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench", *argv], cwd=REPO, capture_output=True, text=True)
    assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]


def test_the_xla_cudnn_arm_never_shares_a_process():
    """A child asked for xla_cudnn without the fusion flag (or the other way round) refuses."""
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace(grouped.CUDNN_FLAG, ""))
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.bench", "--family=grouped", "--arms=xla_cudnn", "--modes=g"]
            + ["--moe_points=48:4:32:16", f"--child_out={os.path.join(tmp, 'c.json')}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            env=env,
        )
    assert out.returncode != 0 and "runs alone in a process" in out.stderr, out.stderr[-2000:]


def test_failed_children_are_reported():
    """The status an xla_cudnn child that died leaves in every row of its arm."""
    why = "its child process exited with status 134 (its stderr above)"
    samples = grouped.failed_samples(why, [TINY], ["one"], ["fwd", "bwd"], ["g"])
    header = {"gpu": "H200", "sms": 132, "driver": "d", "jax": "0.11.2", "date": "2026-12-06", "timer": "t"}
    rows = grouped.table_rows(header, samples, list(grouped.ARMS))
    assert [(r["op"], r["status"]) for r in rows] == [("fwd", f"xla_cudnn: {why}"), ("bwd", f"xla_cudnn: {why}")]
    assert all("xla_cudnn us" not in r for r in rows)


def test_the_jax_cake_arm_runs_the_grouped_kernels_in_its_whole_step():
    """Lowered for the faked H200: the jax_cake arm's fwd+bwd step calls each grouped
    kernel once."""
    from helpers import cuda_text, custom_call_lines, rand

    from jax_cake import contract

    x, w, dy = rand(0, (256, 64)), rand(1, (4, 32, 64), jnp.float32), rand(2, (256, 32))
    sizes = jnp.asarray([100, 0, 90, 66], jnp.int32)
    text = cuda_text(grouped.op_step("fwd+bwd", grouped.forward("jax_cake")), x, (w, sizes), dy)
    for target in (contract.GROUPED_FWD_TARGET, contract.GROUPED_DGRAD_TARGET, contract.GROUPED_WGRAD_TARGET):
        assert len(custom_call_lines(text, target)) == 1, target


def test_the_kernels_arm_times_the_three_kernels_alone_on_laid_out_operands():
    """Its operands are made before timing (x and dy in the row layout, the weight bf16);
    lowered for the faked H200 its fwd+bwd step is the three grouped kernels' calls and
    nothing else: no gather, no cast, no ragged dot."""
    from helpers import cuda_text, custom_call_lines

    from jax_cake import contract
    from jax_cake.primitives import grouped as grouped_lib

    point = grouped.GroupedPoint(256, 4, 64, 32, "float32")
    inputs = grouped.make_inputs(point, flush_mb=1)
    sizes = grouped.group_sizes("skewed", point.rows, point.groups)
    x, ws, dy = grouped.arm_operands("kernels", inputs, sizes)
    layout = grouped_lib.padded_layout(jnp.asarray(sizes), point.rows, k_tile=64)
    assert x.shape == (layout.capacity, point.d_in) and dy.shape == (layout.capacity, point.d_out)
    assert ws[0].dtype == jnp.bfloat16 and ws[0].shape == inputs.w.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(layout.lay_out(inputs.x)))
    for a, b in zip(ws[1:], (layout.row_table, layout.k_table, layout.dest)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    text = cuda_text(grouped.arm_step("kernels", "fwd+bwd", "float32"), x, ws, dy)
    targets = (contract.GROUPED_FWD_TARGET, contract.GROUPED_DGRAD_TARGET, contract.GROUPED_WGRAD_TARGET)
    assert [len(custom_call_lines(text, t)) for t in targets] == [1, 1, 1]
    for op in ("gather", "convert", "ragged_dot"):
        assert op not in text, op


def test_the_dense_tile_arm_runs_every_gemm_on_the_grouped_kernels_tile():
    """Lowered for the faked H200, the dense anchor's fwd, dgrad and wgrad run on their
    planner's tiles, and dense_tile's on 128 x 128 x 64 each (the grouped kernels')."""
    from helpers import cuda_text

    inputs = grouped.make_inputs(grouped.GroupedPoint(256, 4, 64, 32, "float32"), flush_mb=1)
    x, ws, dy = grouped.arm_operands("dense_tile", inputs, [256])

    def tiles(arm):
        text = cuda_text(grouped.arm_step(arm, "fwd+bwd"), x, ws, dy)
        lines = [line for line in text.splitlines() if "stablehlo.custom_call @jax_cake" in line]
        found = [re.search(r"tile_k = (\d+) : i64, tile_m = (\d+) : i64, tile_n = (\d+) : i64", line) for line in lines]
        return [tuple(int(v) for v in m.groups()) for m in found]

    assert len(tiles("dense")) == 3 and tiles("dense") != [(64, 128, 128)] * 3
    assert tiles("dense_tile") == [(64, 128, 128)] * 3
