"""jax_cake.tools.profile_launch's parts that need no GPU."""

import pytest

from jax_cake.tools import profile_launch


def test_launch_in_range_warms_up_then_brackets_exactly_one_call():
    log = []

    def call():
        log.append("call")
        return len(log)

    out = profile_launch.launch_in_range(call, 3, lambda: log.append("start"), lambda: log.append("stop"))
    assert log == ["call"] * 3 + ["start", "call", "stop"]
    assert out == 5


def test_launch_in_range_stops_the_profiler_when_the_call_fails():
    log = []

    def boom():
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError, match="kernel failed"):
        profile_launch.launch_in_range(boom, 0, lambda: log.append("start"), lambda: log.append("stop"))
    assert log == ["start", "stop"]


def test_compiled_call_runs_the_arm_and_names_its_targets():
    # On a CPU the det arm plans the XLA path: the call runs and no jax_cake target appears.
    call, targets = profile_launch.compiled_call("fwd:256:128", "det/t128x256x64/tiles/c2", 128)
    assert call()[0].shape == (128, 128)
    assert "jax_cake" not in targets
    with pytest.raises(ValueError, match="--gemms"):
        profile_launch.compiled_call("bwd:1:2", "xla", 128)
