"""The multi-device check runs on 8 fake CPU devices (its gradient checks; times are host wall)."""

import os
import subprocess
import sys


def test_multi_gpu_check_on_fake_cpu_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jax_cake.tools.multi_gpu_check",
            "--tokens_per_device=32",
            "--d_model=64",
            "--d_ff=128",
            "--reps=2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS data_parallel_grads" in out.stdout and "PASS tensor_parallel_grads" in out.stdout
    assert "host wall time" in out.stdout
