"""The generated tables and pictures of docs/benchmarks.md, from the CSVs in benchmarks/data/.

    python -m benchmarks.report          # the CSVs of SOURCES, into docs/benchmarks.md and docs/img/
    python -m benchmarks.report --csvs=a.csv,b.csv.gz --page=/tmp/page.md --img_dir=/tmp/img

Reads CSVs written by `python -m benchmarks.bench --csv=...` (`--merge=... --csv=...` too;
`.csv.gz` is read) of the dense, router, batched, core, grouped and model families, and of
`python -m benchmarks.memory_floor --csv=...`. Each file's family comes from its header
(FAMILIES). Rows of one family are merged in file order as `bench --merge` does: a later
file's row replaces an earlier one of the same point, op and mode (model: of the same step
on the same GPU). Every table names its files and the GPU, jax version and date they were
measured on: from SOURCES for the shipped files (their rows carry no jax version or date),
else from the CSV's own gpu / jax / date columns where it has them.

Writes, and changes nothing else:
- the markdown between BEGIN and END in --page (the markers must be there): the dense
  headline table (geomeans of baseline us / jax_cake us per op and mode, all points and
  split by d_out), the memory-bound rows against the copy floor, the router and batched
  rows, the GEMM core at the Llama shapes (per shape, XLA's time over the time of the
  program the shipped plan table runs there, from benchmarks.tune_tiles' reading of the
  core CSVs: no GPU needed), the grouped projections against XLA's ragged dot and the dense
  anchor, and the model steps;
- PNG pictures in --img_dir (matplotlib, Agg; saved as 32-colour palette PNGs with Pillow):
  speedup_<mode>.png per mode of --picture_modes (default g and e: every grid point and op
  against XLA and cuBLAS) and memory_floor.png (the d_out <= 64 points' fwd and wgrad against
  the floor), embedded by the markdown above.
Ratios are baseline us / jax_cake us: above 1, jax_cake is faster.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Iterable, Mapping, Sequence

from absl import app, flags

from benchmarks import harness, plan_rule, tune_tiles
from benchmarks import markdown as md
from benchmarks.families import dense as dense_family
from benchmarks.families import projections

_DOCS = os.path.join(harness.REPO_ROOT, "docs")
DATA = os.path.join(harness.REPO_ROOT, "benchmarks", "data")


@dataclasses.dataclass(frozen=True)
class Source:
    """A shipped CSV and where it was measured (its rows carry no jax version or date)."""

    file: str  # under benchmarks/data/
    gpu: str
    date: str
    jax: str = "0.11.2"


_H200, _H100 = "H200", "H100 80GB HBM3"
# The CSVs the page comes from, in merge order (all: driver 580.159.04).
SOURCES = (
    Source("dense_2026-11-30_h200_g.csv.gz", _H200, "2026-11-30"),
    Source("dense_2026-11-30_h200_e.csv.gz", _H200, "2026-11-30"),
    Source("memory_floor_2026-12-01_h200.csv", _H200, "2026-12-01"),
    Source("router_2026-11-29_h200.csv", _H200, "2026-11-29"),
    Source("batched_2026-11-30_h200.csv", _H200, "2026-11-30"),
    Source("core_2026-12-05_h200_t8192.csv", _H200, "2026-12-05"),
    Source("core_2026-12-05_h200_t4096.csv", _H200, "2026-12-05"),
    Source("core_2026-12-05_h100_t8192.csv", _H100, "2026-12-05"),
    Source("core_2026-12-05_h100_t4096.csv", _H100, "2026-12-05"),
    Source("model_2026-12-01_h200.csv", _H200, "2026-12-01"),
    Source("model_2026-12-04_h200.csv", _H200, "2026-12-04"),
    Source("model_2026-12-05_h100.csv", _H100, "2026-12-05"),
    Source("grouped_2026-12-07_h100.csv", _H100, "2026-12-07"),
    Source("model_2026-12-07_h100.csv", _H100, "2026-12-07"),
    Source("model_2026-12-07_h200.csv", _H200, "2026-12-07"),
    Source("model_2026-12-07_h100_moe.csv", _H100, "2026-12-07"),
)
CSVS = tuple(os.path.join("benchmarks", "data", s.file) for s in SOURCES)
BEGIN = "<!-- report:begin -->"
END = "<!-- report:end -->"
MEMORY_BOUND_MAX_D_OUT = 64
COMPUTE_BOUND_MIN_D_OUT = 512
FLOOR_D_OUT = 48  # the memory_floor cases of the skinny rows: read [T, d_in], write [T, 48]
FAMILIES = ("dense", "router", "batched", "floor", "core", "grouped", "model")

FLAGS = flags.FLAGS


# --- reading -------------------------------------------------------------------------------


def read_rows(path: str) -> list[dict]:
    """A CSV's rows, numbers parsed back; `.gz` files are decompressed."""
    return harness.read_csv_rows([path])


