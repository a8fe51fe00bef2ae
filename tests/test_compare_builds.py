"""python -m jax_cake.tools.compare_builds: argument parsing (the timing itself needs a GPU)."""

import pytest

from jax_cake.tools import compare_builds


def test_builds_are_name_path_pairs_with_unique_identifier_names():
    assert compare_builds.parse_builds(["old=/a/lib.so", "new=/b/lib.so"]) == [
        ("old", "/a/lib.so"),
        ("new", "/b/lib.so"),
    ]
    for bad in (["old=/a.so", "old=/b.so"], ["/a.so", "new=/b.so"], ["9x=/a.so", "new=/b.so"], ["only=/a.so"]):
        with pytest.raises(ValueError, match="--build"):
            compare_builds.parse_builds(bad)


def test_points_follow_the_family():
    p = compare_builds.parse_point("16384:4096:256", "router")
    assert (p.tokens, p.d_in, p.d_out, p.out, p.family) == (16384, 4096, 256, "float32", "router")
    p = compare_builds.parse_point("128:4096:128:512", "batched")
    assert (p.batch, p.tokens, p.d_in, p.d_out, p.family) == (128, 4096, 128, 512, "batched")
    p = compare_builds.parse_point("16172:4096:48", "dense", "bfloat16")
    assert (p.tokens, p.d_in, p.d_out, p.out) == (16172, 4096, 48, "bfloat16")
    for bad, family in (("16384:4096", "dense"), ("1:2:3", "batched"), ("0:4096:48", "dense"), ("a:b:c", "router")):
        with pytest.raises(ValueError, match="--points"):
            compare_builds.parse_point(bad, family)
