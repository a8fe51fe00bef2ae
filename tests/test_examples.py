"""Runs each example as a user would (a subprocess): on CPU with tiny sizes, and with
default sizes on the GPU (`pytest -m gpu`, skipped elsewhere).

Checks the exit status and what the example prints: the training loss went down, and
the shard_map gradients matched the unsharded ones.
"""

import re
import subprocess
import sys

import pytest

from helpers import REPO, child_env
STEP_LOSS = re.compile(r"^step\s+(\d+)\s+loss\s+([0-9.eE+-]+)", re.MULTILINE)


def run_process(name, *flags, platform="cpu"):
    # XLA_FLAGS dropped: the shard_map example sets its own device count
    env = child_env(drop=("XLA_FLAGS",), JAX_PLATFORMS=platform)
    return subprocess.run(
        [sys.executable, str(REPO / "examples" / name), *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def run_example(name, *flags, platform="cpu"):
    proc = run_process(name, *flags, platform=platform)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def assert_loss_went_down(stdout):
    losses = [float(loss) for _, loss in STEP_LOSS.findall(stdout)]
    assert len(losses) >= 2, stdout
    assert losses[-1] < 0.9 * losses[0], f"loss did not go down: {losses}"
    assert "median step time" in stdout


def test_train_step():
    """The default learning rate and warmup, at a small size."""
    stdout = run_example(
        "train_step.py", "--steps=12", "--batch=2", "--seq=16", "--d_model=32", "--heads=2", "--log_every=1"
    )
    assert_loss_went_down(stdout)
    assert "Adam lr 0.006 after 1 warmup steps" in stdout  # 3e-3 * sqrt(128 / 32)


def test_train_step_wide():
    """At 4x the default width the width-scaled default still trains (a rate that trains
    d_model=128 stalls or diverges at 1024-2048)."""
    stdout = run_example(
        "train_step.py", "--steps=30", "--batch=2", "--seq=32", "--d_model=512", "--heads=8", "--log_every=1"
    )
    assert_loss_went_down(stdout)
    assert "Adam lr 0.0015 after 3 warmup steps" in stdout  # 3e-3 * sqrt(128 / 512)


def test_train_step_fails_when_the_loss_does_not_fall():
    proc = run_process("train_step.py", "--steps=3", "--batch=8", "--seq=16", "--d_model=32", "--heads=2", "--lr=0")
    assert proc.returncode == 1 and "the loss did not fall" in proc.stderr, proc.stdout + proc.stderr


MOE_FLAGS = ("--steps=12", "--tokens=128", "--d_model=32", "--d_ff=64", "--experts=8", "--log_every=1")


def test_moe_train():
    """The dropless MoE block (router_logits, top-k, moe_mlp, the balance loss) trains."""
    stdout = run_example("moe_train.py", *MOE_FLAGS, "--lr=1e-2")
    assert_loss_went_down(stdout)
    assert "E 8, top_k 2, dropless" in stdout


def test_moe_train_fails_when_the_loss_does_not_fall():
    proc = run_process("moe_train.py", *MOE_FLAGS[1:], "--steps=3", "--lr=0")
    assert proc.returncode == 1 and "the loss did not fall" in proc.stderr, proc.stdout + proc.stderr


def assert_gradients_matched(stdout):
    diffs = re.findall(r"^(\w+)\s+(y|dx|dw)\s+\S+\s+max_rel_diff\s+(\S+)\s+ok$", stdout, re.MULTILINE)
    assert {(layout, label) for layout, label, _ in diffs} == {
        (layout, label) for layout in ("data_parallel", "tensor_parallel") for label in ("y", "dx", "dw")
    }, stdout
    assert "PASS" in stdout


def test_shard_map_projection():
    stdout = run_example("shard_map_projection.py", "--tokens=64", "--d_in=64", "--d_out=128")
    assert "mesh: 8 cpu device(s)" in stdout, stdout
    assert_gradients_matched(stdout)


@pytest.mark.gpu
@pytest.mark.full  # three examples, each in a fresh process
def test_examples_on_gpu():
    for name in ("train_step.py", "moe_train.py"):
        stdout = run_example(name, platform="cuda")
        assert stdout.startswith("backend gpu"), stdout
        assert_loss_went_down(stdout)
    assert_gradients_matched(run_example("shard_map_projection.py", platform="cuda"))