def family_of(columns: Iterable[str]) -> str:
    columns = set(columns)
    if "xla_over_arm" in columns:
        return "core"
    if "routing" in columns:
        return "grouped"
    if "XLA/jax_cake" in columns:
        return "model"
    if "floor us" in columns:
        return "floor"
    if "d -> E" in columns:
        return "router"
    if "B" in columns:
        return "batched"
    if "d_in -> d_out" in columns:
        return "dense"
    raise ValueError(f"not a benchmark or memory_floor CSV: columns {sorted(columns)}")


def load(paths: Sequence[str]) -> tuple[dict[str, list[dict]], dict[str, list[str]]]:
    """({family: merged rows}, {family: the files they came from}); core files stay apart
    (one setup each: rows["core"] holds each file's rows, tagged with its path)."""
    rows: dict[str, list[dict]] = {f: [] for f in FAMILIES}
    sources: dict[str, list[str]] = {f: [] for f in FAMILIES}
    for path in paths:
        file_rows = read_rows(path)
        if not file_rows:
            continue
        family = family_of(file_rows[0])
        gpu = setup_of(path, file_rows)[0]
        rows[family] += [dict(r, _file=path, _gpu=gpu) for r in file_rows]
        sources[family].append(path)
    for family, table in (("dense", dense_family.TABLE), ("router", _router_table()), ("batched", _batched_table())):
        rows[family] = projections.merge_rows(table, rows[family])
    merged: dict[tuple, dict] = {}
    for r in rows["model"]:  # a later file's step replaces an earlier one's on the same GPU
        merged[(r["_gpu"], r["step"])] = r
    rows["model"] = list(merged.values())
    return rows, sources


def _router_table():
    from benchmarks.families import router

    return router.TABLE


def _batched_table():
    from benchmarks.families import batched

    return batched.TABLE


def setup_of(path: str, rows: Sequence[Mapping] = ()) -> tuple[str, str, str]:
    """(GPU, jax version, date) a CSV was measured with: SOURCES' entry for a shipped file,
    else its rows' gpu / jax / date columns ("n/a" where it has none)."""
    for s in SOURCES:
        if os.path.basename(path) == s.file:
            return s.gpu, s.jax, s.date
    first = rows[0] if rows else {}
    gpu = first.get("gpu") or first.get("GPU") or "n/a"
    return str(gpu), str(first.get("jax") or "n/a"), str(first.get("date") or "n/a")


def measured(paths: Sequence[str]) -> str:
    """'H200, jax 0.11.2, 2026-11-30, from `a.csv`, `b.csv`' (setups joined where they differ)."""
    setups = list(dict.fromkeys(setup_of(p, read_rows(p)[:1]) for p in paths))
    said = "; ".join(f"{gpu}, jax {jax}, {date}" for gpu, jax, date in setups)
    return f"{said}; from {_names(paths)}"


def d_in_out(row: Mapping, column: str = "d_in -> d_out") -> tuple[int, int]:
    a, b = str(row[column]).split("->")
    return int(a), int(b)


def ratio(row: Mapping, baseline: str, arm: str = "new") -> float | None:
    """baseline us / arm us, recomputed from the times (None where either is missing)."""
    b, a = row.get(f"{baseline} us"), row.get(f"{arm} us")
    return b / a if b and a else None


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


# --- tables --------------------------------------------------------------------------------


def _summary(values: Sequence[float]) -> str:
    if not values:
        return "n/a"
    return f"{geomean(values):.3f} ({min(values):.2f}-{max(values):.2f})"


def _names(paths: Sequence[str]) -> str:
    return ", ".join(f"`{os.path.basename(p)}`" for p in paths)


