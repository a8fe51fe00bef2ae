"""benchmarks.report on CPU: the generated tables from small benchmark CSVs, the marker block, the pictures."""

import csv
import gzip
import math
import os
import subprocess
import sys

import pytest

from benchmarks import report
from benchmarks.families import dense
from benchmarks.families import router as router_family
from helpers import REPO

DENSE_COLUMNS = list(dense.TABLE.columns)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def dense_row(d_in, d_out, out, tokens, op, mode, new, xla, cublas, split=None):
    row = dict.fromkeys(DENSE_COLUMNS, "")
    row.update(
        {
            "GPU": "H200",
            "SMs": 132,
            "d_in -> d_out": f"{d_in} -> {d_out}",
            "out": out,
            "T": tokens,
            "op": op,
            "mode": mode,
            "det us": new,
            "split us": split if split is not None else new,
            "XLA us": xla,
            "cuBLAS us": cublas,
            "new us": new,
            # bench writes these ratios; report recomputes them from the times
            "det/new": 1.0,
            "XLA/new": xla / new,
            "cuBLAS/new": cublas / new,
        }
    )
    return row


def write_csv(path, columns, rows, compress=False):
    opener = gzip.open if compress else open
    with opener(path, "wt", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


@pytest.fixture
def fixtures(tmp_path):
    """Two dense files (the second replaces one row of the first), a router, a batched and a floor CSV."""
    first = [
        # skinny point: XLA 2x / 3x slower, cuBLAS 1.2x
        dense_row(4096, 48, "FP32", 16172, "fwd", "g", new=40.0, xla=80.0, cublas=48.0),
        dense_row(4096, 48, "FP32", 16172, "wgrad", "g", new=40.0, xla=120.0, cublas=48.0, split=44.0),
        # compute-bound point: XLA 0.9x, cuBLAS 1.0x
        dense_row(4096, 1024, "BF16", 16172, "fwd", "g", new=200.0, xla=180.0, cublas=200.0),
        dense_row(4096, 1024, "BF16", 16172, "wgrad", "g", new=200.0, xla=180.0, cublas=200.0),
        dense_row(4096, 48, "FP32", 16172, "fwd", "e", new=50.0, xla=55.0, cublas=50.0),
    ]
    # a later re-measurement of the compute-bound wgrad: its row must replace the first file's
    later = [dense_row(4096, 1024, "BF16", 16172, "wgrad", "g", new=100.0, xla=160.0, cublas=100.0)]
    dense_a = write_csv(tmp_path / "dense_a.csv.gz", DENSE_COLUMNS, first, compress=True)
    dense_b = write_csv(tmp_path / "dense_b.csv", DENSE_COLUMNS, later)
    router_columns = list(router_family.TABLE.columns)
    router = write_csv(
        tmp_path / "router.csv",
        router_columns,
        [
            {
                "GPU": "H200",
                "SMs": 132,
                "d -> E": "4096 -> 256",
                "T": 16384,
                "op": "fwd",
                "mode": "g",
                "XLA x3 us": 412.8,
                "XLA highest us": 679.872,
                "new us": 151.552,
                "XLA x3/new": 412.8 / 151.552,
                "XLA highest/new": 679.872 / 151.552,
            }
        ],
    )
    batched_columns = ["GPU", "SMs", "B", "d_in -> d_out", "T", "op", "mode", "XLA us", "cuBLAS us", "new us"]
    batched = write_csv(
        tmp_path / "batched.csv",
        batched_columns,
        [
            {
                "GPU": "H200",
                "SMs": 132,
                "B": 16,
                "d_in -> d_out": "128 -> 512",
                "T": 4096,
                "op": "fwd",
                "mode": "g",
                "XLA us": 28.0,
                "cuBLAS us": 31.0,
                "new us": 27.9,
            }
        ],
    )
    floor = write_csv(
        tmp_path / "floor.csv",
        ["rows", "a -> b (bf16)", "MB read", "MB written", "floor us", "TB/s"],
        [
            {"rows": 16172, "a -> b (bf16)": "4096 -> 48", "MB read": 132.5, "MB written": 1.6, "floor us": 37.5},
            # a widen case: not a floor for the skinny fwd / wgrad rows
            {"rows": 16172, "a -> b (bf16)": "48 -> 4096", "MB read": 1.6, "MB written": 132.5, "floor us": 42.4},
        ],
    )
    page = tmp_path / "page.md"
    before = "# Benchmarks\n\nhand-written text above.\n\n"
    after = "\n\nhand-written text below, with a stray marker-like word: report:end.\n"
    page.write_text(before + report.BEGIN + "\nstale table\n" + report.END + after)
    return dict(
        csvs=[dense_a, dense_b, router, batched, floor],
        page=str(page),
        img_dir=str(tmp_path / "img"),
        before=before,
        after=after,
    )


def table_line(block, *cells):
    """The markdown table row that starts with these cells."""
    prefix = "| " + " | ".join(cells) + " |"
    hits = [line for line in block.splitlines() if line.startswith(prefix)]
    assert len(hits) == 1, f"{prefix!r} in:\n{block}"
    return [c.strip() for c in hits[0].strip("|").split("|")]


def test_families_and_merge_order(fixtures):
    rows, sources = report.load(fixtures["csvs"])
    assert [os.path.basename(p) for p in sources["dense"]] == ["dense_a.csv.gz", "dense_b.csv"]
    assert len(rows["dense"]) == 5  # six rows read, one replaced by the later file
    wgrad = [r for r in rows["dense"] if r["op"] == "wgrad" and r["d_in -> d_out"] == "4096 -> 1024"]
    assert [r["new us"] for r in wgrad] == [100.0]
    assert len(rows["router"]) == len(rows["batched"]) == 1
    assert len(rows["floor"]) == 2
    with pytest.raises(ValueError, match="not a benchmark or memory_floor CSV"):
        report.family_of(["a", "b"])


def test_headline_table_values(fixtures):
    report.write_report(fixtures["csvs"], fixtures["page"], fixtures["img_dir"])
    text = open(fixtures["page"]).read()
    block = text[text.index(report.BEGIN) : text.index(report.END)]
    assert "stale table" not in block
    assert "`dense_a.csv.gz`, `dense_b.csv`" in block

    # fwd, graph: XLA/new 2.0 (skinny) and 0.9 (compute bound); cuBLAS/new 1.2 and 1.0
    cells = table_line(block, "fwd", "g", "2")
    assert cells[3] == f"{math.sqrt(2.0 * 0.9):.3f} (0.90-2.00)"
    assert cells[4] == "2.000 (2.00-2.00)"
    assert cells[5] == "0.900 (0.90-0.90)"
    assert cells[6] == "1/2"
    assert cells[7] == f"{math.sqrt(1.2):.3f} (1.00-1.20)"
    assert cells[10] == "2/2"
    assert cells[11] == "1.000"
    # wgrad, graph: the replaced row counts (XLA 1.6, cuBLAS 1.0), not the first file's (0.9)
    cells = table_line(block, "wgrad", "g", "2")
    assert cells[3] == f"{math.sqrt(3.0 * 1.6):.3f} (1.60-3.00)"
    assert cells[5] == "1.600 (1.60-1.60)"
    assert cells[11] == f"{math.sqrt(1.1 * 1.0):.3f}"  # split us / new us
    # eager has its own row; ops without data have none
    assert table_line(block, "fwd", "e", "1")[3] == "1.100 (1.10-1.10)"
    assert "| bwd |" not in block

    # memory-bound rows over the narrow floor only: 40 / 37.5, 48 / 37.5, 80 / 37.5, 120 / 37.5
    assert table_line(block, "fwd", "FP32", "1")[3:] == ["1.07-1.07", "1.28-1.28", "2.13-2.13"]
    assert table_line(block, "wgrad", "FP32", "1")[3:] == ["1.07-1.07", "1.28-1.28", "3.20-3.20"]
    # router and batched rows, ratios recomputed from the times
    assert table_line(block, "4096 -> 256", "16384", "fwd")[3:6] == ["151.6", "412.8", "2.724"]
    batched = table_line(block, "16", "128 -> 512", "4096", "fwd", "g")
    assert batched[5:] == ["27.90", "28.00", "31.00", "1.004", "1.111"]


def test_only_the_marker_block_changes(fixtures):
    report.write_report(fixtures["csvs"], fixtures["page"], fixtures["img_dir"])
    text = open(fixtures["page"]).read()
    assert text.startswith(fixtures["before"] + report.BEGIN + "\n")
    assert text.endswith(report.END + fixtures["after"])
    # a second run gives the same page: the block is replaced, not appended to
    report.write_report(fixtures["csvs"], fixtures["page"], fixtures["img_dir"])
    assert open(fixtures["page"]).read() == text
    assert text.count(report.BEGIN) == text.count(report.END) == 1


def test_replace_block_needs_both_markers_in_order():
    assert report.replace_block(f"a{report.BEGIN}old{report.END}b", "new") == f"a{report.BEGIN}\nnew\n{report.END}b"
    for bad in ("no markers", report.BEGIN, f"{report.END} {report.BEGIN}"):
        with pytest.raises(ValueError, match="markers"):
            report.replace_block(bad, "new")


def test_pictures_are_written_and_embedded(fixtures):
    report.write_report(fixtures["csvs"], fixtures["page"], fixtures["img_dir"])
    text = open(fixtures["page"]).read()
    for name in ("speedup_g.png", "speedup_e.png", "memory_floor.png"):
        path = os.path.join(fixtures["img_dir"], name)
        with open(path, "rb") as f:
            data = f.read()
        assert data.startswith(PNG_MAGIC), name
        assert 1000 < len(data) < 60_000, (name, len(data))
        assert f"(img/{name})" in text  # linked relative to the page


def test_cli_writes_the_page(fixtures):
    subprocess.run(
        [sys.executable, "-m", "benchmarks.report", "--csvs=" + ",".join(fixtures["csvs"])]
        + [f"--page={fixtures['page']}", f"--img_dir={fixtures['img_dir']}", "--picture_modes=g"],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    text = open(fixtures["page"]).read()
    assert "| wgrad | g | 2 |" in text
    assert sorted(os.listdir(fixtures["img_dir"])) == ["memory_floor.png", "speedup_g.png"]


def test_default_csvs_exist_and_name_their_families():
    seen = set()
    for path in report.CSVS:
        full = os.path.join(REPO, path)
        assert os.path.isfile(full), path
        seen.add(report.family_of(report.read_rows(full)[0]))
    assert seen == set(report.FAMILIES)


def test_model_steps_keep_the_latest_file_per_gpu(tmp_path):
    columns = ["step", "mode", "XLA ms", "jax_cake ms", "XLA/jax_cake", "loss rel diff"]
    columns += ["XLA temp MiB", "jax_cake temp MiB"]
    step = dict(mode="g", **{"loss rel diff": 0.0, "XLA temp MiB": 112.0, "jax_cake temp MiB": 448.0})
    old = write_csv(
        tmp_path / "m1.csv",
        columns,
        [
            dict(step, step="mlp", **{"XLA ms": 12.9, "jax_cake ms": 14.0}),
            dict(step, step="heads", **{"XLA ms": 1.0, "jax_cake ms": 0.5}),
        ],
    )
    new = write_csv(tmp_path / "m2.csv", columns, [dict(step, step="mlp", **{"XLA ms": 12.9, "jax_cake ms": 12.8})])
    rows, sources = report.load([old, new])
    assert [(r["step"], r["jax_cake ms"]) for r in rows["model"]] == [("mlp", 12.8), ("heads", 0.5)]
    assert table_line("\n".join(report.model_table(rows["model"])), "mlp", "n/a", "n/a")[5] == "1.008"


def test_a_model_step_an_arm_failed_at_says_why(tmp_path):
    columns = ["step", "mode", "XLA ms", "jax_cake ms", "XLA/jax_cake", "loss rel diff"]
    columns += ["XLA temp MiB", "jax_cake temp MiB", "status"]
    row = {"step": "moe", "mode": "g", "jax_cake ms": 12.1, "jax_cake temp MiB": 1971.8}
    ok = {"step": "small", "mode": "g", "XLA ms": 2.0, "jax_cake ms": 1.0, "XLA temp MiB": 896.3, "jax_cake temp MiB": 0.305}
    path = write_csv(tmp_path / "m.csv", columns, [dict(row, status="XLA failed: JaxRuntimeError: OOM."), ok])
    rows, _ = report.load([path])
    text = "\n".join(report.model_table(rows["model"]))
    assert "| n/a / 1972 |" in text and "| 896 / 0.3 |" in text, text
    assert text.splitlines()[-1].startswith("n/a at moe (") and text.endswith("): XLA failed: JaxRuntimeError: OOM."), text


def _grouped_row(d_out, routing, op, mode, jax_cake, xla, dense, cudnn=None):
    row = {"GPU": "H100 80GB HBM3", "SMs": 132, "G": 8, "M": 16384, "d_in -> d_out": f"4096 -> {d_out}"}
    row.update(w="float32", routing=routing, op=op, mode=mode, status="ok")
    row.update({"jax_cake us": jax_cake, "xla us": xla, "dense us": dense, "xla/jax_cake": 99.0})
    if cudnn is not None:
        row["xla_cudnn us"] = cudnn
    return row


def test_grouped_rows_give_the_balanced_table_and_a_line_per_routing(tmp_path):
    """The grouped family's section: graph-mode balanced rows with ratios recomputed from the
    times (the CSV's own ratio columns are ignored), a column only for the baselines the file
    has, and the ranges of every routing."""
    rows = [
        _grouped_row(1024, "balanced", "fwd", "g", 100.0, 400.0, 50.0),
        _grouped_row(1024, "balanced", "bwd", "g", 200.0, 1000.0, 80.0),
        _grouped_row(1024, "balanced", "fwd", "e", 150.0, 300.0, 75.0),  # eager: not shown
        _grouped_row(1024, "skewed", "fwd", "g", 120.0, 360.0, 48.0),
    ]
    path = write_csv(tmp_path / "grouped.csv", list(rows[0]), rows)
    loaded, sources = report.load([path])
    assert sources["grouped"] == [path] and len(loaded["grouped"]) == 4
    block = "\n".join(report.grouped_table(loaded["grouped"]))
    assert block.splitlines()[0] == "| G | M | d_in -> d_out | op | jax_cake us | xla/jax_cake | dense/jax_cake |"
    assert table_line(block, "8", "16384", "4096 -> 1024", "fwd")[4:] == ["100.0", "4.000", "0.500"]
    assert table_line(block, "8", "16384", "4096 -> 1024", "bwd")[4:] == ["200.0", "5.000", "0.400"]
    assert block.count("| 8 |") == 2  # neither the eager nor the skewed row
    assert "Balanced routing: xla/jax_cake 4.0-5.0, dense/jax_cake 0.40-0.50." in block
    assert "Skewed routing: xla/jax_cake 3.0-3.0, dense/jax_cake 0.40-0.40." in block
    with_cudnn = [_grouped_row(1024, "balanced", "fwd", "g", 100.0, 400.0, 50.0, cudnn=390.0)]
    path = write_csv(tmp_path / "cudnn.csv", list(with_cudnn[0]), with_cudnn)
    block = "\n".join(report.grouped_table(report.load([path])[0]["grouped"]))
    assert table_line(block, "8", "16384", "4096 -> 1024", "fwd")[4:] == ["100.0", "4.000", "3.900", "0.500"]


def test_a_grouped_file_without_xla_still_gives_its_routing_lines(tmp_path):
    """A run of jax_cake, kernels and dense alone (bf16 weights: the row layout's own share)
    keeps a line per routing, with the baselines it has."""
    rows = [
        dict(_grouped_row(1024, routing, "fwd", "g", 100.0, "", dense), w="bfloat16", **{"kernels us": kernels})
        for routing, dense, kernels in (("balanced", 80.0, 90.0), ("skewed", 70.0, 85.0))
    ]
    path = write_csv(tmp_path / "bf16.csv", list(rows[0]), rows)
    block = "\n".join(report.grouped_table(report.load([path])[0]["grouped"]))
    assert "Balanced routing: dense/jax_cake 0.80-0.80, kernels/jax_cake 0.90-0.90." in block
    assert "Skewed routing: dense/jax_cake 0.70-0.70, kernels/jax_cake 0.85-0.85." in block


def test_a_failed_grouped_arm_is_a_line_under_the_table(tmp_path):
    failed = "xla: failed to compile or run (JaxRuntimeError: NOT_FOUND: no config)"
    rows = [
        dict(_grouped_row(768, "balanced", op, "g", 100.0, "", 50.0), status=failed) for op in ("fwd", "bwd")
    ] + [_grouped_row(1024, "balanced", "fwd", "g", 100.0, 400.0, 50.0)]
    path = write_csv(tmp_path / "grouped.csv", list(rows[0]), rows)
    block = "\n".join(report.grouped_table(report.load([path])[0]["grouped"]))
    assert table_line(block, "8", "16384", "4096 -> 768", "fwd")[4:] == ["100.0", "n/a", "0.500"]
    assert f"n/a at G 8 4096 -> 768: {failed}." in block.splitlines()  # once for both ops
    assert block.count("n/a at") == 1


def test_the_shipped_csvs_render_every_section(tmp_path):
    """The page's CSVs (benchmarks/data/) give every section, each naming its GPU, jax and
    date; the GEMM core names the program the shipped plan table runs (its tile rows came
    from these CSVs: "(row)")."""
    page = tmp_path / "page.md"
    page.write_text(report.BEGIN + "\n" + report.END + "\n")
    csvs = [os.path.join(REPO, p) for p in report.CSVS]
    report.write_report(csvs, str(page), str(tmp_path / "img"), picture_modes=())
    text = page.read_text()
    headings = ("Dense projection", "Memory-bound points", "FP32 router", "Batched projection", "GEMM core")
    headings += ("Grouped projections (MoE experts)", "Model steps")
    for heading in headings:
        assert f"### {heading}" in text or f"### The {heading}" in text, heading
    assert "H200, jax 0.11.2, 2026-11-30" in text and "H100 80GB HBM3, jax 0.11.2, 2026-12-05" in text
    assert "(row)" in text and "jax_cake at or above XLA's speed at" in text


def test_the_page_has_the_generated_block():
    text = open(os.path.join(REPO, "docs", "benchmarks.md")).read()
    assert text.count(report.BEGIN) == text.count(report.END) == 1
