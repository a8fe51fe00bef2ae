"""benchmarks/grouped_walks on CPU: what it would time (every compiled grouped tile of each
role with each walk, the default plans among them), its value checks and its table. The
timing itself needs the GPU."""

import numpy as np

from benchmarks import grouped_walks
from jax_cake.planner import choose
from jax_cake.planner import grouped as grouped_planner


def test_every_compiled_grouped_tile_and_the_default_plans_are_measured():
    configs = grouped_walks.configurations()
    assert ("fwd", (128, 256, 64), "m4") in configs and ("dgrad", (128, 128, 64), "m") in configs
    assert {r for r, _, _ in grouped_walks.configurations(["fwd"])} == {"fwd"}
    for role in grouped_walks.ROLES:
        op = f"grouped_{role}"
        default = (role, grouped_planner.default_tile(op), choose.grouped_raster(op))
        assert default in configs, default
        tiles = grouped_planner.kernel_tiles(op, "float32" if role == "wgrad" else "bfloat16")
        assert {(t, w) for r, t, w in configs if r == role} == {
            (t, w) for t in tiles for w in grouped_walks.WALKS[role]
        }


def test_value_checks_name_a_walk_that_changes_bits_and_a_tile_far_from_the_default():
    rng = np.random.default_rng(0)
    y = rng.standard_normal((64, 32)).astype(np.float32)
    nudged = y.copy()
    nudged[3, 4] = np.nextafter(nudged[3, 4], np.float32(np.inf))
    results = {
        ("fwd", (128, 128, 64), "m"): y,
        ("fwd", (128, 128, 64), "m8"): y.copy(),
        ("fwd", (128, 256, 64), "m"): y * (1 + 1e-4),  # another tile: close, not bitwise
        ("fwd", (128, 256, 64), "m4"): nudged * (1 + 1e-4),
        ("dgrad", (128, 256, 64), "m"): -y,  # far from the default's
    }
    bad = grouped_walks.check_values(results, {"fwd": y, "dgrad": y})
    assert bad == [
        "fwd 256:m4 differs bitwise from 256:m",
        "dgrad 256:m is 2.0e+00 from the default plan's",
    ]


def test_the_table_has_a_row_per_role_and_tile_and_a_column_per_walk():
    medians = {
        ("fwd", (128, 256, 64), "m"): 3160.4,
        ("fwd", (128, 256, 64), "m4"): 3023.0,
        ("wgrad", (128, 128, 64), "m16"): 4229.2,
    }
    lines = grouped_walks.table("grouped M=16384", medians)
    assert lines[0] == "grouped M=16384, median us:"
    assert lines[2] == "| role | tile | m | m8 | m4 | m16 |"
    assert "| fwd | 128 x 256 | 3160 |  | 3023 |  |" in lines
    assert "| wgrad | 128 x 128 |  |  |  | 4229 |" in lines