def dense_table(rows: Sequence[dict]) -> list[str]:
    """Geomeans of XLA/new and cuBLAS/new per op and mode: all points, d_out <= 64, d_out >= 512."""
    columns = ["op", "mode", "points"]
    for baseline in ("XLA", "cuBLAS"):
        columns += [f"{baseline}/new all (range)", "d_out <= 64", "d_out >= 512", ">= 1.00"]
    columns.append("split/new")
    out = []
    modes = [m for m in plan_rule.MODES if any(r["mode"] == m for r in rows)]
    for mode in modes:
        for op in dense_family.OPS:
            picked = [r for r in rows if r["op"] == op and r["mode"] == mode]
            if not picked:
                continue
            cells = [op, mode, str(len(picked))]
            for baseline in ("XLA", "cuBLAS"):
                every = [(d_in_out(r)[1], ratio(r, baseline)) for r in picked]
                every = [(d, v) for d, v in every if v is not None]
                vals = [v for _, v in every]
                cells += [
                    _summary(vals),
                    _summary([v for d, v in every if d <= MEMORY_BOUND_MAX_D_OUT]),
                    _summary([v for d, v in every if d >= COMPUTE_BOUND_MIN_D_OUT]),
                    f"{sum(v >= 1.0 for v in vals)}/{len(vals)}",
                ]
            splits = [v for v in (ratio(r, "split") for r in picked) if v is not None]
            cells.append(f"{geomean(splits):.3f}" if splits else "n/a")
            out.append(cells)
    return md.table(columns, out)


def router_table(rows: Sequence[dict], mode: str = "g") -> list[str]:
    """The rows of one mode, and a line on the other modes' XLA x3/new range."""
    shown = [dict(r, **{"XLA x3/new": ratio(r, "XLA x3")}) for r in rows if r["mode"] == mode]
    out = md.dict_table(["d -> E", "T", "op", "new us", "XLA x3 us", "XLA x3/new", "XLA highest us"], shown)
    for other in [m for m in plan_rule.MODES if m != mode and any(r["mode"] == m for r in rows)]:
        vals = [v for v in (ratio(r, "XLA x3") for r in rows if r["mode"] == other) if v is not None]
        label = {"g": "CUDA graphs", "e": "eager"}[other]
        out += ["", f"Mode {other} ({label}): XLA x3/new {min(vals):.3f}-{max(vals):.3f} over the same rows."]
    return out


def batched_table(rows: Sequence[dict]) -> list[str]:
    shown = [dict(r, **{"XLA/new": ratio(r, "XLA"), "cuBLAS/new": ratio(r, "cuBLAS")}) for r in rows]
    return md.dict_table(
        ["B", "d_in -> d_out", "T", "op", "mode", "new us", "XLA us", "cuBLAS us", "XLA/new", "cuBLAS/new"], shown
    )


def floors(floor_rows: Sequence[dict]) -> dict[tuple[int, int], float]:
    """{(T, d_in): floor us} of the narrow (read x, write 48 columns) memory_floor cases."""
    out = {}
    for r in floor_rows:
        a, b = d_in_out(r, "a -> b (bf16)")
        if b == FLOOR_D_OUT and a > b:
            out[(int(r["rows"]), a)] = float(r["floor us"])
    return out


def floor_points(dense: Sequence[dict], floor_us: Mapping[tuple[int, int], float], mode: str = "g") -> list[dict]:
    """The d_out <= 64 fwd and wgrad rows of `mode` that have a floor: the row plus 'floor us'."""
    out = []
    for r in dense:
        d_in, d_out = d_in_out(r)
        key = (int(r["T"]), d_in)
        if r["mode"] == mode and r["op"] in ("fwd", "wgrad") and d_out <= MEMORY_BOUND_MAX_D_OUT and key in floor_us:
            out.append(dict(r, **{"floor us": floor_us[key]}))
    return out


def floor_table(points: Sequence[dict]) -> list[str]:
    """Per op and out dtype: jax_cake / cuBLAS / XLA time over the floor, range over the points."""
    out = []
    for op in ("fwd", "wgrad"):
        for dtype in ("FP32", "BF16"):
            picked = [p for p in points if p["op"] == op and p["out"] == dtype]
            if not picked:
                continue
            cells = [op, dtype, str(len(picked))]
            for arm in ("new", "cuBLAS", "XLA"):
                vals = [p[f"{arm} us"] / p["floor us"] for p in picked if p.get(f"{arm} us")]
                cells.append(f"{min(vals):.2f}-{max(vals):.2f}" if vals else "n/a")
            out.append(cells)
    return md.table(["op", "out", "points", "new / floor", "cuBLAS / floor", "XLA / floor"], out)


