"""jax_cake.tools.step_profile's accounting on synthetic traces (a CPU has no device timeline)."""

import pytest

from jax_cake.tools import step_profile


def test_kernel_times_sum_per_step_and_take_the_median():
    # two launches of one fusion per step (suffixes differ), one GEMM; three steps
    events = []
    t = 0
    for gemm_us in (100, 300, 200):
        for name, us in (("loop_fusion_1", 5), ("jax_cake_fwd_kernel", gemm_us), ("loop_fusion_2", 7)):
            events.append((t, t + us * 1000, name))
            t += us * 1000 + 10
    got = step_profile.kernel_times(events, 3)
    assert got == {"loop_fusion": 12.0, "jax_cake_fwd_kernel": 200.0}


def test_kernel_times_refuses_uneven_steps():
    with pytest.raises(ValueError, match="identical steps"):
        step_profile.kernel_times([(0, 1, "a"), (2, 3, "b"), (4, 5, "c")], 2)


def test_table_ranks_kernels_and_folds_the_rest():
    text = step_profile.table({"xla": {"a": 30.0, "b": 60.0, "c": 10.0}}, top=2)
    lines = text.splitlines()
    assert lines[0] == "**xla**: 0.100 ms of kernel time per step"
    assert lines[4] == "| `b` | 60.0 | 60.0% |" and lines[5] == "| `a` | 30.0 | 30.0% |"
    assert lines[6] == "| (1 others) | 10.0 | 10.0% |"


def test_dsl_kernels_share_one_row():
    name = "kernel_cutlass_kernel_jax_cakekernelsgemm_sm90GemmSm90_object_at__CopyAtom_ThrID10"
    events = [(0, 2000, name), (3000, 4000, name + "x"), (5000, 5500, "loop_fusion_7")]
    got = step_profile.kernel_times(events, 1)
    assert got == {step_profile.DSL_KERNELS: 3.0, "loop_fusion": 0.5}


def test_kernel_timeline_keeps_launch_order_and_takes_the_median():
    dsl = "kernel_cutlass_kernel_jax_cakekernelsgemm_sm90GemmSm90_object_at__CopyAtom_ThrID10"
    events, t = [], 0
    for fwd_us, grad_us in ((100, 250), (300, 210), (200, 230)):
        for name, us in ((dsl, fwd_us), ("loop_select_fusion_1", 5), (dsl + "x", grad_us)):
            events.append((t, t + us * 1000, name))
            t += us * 1000 + 10
    got = step_profile.kernel_timeline(events, 3)
    assert got == [(step_profile.DSL_KERNELS, 200.0), ("loop_select_fusion", 5.0), (step_profile.DSL_KERNELS, 230.0)]
    with pytest.raises(ValueError, match="identical steps"):
        step_profile.kernel_timeline(events[:-1], 3)


def test_timeline_table_lists_long_launches_and_sums_the_short_ones():
    text = step_profile.timeline_table({"jax_cake": [("a", 100.0), ("b", 3.0), ("c", 50.0), ("d", 2.0)]}, 20.0)
    lines = text.splitlines()
    assert lines[0] == "**jax_cake**, launch order:"
    assert lines[4:7] == ["| 0 | `a` | 100.0 |", "| 2 | `c` | 50.0 |", "|  | (2 launches under 20 us) | 5.0 |"]


@pytest.mark.parametrize("switch,value", [("GATE_GRAD_EPILOGUE_ENABLED", True), ("GATE_UP_DGRAD_ENABLED", False)])
def test_a_switch_arm_is_traced_with_the_switch_set_then_restored(monkeypatch, switch, value):
    from jax_cake.planner import gated

    before = getattr(gated, switch)
    assert before is not value
    seen = []
    record = lambda case, arm, steps: seen.append((arm, getattr(gated, switch))) or []
    monkeypatch.setattr(step_profile, "profile_arm", record)
    assert step_profile.profile_with_switch(None, 3, switch, value) == []
    assert seen == [("jax_cake", value)] and getattr(gated, switch) is before


def test_parse_pin_names_one_gemm_and_a_det_arm():
    gemm, arm = step_profile.parse_pin("dgrad:8192:14336:4096=det/t128x192x64/pp/c2")
    assert gemm == ("dgrad", 8192, 14336, 4096)
    assert (arm.tile, arm.schedule, arm.cluster) == ((128, 192, 64), "pingpong", (2, 1))
    gemm, arm = step_profile.parse_pin("fwd:8192:28672:4096=xla")
    assert gemm == ("fwd", 8192, 28672, 4096) and arm.kind == "xla"
    for bad in ("dgrad:8192:14336=det/pp", "dgrad:8192:14336:4096", "dgrad:8192:x:4096=det", "fwd:1:2:3=split/s2", "fwd:1:2:3=xla/path"):
        with pytest.raises(ValueError, match="--pin"):
            step_profile.parse_pin(bad)


def test_a_pinned_arm_is_traced_under_a_force_that_names_its_gemm(monkeypatch):
    from jax_cake.planner import overrides

    seen = []

    def fake_profile(case, arm, steps):
        seen.append((arm, overrides.forced("tile"), overrides.forced("schedule"), overrides.applies("dgrad", 8192, 14336, 4096), overrides.applies("fwd", 8192, 4096, 14336)))
        return []

    monkeypatch.setattr(step_profile, "profile_arm", fake_profile)
    step_profile.profile_pinned(None, "dgrad:8192:14336:4096=det/t128x192x64/pp/c2", 3)
    assert seen == [("jax_cake", (128, 192, 64), "pingpong", True, False)]
    assert overrides.forced("tile") is None


def test_an_xla_pin_sends_only_its_gemm_to_the_xla_path(monkeypatch):
    import jax_cake as jc
    from jax_cake.planner import device as device_lib

    h200 = device_lib.DeviceInfo(platform="cuda", kind="NVIDIA H200", arch="sm_90a", sm_count=132)
    plans = []

    def fake_profile(case, arm, steps):
        down = dict(tokens=8192, d_in=14336, d_out=4096, device=h200)
        plans.append((jc.planner.plan("dgrad", **down).backend, jc.planner.plan("fwd", **down).backend))
        return []

    monkeypatch.setattr(step_profile, "profile_arm", fake_profile)
    step_profile.profile_pinned(None, "dgrad:8192:14336:4096=xla", 3)
    assert plans == [("xla", "sm90a")]
