"""benchmarks.bench --family=grouped_gated on CPU: each kernel arm's plan and CUDA lowering (on
a faked H200), the xla arm's values, and a whole run of the XLA arm."""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import custom_call_lines, faked_device
from jax_cake import contract, reference
from benchmarks import harness
from benchmarks.families import grouped_gated as bench

POINT = harness.Point(16384, 4096, 28672, "bfloat16")
G = 8
ARGS = (
    jax.ShapeDtypeStruct((16384, 4096), jnp.bfloat16),
    (jax.ShapeDtypeStruct((G, 28672, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((G,), jnp.int32)),
)
EXPECTED = {"fused": contract.GROUPED_FWD_GATED_TARGET, "composed": contract.GROUPED_FWD_TARGET}


def test_every_arm_is_listed():
    assert set(bench.ARMS) == set(EXPECTED) | {"xla"}


@pytest.mark.parametrize("arm", sorted(EXPECTED))
def test_arm_lowers_to_its_kernel(arm):
    with faked_device():
        text = jax.jit(bench.step_fn(arm, POINT, G)).trace(*ARGS).lower(lowering_platforms=("cuda",)).as_text()
    (call,) = custom_call_lines(text, EXPECTED[arm])
    assert "tile_n = 256 : i64" in call, call
    other = set(EXPECTED.values()) - {EXPECTED[arm]}
    assert not any(custom_call_lines(text, t) for t in other) and "ragged_dot" not in text
    # the composed arm's activation is an XLA pass (its sigmoid), the fused arm's in the kernel
    assert ("stablehlo.exponential" in text) == (arm == "composed")


def test_balanced_sizes_put_the_remainder_on_the_first_groups():
    assert bench.balanced_sizes(19, 4).tolist() == [5, 5, 5, 4]


def test_xla_arm_is_the_reference_composition():
    m, d_in, two_f, groups = 96, 64, 64, 3
    point = harness.Point(m, d_in, two_f, "bfloat16")
    _, x, (w, sizes) = bench.make_inputs(point, groups, flush_mb=1)
    h, gu = bench.step_fn("xla", point, groups)(x, (w, sizes))
    rows = np.repeat(np.arange(groups), np.asarray(sizes))
    want_gu = np.einsum("mk,mnk->mn", np.asarray(x, np.float64), np.asarray(w, np.float64)[rows])
    got_gu = np.asarray(gu, np.float64)
    assert np.linalg.norm(got_gu - want_gu) <= 2.0**-8 * np.linalg.norm(want_gu)
    want_h = reference.gate(*reference.deinterleave(gu, -1, contract.GATE_BLOCK), "silu")
    assert h.shape == (m, two_f // 2) and np.array_equal(np.asarray(h, np.float32), np.asarray(want_h, np.float32))


def test_bench_runs_on_cpu():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", "--family=grouped_gated", "--tokens=96", "--d_in=64",
         "--d_out=64", "--gated_experts=3", "--arms=xla", "--runs=1", "--groups=2", "--steps=2", "--flush_mb=1",
         "--modes=g"],
        cwd=pathlib.Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| 64 -> 64 | 96 | 3 | g |" in proc.stdout and "xla us" in proc.stdout, proc.stdout