def _program(arm: tune_tiles.Arm | None, cluster: bool = True) -> str:
    if arm is None:
        return "-"
    sched = "pp" if arm.schedule == "pingpong" else "coop"
    return f"{arm.tile[0]}x{arm.tile[1]} {sched}" + (f" c{arm.cluster[0]}x{arm.cluster[1]}" if cluster else "")


def core_verdicts(path: str) -> tuple[dict, list, dict]:
    """(header, verdicts, XLA's arms) of one core CSV against the shipped plan table:
    tune_tiles' reading, planned for the CSV's GPU and SM count on this machine."""
    import json
    from pathlib import Path

    from jax_cake.planner import device as device_lib
    from jax_cake.planner import tables

    points, xla, header = tune_tiles.read_csvs([path])
    gpu = setup_of(path)[0] if os.path.basename(path) in {s.file for s in SOURCES} else header.get("gpu", "H200")
    device = device_lib.DeviceInfo("cuda", f"NVIDIA {gpu}", "sm_90a", int(header.get("sms") or 132))
    data = json.loads(Path(tables.TABLE_DIR / "sm_90a.json").read_text())
    rule = tables.parse(tune_tiles.without_tile_rows(data))
    verdicts = [
        tune_tiles.decide(p, arms, tune_tiles.rule_pick(p, device, rule), 0.005)
        for p, arms in sorted(points.items(), key=lambda kv: dataclasses.astuple(kv[0]))
    ]
    return header, verdicts, xla


def core_table(path: str) -> list[str]:
    """Per shape, fwd and dgrad: XLA's time, the program the plan table runs (a tile row's
    winner, else the rule's pick) with its time, and XLA us / its us. A T column and the
    programs' clusters only where they differ within the file (else the closing line says)."""
    _, verdicts, xla = core_verdicts(path)
    shown = [(v, v.winner or v.pick, xla.get(v.point)) for v in verdicts]
    shown = [(v, run, x) for v, run, x in shown if run is not None and x is not None]
    tokens = sorted({v.point.tokens for v, _, _ in shown})
    clusters = sorted({run.cluster for _, run, _ in shown})
    by_shape: dict[tuple, dict] = {}
    for v, run, x in shown:
        by_shape.setdefault((v.point.tokens, v.point.d_in, v.point.d_out), {})[v.point.op] = (v, run, x)
    cols = (["T"] if len(tokens) > 1 else []) + ["d_in -> d_out"]
    for op in tune_tiles.TILE_OPS:
        cols += [f"XLA {op} us", f"jax_cake {op}, us", "XLA/jax_cake"]
    out, wins = [], 0
    for (t, d_in, d_out), ops in sorted(by_shape.items()):
        cells = ([str(t)] if len(tokens) > 1 else []) + [f"{d_in} -> {d_out}"]
        for op in tune_tiles.TILE_OPS:
            if op not in ops:
                cells += ["", "", ""]
                continue
            v, run, x = ops[op]
            wins += x.us >= run.us
            program = _program(run, len(clusters) > 1) + (" (row)" if v.winner else "")
            cells += [f"{x.us:.0f}", f"{program} {run.us:.0f}", f"{x.us / run.us:.3f}"]
        out.append(cells)
    said = (f"T {tokens[0]}; " if len(tokens) == 1 else "") + (
        f"every program in clusters of {clusters[0][0]}x{clusters[0][1]}; " if len(clusters) == 1 else ""
    )
    return md.table(cols, out) + ["", f"{said}jax_cake at or above XLA's speed at {wins} of {len(shown)} GEMMs."]


# dense_tile (a dense GEMM on 128 x 128 tiles) is the bench's, not the page's: the grouped
# fwd and dgrad run 128 x 256.
GROUPED_BASELINES = ("xla", "xla_cudnn", "dense", "kernels")


