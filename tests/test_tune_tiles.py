"""benchmarks.tune_tiles on CPU: the core family's CSVs -> per-shape tile verdicts -> plan-table rows."""

import csv
import json
import subprocess
import sys

import pytest

from jax_cake.planner import tables
from benchmarks import tune_tiles
from benchmarks.families import core as core_bench
from helpers import H200, REPO

# The rule's picks on an H200 (132 SMs) at T 8192: fwd 4096 -> 6144 plans 128 x 160
# ping-pong, 4096 -> 4096 the cooperative 128 x 256 (both in CTA pairs).
PICK_6144 = ("128x160x64", "2x1", "pingpong")
HEADER = {"gpu": "H200", "sms": 132, "jax": "0.11.2", "date": "2026-12-05"}


def arm_row(op, d_out, tile, cluster, schedule, groups, *, d_in=4096, ok=True, raster=""):
    return {
        "op": op,
        "T": 8192,
        "d_in": d_in,
        "d_out": d_out,
        "arm": f"{tile}_{schedule}" if tile else "xla",
        "tile": tile,
        "cluster": cluster,
        "schedule": schedule,
        "raster": raster,
        "us": sorted(groups)[len(groups) // 2],
        "tflops": 0,
        "xla_over_arm": 1,
        "max_err_rel": 0,
        "ok": ok,
        "groups_us": " ".join(f"{g:.2f}" for g in groups),
        **HEADER,
    }


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(core_bench.COLUMNS))
        w.writeheader()
        w.writerows(rows)
    return str(path)


def base_groups(us=500.0, n=6):
    return [us * (1 + 0.001 * g) for g in range(n)]


def scaled(groups, ratio):
    return [g * ratio for g in groups]


def point_6144(tmp_path, *, n=6, cand_ratio=0.98, cand_ok=True, flip=()):
    """fwd 4096 -> 6144: the rule's 128 x 160, a 128 x 176 at cand_ratio of its time (groups
    listed in `flip` run slower instead), a slower 128 x 192 and XLA."""
    base = base_groups(n=n)
    cand = [g * (1.01 if i in flip else cand_ratio) for i, g in enumerate(base)]
    rows = [
        arm_row("fwd", 6144, "", "", "xla", scaled(base, 0.97)),
        arm_row("fwd", 6144, *PICK_6144, base),
        arm_row("fwd", 6144, "128x176x64", "2x1", "pingpong", cand, ok=cand_ok),
        arm_row("fwd", 6144, "128x192x64", "2x1", "pingpong", scaled(base, 1.02)),
    ]
    return write_csv(tmp_path / "core_bench.csv", rows)


def table_data():
    return {
        "arch": "sm_90a",
        "source": "test",
        "sm_ranges": [
            {
                "min_sms": 132,
                "max_sms": 132,
                "rows": [
                    {
                        "op": "fwd",
                        "d_in": 4096,
                        "d_out": 192,
                        "out": "bfloat16",
                        "min_tokens": 8192,
                        "max_tokens": 8192,
                        "program": "xla",
                        "ratio": 0.7,
                        "source": "test",
                    },
                ],
            }
        ],
    }


def verdicts(csv_paths, data=None, min_gain=0.005):
    paths = csv_paths if isinstance(csv_paths, list) else [csv_paths]
    points, _, header = tune_tiles.read_csvs(paths)
    data = data or table_data()
    rule_table = tables.parse(tune_tiles.without_tile_rows(data))
    return [
        tune_tiles.decide(p, arms, tune_tiles.rule_pick(p, H200, rule_table), min_gain) for p, arms in points.items()
    ], header


def test_a_variant_faster_in_every_group_gets_a_row(tmp_path):
    (v,), header = verdicts(point_6144(tmp_path))
    assert header == {k: str(val) for k, val in HEADER.items()}
    assert v.pick.tile == (128, 160, 64) and v.winner.tile == (128, 176, 64)
    assert (v.wins, v.groups) == (6, 6)
    row = v.row("src")
    assert row["tile"] == [128, 176, 64] and row["schedule"] == "pingpong" and row["cluster"] == [2, 1]
    assert (row["op"], row["d_in"], row["d_out"], row["min_tokens"], row["max_tokens"]) == (
        "fwd",
        4096,
        6144,
        8192,
        8192,
    )
    assert row["program"] == "det" and row["ratio"] == pytest.approx(1 / 0.98, abs=1e-3)
    assert "6/6" in row["evidence"]


