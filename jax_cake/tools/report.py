"""The headline tables and pictures of docs/benchmarks.md, from benchmark CSVs.

    python -m jax_cake.tools.report          # the CSVs of CSVS, into docs/benchmarks.md and docs/img/
    python -m jax_cake.tools.report --csvs=a.csv,b.csv.gz --page=/tmp/page.md --img_dir=/tmp/img

Reads CSVs written by `python -m jax_cake.tools.bench --csv=...` (or `--merge=... --csv=...`;
`.csv.gz` is read too) and the floor table of `python -m jax_cake.tools.memory_floor` saved as
CSV. Each file's family comes from its header: dense (`d_in -> d_out`), router (`d -> E`),
batched (`B`), memory floor (`floor us`). Rows of one family are merged in file order as
`bench --merge` does: a later file's row replaces an earlier one of the same point, op and mode.

Writes, and changes nothing else:
- the markdown between BEGIN and END in --page (the markers must be there): the dense
  headline table (geomeans of baseline us / jax_cake us per op and mode, all points and split
  by d_out), the router and batched rows, the memory-bound rows against the copy floor, each
  naming the CSVs it came from;
- PNG pictures in --img_dir (matplotlib, Agg; saved as 32-colour palette PNGs with Pillow): speedup_<mode>.png per
  mode of --picture_modes (default g and e: every grid point and op against XLA and
  cuBLAS) and memory_floor.png (the d_out <= 64 points' fwd and wgrad against the floor),
  embedded by the markdown above.
Ratios are baseline us / jax_cake us: above 1, jax_cake is faster.
"""

from __future__ import annotations

import csv
import gzip
import math
import os
from typing import Iterable, Mapping, Sequence

from absl import app, flags

from jax_cake.tools import bench, plan_rule
from jax_cake.tools import markdown as md

_DOCS = os.path.join(bench.REPO_ROOT, "docs")

# The CSVs the headline comes from (paths relative to the repository root), in merge order.
CSVS = (
    "docs/data/bench_2026-11-30_h200_dense_grid_g.csv.gz",
    "docs/data/bench_2026-11-30_h200_dense_grid_e.csv.gz",
    "docs/data/bench_2026-11-29_h200_c_router.csv",
    "docs/data/bench_2026-11-30_h200_batched_final.csv",
    "docs/data/memory_floor_2026-12-01_h200.csv",
)
BEGIN = "<!-- report:begin -->"
END = "<!-- report:end -->"
MEMORY_BOUND_MAX_D_OUT = 64
COMPUTE_BOUND_MIN_D_OUT = 512
FLOOR_D_OUT = 48  # the memory_floor cases of the skinny rows: read [T, d_in], write [T, 48]
FAMILIES = ("dense", "router", "batched", "floor")

FLAGS = flags.FLAGS


# --- reading -------------------------------------------------------------------------------


def read_rows(path: str) -> list[dict]:
    """A CSV's rows, numbers parsed back (as bench.read_csv_rows); `.gz` files are decompressed."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        return [{k: bench.parse_csv_value(v) for k, v in r.items()} for r in csv.DictReader(f)]


def family_of(columns: Iterable[str]) -> str:
    columns = set(columns)
    if "floor us" in columns:
        return "floor"
    if "d -> E" in columns:
        return "router"
    if "B" in columns:
        return "batched"
    if "d_in -> d_out" in columns:
        return "dense"
    raise ValueError(f"not a bench or memory_floor CSV: columns {sorted(columns)}")


def load(paths: Sequence[str]) -> tuple[dict[str, list[dict]], dict[str, list[str]]]:
    """({family: merged rows}, {family: the files they came from})."""
    rows: dict[str, list[dict]] = {f: [] for f in FAMILIES}
    sources: dict[str, list[str]] = {f: [] for f in FAMILIES}
    for path in paths:
        file_rows = read_rows(path)
        if not file_rows:
            continue
        family = family_of(file_rows[0])
        rows[family] += file_rows
        sources[family].append(path)
    for family in ("dense", "router", "batched"):
        rows[family] = bench.merge_rows(rows[family], family)
    return rows, sources


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
        for op in bench.OPS:
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


def router_table(rows: Sequence[dict]) -> list[str]:
    shown = [dict(r, **{"XLA x3/new": ratio(r, "XLA x3")}) for r in rows]
    return md.dict_table(["d -> E", "T", "op", "mode", "new us", "XLA x3 us", "XLA x3/new", "XLA highest us"], shown)


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
    ops = [op for op in bench.OPS if any(r["op"] == op for r in picked)]
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
    out = [
        "<!-- generated by `python -m jax_cake.tools.report`; edit the CSVs or the tool, not this block -->",
        "",
    ]
    dense = rows["dense"]
    if dense:
        out += [
            f"**Dense projection**, from {_names(sources['dense'])}. Geomean over the points of baseline us / "
            "jax_cake us (range in parentheses); `>= 1.00`: points where jax_cake is as fast or faster; "
            "split/new: the split-K arm against the planner's pick.",
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
                "Colour: baseline us / jax_cake us per point (row) and op and T (column); blue: jax_cake "
                "faster, red: slower; the scale is clipped to 0.85-1.5 (the values are in the table's CSVs).",
                "",
            ]
    points = floor_points(dense, floors(rows["floor"])) if rows["floor"] else []
    if points:
        name = os.path.join(img_dir, "memory_floor.png")
        floor_picture(points, name, dpi)
        out += [
            f"**Memory-bound points** (d_out <= {MEMORY_BOUND_MAX_D_OUT}, graph mode) against the copy floor "
            f"of reading x [T, d_in] and writing [T, {FLOOR_D_OUT}] under the same L2 flush, from "
            f"{_names(sources['floor'])} and the dense CSVs: time / floor, range over T and d_out.",
            "",
            *floor_table(points),
            "",
            f"![time over the memory floor, d_out <= {MEMORY_BOUND_MAX_D_OUT}]({rel(name)})",
            "",
        ]
    if rows["router"]:
        out += [f"**FP32 router** (BF16x3), from {_names(sources['router'])}:", "", *router_table(rows["router"]), ""]
    if rows["batched"]:
        out += [
            f"**Batched projection**, from {_names(sources['batched'])}:",
            "",
            *batched_table(rows["batched"]),
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
    csvs = [p if os.path.isabs(p) else os.path.join(bench.REPO_ROOT, p) for p in FLAGS.csvs]
    write_report(csvs, FLAGS.page, FLAGS.img_dir, FLAGS.dpi, FLAGS.picture_modes)
    print(f"wrote {FLAGS.page} and {FLAGS.img_dir}")


if __name__ == "__main__":
    flags.DEFINE_list("csvs", list(CSVS), "bench / memory_floor CSVs (.csv or .csv.gz), merged in this order.")
    flags.DEFINE_string("page", os.path.join(_DOCS, "benchmarks.md"), "The page whose marker block is replaced.")
    flags.DEFINE_string("img_dir", os.path.join(_DOCS, "img"), "Where the PNG pictures go.")
    flags.DEFINE_integer("dpi", 80, "Picture resolution.")
    flags.DEFINE_list("picture_modes", ["g", "e"], "Dense modes that get a speedup picture (g, e).")
    app.run(main)