def grouped_table(rows: Sequence[dict]) -> list[str]:
    """The balanced-routing graph-mode rows of one file: jax_cake's time and each baseline's
    time over it (the baselines the file has); then a line per routing on the
    ranges against each of xla, dense and kernels the file has."""
    rows = [dict(r, **{f"{b}/jax_cake": ratio(r, b, "jax_cake") for b in GROUPED_BASELINES}) for r in rows]
    rows = [r for r in rows if r["mode"] == "g"]
    ratios = [f"{b}/jax_cake" for b in GROUPED_BASELINES if any(r[f"{b}/jax_cake"] for r in rows)]
    columns = ["G", "M", "d_in -> d_out", "op", "jax_cake us", *ratios]
    out = md.dict_table(columns, [r for r in rows if r["routing"] == "balanced"])
    out.append("")
    for routing in dict.fromkeys(r["routing"] for r in rows):
        picked = [r for r in rows if r["routing"] == routing]
        spans = []
        for baseline, digits in (("xla", 1), ("dense", 2), ("kernels", 2)):
            got = [r[f"{baseline}/jax_cake"] for r in picked if r[f"{baseline}/jax_cake"]]
            if got:
                spans.append(f"{baseline}/jax_cake {min(got):.{digits}f}-{max(got):.{digits}f}")
        if spans:
            out.append(f"{routing.capitalize()} routing: {', '.join(spans)}.")
    failed: dict = {}  # an arm's failure (the status column) -> the shapes it failed at
    for r in rows:
        if r.get("status") not in (None, "", "ok"):
            failed.setdefault(r["status"], []).append(f"G {r['G']} {r['d_in -> d_out']}")
    for status, shapes in failed.items():
        out.append(f"n/a at {', '.join(dict.fromkeys(shapes))}: {status.removesuffix('.')}.")
    return out


MODEL_COLUMNS = ("step", "GPU", "date", "XLA ms", "jax_cake ms", "XLA/jax_cake", "temp MiB XLA / jax_cake")


def _mib_cell(v) -> str:
    """MiB to the MiB, or to 0.1 below 10 (a temp of 0.3 MiB is not 0)."""
    if v is None:
        return "n/a"
    return f"{v:.0f}" if v >= 10 else f"{v:.1f}"


def model_table(rows: Sequence[dict]) -> list[str]:
    """The model steps' table, then one line per step an arm failed at (its status)."""
    shown, failed = [], []
    for r in rows:
        _, _, date = setup_of(r["_file"])
        temps = (r.get("XLA temp MiB"), r.get("jax_cake temp MiB"))
        temp = "" if temps == (None, None) else " / ".join(_mib_cell(v) for v in temps)
        speedup = r["XLA ms"] / r["jax_cake ms"] if r.get("XLA ms") and r.get("jax_cake ms") else None
        shown.append(dict(r, GPU=r["_gpu"], date=date, **{"XLA/jax_cake": speedup, "temp MiB XLA / jax_cake": temp}))
        if r.get("status") not in (None, "", "ok"):
            failed.append(f"n/a at {r['step']} ({r['_gpu']}): {r['status'].removesuffix('.')}.")
    return md.dict_table(MODEL_COLUMNS, shown) + ([""] + failed if failed else [])


# --- pictures ------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str, dpi: int) -> None:
    """Saves a figure as a palette PNG (32 colours): the pictures stay small enough to commit."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    Image.open(buf).convert("RGB").quantize(colors=32).save(path, optimize=True)


def _point_key(r: Mapping) -> tuple:
    d_in, d_out = d_in_out(r)
    return (d_in, d_out, r["out"])


def speedup_picture(rows: Sequence[dict], mode: str, path: str, dpi: int, annotate: bool = False) -> None:
    """Heatmaps of XLA/new and cuBLAS/new: a row per (d_in -> d_out, out), a column per (op, T);
    `annotate` writes each cell's ratio into it (about 3x the file size)."""
    plt = _pyplot()
    from matplotlib.colors import TwoSlopeNorm

    picked = [r for r in rows if r["mode"] == mode]
    shapes = sorted({_point_key(r) for r in picked}, key=lambda k: (k[0], k[1], k[2] != "FP32"))
    ops = [op for op in dense_family.OPS if any(r["op"] == op for r in picked)]
    tokens = sorted({int(r["T"]) for r in picked})
    columns = [(op, t) for op in ops for t in tokens]
    by_key = {(_point_key(r), r["op"], int(r["T"])): r for r in picked}
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.17 * len(shapes) + 1.3), layout="constrained")
    norm = TwoSlopeNorm(vmin=0.85, vcenter=1.0, vmax=1.5)
    for ax, baseline in zip(axes, ("XLA", "cuBLAS")):
        grid = [
            [ratio(by_key[(s, op, t)], baseline) if (s, op, t) in by_key else float("nan") for op, t in columns]
            for s in shapes
        ]
        grid = [[v if v is not None else float("nan") for v in row] for row in grid]
        image = ax.imshow(grid, cmap="RdBu", norm=norm, aspect="auto", interpolation="nearest")
        if annotate:
            for i, row in enumerate(grid):
                for j, v in enumerate(row):
                    if v == v:  # not NaN
                        dark = v > 1.3 or v < 0.9
                        color = "white" if dark else "black"
                        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=4.5, color=color)
        ax.set_xticks(range(len(columns)))
        ax.set_xticklabels([f"{op} {t}" for op, t in columns], rotation=90, fontsize=5)
        ax.set_yticks(range(len(shapes)))
        ax.set_yticklabels([f"{a}->{b} {o}" for a, b, o in shapes], fontsize=5)
        for k in range(1, len(ops)):
            ax.axvline(k * len(tokens) - 0.5, color="black", linewidth=0.6)
        ax.set_title(f"{baseline} us / jax_cake us, mode {mode} (above 1: jax_cake faster)", fontsize=7)
    fig.colorbar(image, ax=list(axes), shrink=0.6, pad=0.01, extend="both").ax.tick_params(labelsize=5)
    _save(fig, path, dpi)
    plt.close(fig)


