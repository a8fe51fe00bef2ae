"""benchmarks.bench --family=gated on CPU: each arm's plan and its CUDA lowering (on a faked
H200), and a whole run of the XLA arm."""

import contextlib
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jax_cake as jc

from helpers import custom_call_lines, faked_device
from jax_cake import contract
from benchmarks import harness
from benchmarks.families import gated as gated_bench

POINT = harness.Point(8192, 4096, 28672, "bfloat16")
ARGS = (jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((28672, 4096), jnp.bfloat16))
# arm -> (custom call, tile_n, cluster_m, schedule)
EXPECTED = {
    "fused": ("jax_cake_fwd_gated", 192, 2, contract.SCHEDULE_PINGPONG),
    "fused_pp192c1": ("jax_cake_fwd_gated", 192, 1, contract.SCHEDULE_PINGPONG),
    "fused_coop256c2": ("jax_cake_fwd_gated", 256, 2, contract.SCHEDULE_TILES),
    "composed": ("jax_cake_fwd", 192, 2, contract.SCHEDULE_PINGPONG),
    "composed_coop256c2": ("jax_cake_fwd", 256, 2, contract.SCHEDULE_TILES),
}


def test_every_kernel_arm_is_listed():
    assert set(gated_bench.ARMS) == set(EXPECTED) | {"xla"}


@pytest.mark.parametrize("arm", sorted(EXPECTED))
def test_arm_lowers_to_its_kernel(arm):
    target, tile_n, cluster_m, schedule = EXPECTED[arm]
    # The faked mesh sends the plain forward through its partitioning rule, which plans
    # again when lowered: lower inside the arm's force as well.
    forced = arm.partition("_")[2]
    pins = {}
    if forced:
        pins = dict(zip(("tile", "cluster", "schedule"), gated_bench.FORCED[forced]))
    with faked_device(), jc.planner.force("det", **pins) if pins else contextlib.nullcontext():
        step = gated_bench.step_fn(arm, POINT)
        text = jax.jit(step).trace(*ARGS).lower(lowering_platforms=("cuda",)).as_text()
    (call,) = custom_call_lines(text, target)
    for attr, want in (("tile_n", tile_n), ("cluster_m", cluster_m), ("schedule", schedule)):
        assert f"{attr} = {want} : i64" in call, (arm, call)
    other = "jax_cake_fwd" if target == "jax_cake_fwd_gated" else "jax_cake_fwd_gated"
    assert not custom_call_lines(text, other) and "dot_general" not in text


@pytest.mark.parametrize("arm", ["fused", "fused_pp192c1"])
def test_gelu_arms_lower_to_the_gelu_epilogue(arm):
    forced = arm.partition("_")[2]
    pins = dict(zip(("tile", "cluster", "schedule"), gated_bench.FORCED[forced])) if forced else {}
    with faked_device(), jc.planner.force("det", **pins) if pins else contextlib.nullcontext():
        text = jax.jit(gated_bench.step_fn(arm, POINT, "gelu")).trace(*ARGS).lower(lowering_platforms=("cuda",)).as_text()
    (call,) = custom_call_lines(text, "jax_cake_fwd_gated")
    assert f"activation = {contract.ACTIVATION_GELU} : i64" in call, call


def test_xla_arm_is_the_reference_composition():
    x = jax.random.normal(jax.random.key(0), (64, 128), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (96, 128)) * 0.1).astype(jnp.bfloat16)
    h, gu = gated_bench.step_fn("xla", harness.Point(64, 128, 96, "bfloat16"))(x, w)
    g, u = jnp.asarray(gu, jnp.float32).reshape(64, 3, 2, 16).transpose(2, 0, 1, 3).reshape(2, 64, 48)
    g, u = g.astype(jnp.bfloat16).astype(jnp.float32), u.astype(jnp.bfloat16).astype(jnp.float32)
    want = (jax.nn.silu(g) * u).astype(jnp.bfloat16)
    assert h.shape == (64, 48) and gu.shape == (64, 96)
    assert float(jnp.max(jnp.abs(h.astype(jnp.float32) - want.astype(jnp.float32)))) <= 2.0**-7 * float(
        jnp.max(jnp.abs(want.astype(jnp.float32)))
    )


def test_bench_runs_on_cpu():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", "--family=gated", "--tokens=64", "--d_in=128", "--d_out=128",
         "--arms=xla", "--runs=1", "--groups=2", "--steps=2", "--flush_mb=1", "--modes=g"],
        cwd=pathlib.Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| 128 -> 128 | 64 | g |" in proc.stdout and "xla us" in proc.stdout, proc.stdout