@pytest.mark.parametrize(
    "kwargs, why",
    [
        (dict(flip=(3,)), "no variant beat it"),  # 5 of 6 groups: sign test p = 0.11
        (dict(cand_ratio=0.998), "no variant beat it"),  # under --min_gain
        (dict(cand_ok=False), "no variant beat it"),  # its result missed XLA's
        (dict(n=4), "too few"),  # 4/4 groups: p = 0.0625
    ],
)
def test_no_row_without_a_clear_win(tmp_path, kwargs, why):
    (v,), _ = verdicts(point_6144(tmp_path, **kwargs))
    assert v.winner is None and why in v.why


def test_rule_pick_is_what_plan_runs_without_tile_rows():
    data = table_data()
    data["sm_ranges"][0]["rows"].append(
        {
            "op": "fwd",
            "d_in": 4096,
            "d_out": 6144,
            "out": "bfloat16",
            "min_tokens": 8192,
            "max_tokens": 8192,
            "program": "det",
            "tile": [128, 208, 64],
            "schedule": "pingpong",
            "cluster": [2, 1],
            "source": "old",
        }
    )
    rule_table = tables.parse(tune_tiles.without_tile_rows(data))
    pick = tune_tiles.rule_pick(tune_tiles.Point("fwd", 8192, 4096, 6144), H200, rule_table)
    assert pick == ((128, 160, 64), (2, 1), "pingpong")
    # An xla row sends the point to XLA's dot: nothing to tune there.
    assert tune_tiles.rule_pick(tune_tiles.Point("fwd", 8192, 4096, 192), H200, rule_table) is None


def test_the_pick_must_have_been_timed(tmp_path):
    rows = [arm_row("fwd", 6144, "128x176x64", "2x1", "pingpong", base_groups())]
    (v,), _ = verdicts(write_csv(tmp_path / "c.csv", rows))
    assert v.winner is None and "not timed" in v.why


def test_other_walks_and_ops_are_not_read(tmp_path):
    base = base_groups()
    rows = [
        arm_row("fwd", 6144, *PICK_6144, base),
        arm_row("fwd", 6144, "128x176x64", "2x1", "pingpong", scaled(base, 0.9), raster="m"),
        arm_row("wgrad", 6144, "128x256x64", "1x1", "tiles", scaled(base, 0.9)),
    ]
    (v,), _ = verdicts(write_csv(tmp_path / "c.csv", rows))
    assert v.winner is None


def test_two_setups_in_one_input_fail(tmp_path):
    a = point_6144(tmp_path)
    rows = [arm_row("fwd", 4096, "128x256x64", "2x1", "tiles", base_groups()) | {"jax": "0.12.0"}]
    b = write_csv(tmp_path / "b.csv", rows)
    with pytest.raises(ValueError, match="two setups"):
        tune_tiles.read_csvs([a, b])