def floor_picture(points: Sequence[dict], path: str, dpi: int) -> None:
    """Time over the memory floor for each d_out <= 64 point: jax_cake, cuBLAS, XLA; fwd and wgrad."""
    plt = _pyplot()
    from matplotlib.ticker import ScalarFormatter

    ops = [op for op in ("fwd", "wgrad") if any(p["op"] == op for p in points)]
    fig, axes = plt.subplots(1, len(ops), figsize=(5.5 * len(ops), 3.2), squeeze=False, layout="constrained")
    for ax, op in zip(axes[0], ops):
        picked = sorted(
            (p for p in points if p["op"] == op), key=lambda p: (*_point_key(p)[:2], p["out"], int(p["T"]))
        )
        xs = range(len(picked))
        for arm, marker in (("new", "o"), ("cuBLAS", "s"), ("XLA", "^")):
            ys = [p[f"{arm} us"] / p["floor us"] if p.get(f"{arm} us") else float("nan") for p in picked]
            ax.plot(xs, ys, marker, markersize=3, label="jax_cake" if arm == "new" else arm)
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.axhline(1.10, color="gray", linewidth=0.6, linestyle="--")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())
        ax.set_xticks(list(xs))
        ax.set_xticklabels(
            [f"{d_in_out(p)[0]}->{d_in_out(p)[1]} {p['out']} {p['T']}" for p in picked], rotation=90, fontsize=4.5
        )
        ax.tick_params(axis="y", labelsize=6)
        ax.set_title(f"{op}: time / memory floor (dashed: 1.10)", fontsize=7)
        ax.legend(fontsize=5)
    _save(fig, path, dpi)
    plt.close(fig)


# --- the page -----------------------------------------------------------------------------


