"""jax_cake.tools.power_state's parts that need no GPU: parsing, the per-launch split, the table."""

import pytest

from jax_cake.tools import power_state


def test_parse_gemm_takes_an_op_two_widths_and_an_optional_w_dtype():
    assert power_state.parse_gemm("dgrad:14336:4096") == ("dgrad", 14336, 4096, "bfloat16")
    assert power_state.parse_gemm("wgrad:4096:14336:float32") == ("wgrad", 4096, 14336, "float32")
    for bad in ("bwd:1:2", "fwd:1", "fwd:a:2", "fwd:0:2", "wgrad:1:2:float16", "fwd:1:2:3:4"):
        with pytest.raises(ValueError, match="--gemms"):
            power_state.parse_gemm(bad)


def test_per_launch_sums_each_launchs_kernels_and_leaves_the_pass_out():
    # two launches of two kernels (1 + 2 us, then 3 + 4 us), a pass kernel after each
    events = [(0, 1000, "a"), (1000, 3000, "b"), (3000, 9000, "loop_xor_fusion_1"),
              (9000, 12000, "a"), (12000, 16000, "b"), (16000, 20000, "loop_xor_fusion_1")]
    assert power_state.per_launch_us(events, {"loop_xor_fusion"}, 2) == [3.0, 7.0]
    with pytest.raises(RuntimeError, match="do not split"):
        power_state.per_launch_us(events, set(), 4)


def test_the_table_gives_xla_over_each_arm_in_each_state():
    results = {("dgrad", 14336, 4096, "bfloat16"): {"xla": {"back to back": 1400.0, "between passes": 980.0},
                                        "det/pp": {"back to back": 1540.0, "between passes": 1065.0}}}
    text = power_state.table(results)
    assert "| dgrad 14336 -> 4096 | det/pp | 1540 | 1065 | 0.909 | 0.920 |" in text
    assert "| dgrad 14336 -> 4096 | xla | 1400 | 980 |  |  |" in text
    wgrad = power_state.table({("wgrad", 4096, 14336, "float32"): {"xla": {"back to back": 1.0, "between passes": 1.0}}})
    assert "| wgrad 4096 -> 14336 (float32 dw) | xla |" in wgrad


def test_measure_compiles_every_arm_and_fails_loudly_without_a_device_timeline():
    # On a CPU the arms compile (the XLA path for det) but the trace has no GPU kernels.
    with pytest.raises(RuntimeError, match="do not split"):
        power_state.measure("dgrad", 256, 128, "bfloat16", ["xla", "det/t128x256x64/tiles/c2"], 128, 2, 1)