def test_runs_pool_their_paired_groups(tmp_path):
    """Two runs of 4 groups each: neither reaches a verdict alone, the 8 pooled groups do."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = point_6144(tmp_path / "a", n=4)
    base = base_groups(510.0, n=4)
    rows = [
        arm_row("fwd", 6144, *PICK_6144, base) | {"date": "2026-12-06"},
        arm_row("fwd", 6144, "128x176x64", "2x1", "pingpong", scaled(base, 0.98)) | {"date": "2026-12-06"},
    ]
    second = write_csv(tmp_path / "b" / "core_bench.csv", rows)  # 128 x 192 not timed in this run
    for alone in (first, second):
        (v,), _ = verdicts(alone)
        assert v.winner is None and "too few" in v.why
    (v,), header = verdicts([first, second])
    assert header["date"] == "2026-12-05, 2026-12-06"
    assert (v.winner.tile, v.wins, v.groups) == ((128, 176, 64), 8, 8)
    points, _, _ = tune_tiles.read_csvs([first, second])
    (arms,) = points.values()
    assert sorted(a.tile[1] for a in arms) == [160, 176]  # 192 was missing from one run


def test_an_arm_off_xla_in_one_run_is_dropped(tmp_path):
    (tmp_path / "a").mkdir()
    first = point_6144(tmp_path / "a")
    second = point_6144(tmp_path, cand_ok=False)
    points, _, _ = tune_tiles.read_csvs([first, second])
    (arms,) = points.values()
    assert 176 not in [a.tile[1] for a in arms]


def test_xla_is_read_beside_the_variants_and_pools_the_same_way(tmp_path):
    (tmp_path / "a").mkdir()
    first, second = point_6144(tmp_path / "a"), point_6144(tmp_path, cand_ratio=0.99)
    points, xla, _ = tune_tiles.read_csvs([first, second])
    assert all(a.schedule != "xla" for arms in points.values() for a in arms)  # never a candidate
    (p,) = points
    x = xla[p]
    assert x.groups_us == pytest.approx(scaled(base_groups(), 0.97) * 2, abs=0.01)  # run after run, like the arms'
    assert len(x.groups_us) == len(points[p][0].groups_us)


def test_report_says_where_xla_still_wins_and_by_how_much(tmp_path):
    path = point_6144(tmp_path)  # XLA at 0.97 of the pick's time, the 128 x 176 winner at 0.98
    (v,), _ = verdicts(path)
    text = tune_tiles.report([v], tune_tiles.read_csvs([path])[1])
    header, _, row = text.splitlines()[:3]
    cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in row.split("|")]))
    # Against the program the table runs after the tune (the winner), not the rule's pick.
    assert cells["XLA / table's program"] == f"{0.97 / 0.98:.3f}"
    assert cells["XLA faster in"] == "6/6"
    assert "XLA us" not in tune_tiles.report([v])  # without XLA's arm, the verdict columns only


def old_tile_row(d_out, tokens, tile):
    return {
        "op": "fwd",
        "d_in": 4096,
        "d_out": d_out,
        "out": "bfloat16",
        "min_tokens": tokens,
        "max_tokens": tokens,
        "program": "det",
        "tile": tile,
        "schedule": "pingpong",
        "cluster": [2, 1],
        "source": "old",
    }


def test_merge_replaces_measured_tile_rows_only(tmp_path):
    data = table_data()
    rows = data["sm_ranges"][0]["rows"]
    rows += [old_tile_row(6144, 8192, [128, 208, 64]), old_tile_row(6144, 16384, [128, 208, 64])]
    (v,), _ = verdicts(point_6144(tmp_path), data)
    merged = tune_tiles.merge_rows(data, 132, [v], "new")["sm_ranges"][0]["rows"]
    assert [(r["program"], r["d_out"], r["min_tokens"], r.get("tile"), r["source"]) for r in merged] == [
        ("xla", 192, 8192, None, "test"),
        ("det", 6144, 16384, [128, 208, 64], "old"),  # another T: not measured, kept
        ("det", 6144, 8192, [128, 176, 64], "new"),
    ]
    # A measured point whose pick stays best loses its old tile row.
    (v,), _ = verdicts(point_6144(tmp_path, cand_ratio=1.0), data)
    merged = tune_tiles.merge_rows(data, 132, [v], "new")["sm_ranges"][0]["rows"]
    assert [r["min_tokens"] for r in merged if r["program"] == "det"] == [16384]


def test_merge_adds_a_range_for_a_new_sm_count(tmp_path):
    (v,), _ = verdicts(point_6144(tmp_path))
    merged = tune_tiles.merge_rows(table_data(), 114, [v], "new")
    assert [(r["min_sms"], len(r["rows"])) for r in merged["sm_ranges"]] == [(114, 1), (132, 1)]


def test_main_writes_the_table(tmp_path):
    path = tmp_path / "sm_90a.json"
    path.write_text(json.dumps(table_data()))
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.tune_tiles",
        f"--csv={point_6144(tmp_path)}",
        f"--table={path}",
        "--write",
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "128x176 ping-pong c2x1" in done.stdout  # the verdict table
    rows = json.loads(path.read_text())["sm_ranges"][0]["rows"]
    assert rows[-1]["tile"] == [128, 176, 64]
    assert rows[-1]["source"] == "benchmarks.tune_tiles from core 2026-12-05 on NVIDIA H200, jax 0.11.2"


def test_plan_runs_the_written_row(tmp_path):
    from jax_cake import planner

    (v,), _ = verdicts(point_6144(tmp_path))
    merged = tune_tiles.merge_rows(table_data(), 132, [v], "src")
    with tables.use_table(tables.parse(merged)):
        p = planner.plan("fwd", tokens=8192, d_in=4096, d_out=6144, device=H200)
        other_t = planner.plan("fwd", tokens=4096, d_in=4096, d_out=6144, device=H200)
    assert (p.tile, p.cluster, p.schedule) == ((128, 176, 64), (2, 1), "pingpong")
    assert "measured this variant fastest" in p.reason and "src" in p.reason
    assert other_t.tile != (128, 176, 64)