def replace_block(text: str, block: str) -> str:
    """`text` with everything between BEGIN and END replaced by `block` (markers kept)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < 0 or end < start:
        raise ValueError(f"the page needs the markers {BEGIN} and {END}, in that order")
    return text[: start + len(BEGIN)] + "\n" + block.rstrip("\n") + "\n" + text[end:]


def render(
    csvs: Sequence[str], page: str, img_dir: str, dpi: int = 80, picture_modes: Sequence[str] = ("g", "e")
) -> str:
    """Writes the pictures and returns the markdown block for `page` (image links relative to it)."""
    rows, sources = load(csvs)
    os.makedirs(img_dir, exist_ok=True)
    rel = lambda p: os.path.relpath(p, os.path.dirname(os.path.abspath(page)))
    out = ["<!-- generated by `python -m benchmarks.report`; edit the CSVs or the tool, not this block -->", ""]
    dense = rows["dense"]
    if dense:
        out += [
            "### Dense projection",
            "",
            f"{measured(sources['dense'])}. Geomeans over the points (range); `>= 1.00`: points where jax_cake "
            "is as fast or faster; split/new: the split-K program against the planner's pick.",
            "",
            *dense_table(dense),
            "",
        ]
        for mode in [m for m in picture_modes if any(r["mode"] == m for r in dense)]:
            name = os.path.join(img_dir, f"speedup_{mode}.png")
            speedup_picture(dense, mode, name, dpi)
            label = {"g": "CUDA graphs", "e": "eager"}[mode]
            out += [f"![speedup against XLA and cuBLAS, every grid point, {label}]({rel(name)})", ""]
        if any(m in picture_modes for m in plan_rule.MODES):
            out += [
                "Per point (row) and op and T (column): blue, jax_cake faster; red, slower (clipped to 0.85-1.5).",
                "",
            ]
    points = floor_points(dense, floors(rows["floor"])) if rows["floor"] else []
    if points:
        name = os.path.join(img_dir, "memory_floor.png")
        floor_picture(points, name, dpi)
        out += [
            "### Memory-bound points",
            "",
            f"d_out <= {MEMORY_BOUND_MAX_D_OUT}, graph mode: time over the copy floor of reading x [T, d_in] and "
            f"writing [T, {FLOOR_D_OUT}] under the same flush (plain copy kernels; {measured(sources['floor'])}).",
            "",
            *floor_table(points),
            "",
            f"![time over the memory floor, d_out <= {MEMORY_BOUND_MAX_D_OUT}]({rel(name)})",
            "",
        ]
    if rows["router"]:
        out += ["### FP32 router (BF16x3)", "", f"{measured(sources['router'])}; mode g:", ""]
        out += [*router_table(rows["router"]), ""]
    if rows["batched"]:
        out += ["### Batched projection", "", f"{measured(sources['batched'])}:", ""]
        out += [*batched_table(rows["batched"]), ""]
    if sources["core"]:
        out += [
            "### The GEMM core at the Llama shapes",
            "",
            "`--family=core`: per shape, XLA's time and the program the shipped plan table runs (\"(row)\": a "
            "tile row's variant, else the rule's pick).",
            "",
        ]
        for path in sources["core"]:
            out += [f"{measured([path])}:", "", *core_table(path), ""]
    if rows["grouped"]:
        out += [
            "### Grouped projections (MoE experts)",
            "",
            "`--family=grouped`, graph mode, w FP32 masters or bf16 (no cast: the row layout's own share): "
            "`jax_cake` (grouped_projection) against `xla` "
            "(`lax.ragged_dot`), `dense` (one GEMM of the same FLOPs) and `kernels` (the grouped kernels "
            "alone: operands laid out and cast before timing).",
            "",
        ]
        for path in sources["grouped"]:
            picked = [r for r in rows["grouped"] if r["_file"] == path]
            dtypes = ", ".join(dict.fromkeys(str(r["w"]) for r in picked))
            out += [f"{measured([path])}; w {dtypes}:", "", *grouped_table(picked), ""]
    if rows["model"]:
        out += [
            "### Model steps",
            "",
            "`--family=model`: value_and_grad and Adam over FP32 masters, graph mode; the cold row is host wall "
            f"time from a process's spawn to its first step's result. From {_names(sources['model'])}:",
            "",
            *model_table(rows["model"]),
            "",
        ]
    return "\n".join(out)


def write_report(
    csvs: Sequence[str], page: str, img_dir: str, dpi: int = 80, picture_modes: Sequence[str] = ("g", "e")
) -> None:
    with open(page) as f:
        text = f.read()
    new = replace_block(text, render(csvs, page, img_dir, dpi, picture_modes))
    with open(page, "w") as f:
        f.write(new)


def main(argv):
    del argv
    csvs = [p if os.path.isabs(p) else os.path.join(harness.REPO_ROOT, p) for p in FLAGS.csvs]
    write_report(csvs, FLAGS.page, FLAGS.img_dir, FLAGS.dpi, FLAGS.picture_modes)
    print(f"wrote {FLAGS.page} and {FLAGS.img_dir}")


if __name__ == "__main__":
    flags.DEFINE_list("csvs", list(CSVS), "benchmark / memory_floor CSVs (.csv or .csv.gz), merged in this order.")
    flags.DEFINE_string("page", os.path.join(_DOCS, "benchmarks.md"), "The page whose marker block is replaced.")
    flags.DEFINE_string("img_dir", os.path.join(_DOCS, "img"), "Where the PNG pictures go.")
    flags.DEFINE_integer("dpi", 80, "Picture resolution.")
    flags.DEFINE_list("picture_modes", ["g", "e"], "Dense modes that get a speedup picture (g, e).")
    app.run(main)
