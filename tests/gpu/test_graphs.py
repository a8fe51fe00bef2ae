"""CUDA graphs: a jit of 12 chained custom calls (4 x fwd -> dgrad -> ordered split-K
wgrad) runs as an XLA command buffer, replays with the same bits, and matches the same
chain launched call by call."""

import glob
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from jax_cake import contract

import gpu_helpers as h
from helpers import child_env

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_library")]

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def graph_results(gpu_library):
    """Three runs of the jitted chain."""
    f = jax.jit(h.make_graph_chain(*h.GRAPH_SHAPE))
    x, w = h.graph_inputs()
    return [f(x, w) for _ in range(3)]


def test_graph_replay_bitwise(graph_results):
    first = graph_results[0]
    for r, again in enumerate(graph_results[1:], start=2):
        for i, (a, b) in enumerate(zip(first, again)):
            assert h.same_bits(a, b), f"replay {r}: dw {i} differs from the first run"


def test_graph_matches_eager(graph_results):
    """The graph against per-op launches of the same programs (poisoned outputs), bitwise."""
    T, d_in, d_out = h.GRAPH_SHAPE
    x, w = h.graph_inputs()
    for i in range(4):
        y = h.call(contract.FWD_TARGET, x, w, tile=h.fwd_tile(d_out))
        dx = h.call(contract.DGRAD_TARGET, y, w, tile=h.dgrad_tile(d_in))
        dw = h.call(
            contract.WGRAD_TARGET,
            y,
            dx,
            tile=h.wgrad_tile(d_out),
            out_dtype=h.F32,
            splits=h.GRAPH_WGRAD_SPLITS,
            reduction=contract.REDUCTION_ORDERED,
        )
        assert h.same_bits(graph_results[0][i], dw), f"dw {i}: graph and per-op launches differ"
        x = dx


@pytest.mark.full  # a fresh process compiles the chain again
def test_custom_calls_run_inside_a_command_buffer(tmp_path):
    """XLA's thunk sequence of the chain holds a command buffer with the custom calls inside
    it. XLA's dump flags must be set before jax starts, so a fresh process compiles it."""
    env = child_env()
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_dump_to={tmp_path} --xla_dump_hlo_module_re=.*graph_chain.*"
    ).strip()
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # this process already holds most of the GPU
    proc = subprocess.run(
        [sys.executable, str(HERE / "graph_dump.py")], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = glob.glob(os.path.join(tmp_path, "*graph_chain*thunk_sequence_after_thunk_passes.txt"))
    assert files, f"no thunk-sequence dump of graph_chain in {sorted(os.listdir(tmp_path))[:20]}"
    texts = [pathlib.Path(f).read_text() for f in files]
    assert any(h.command_buffer_holds_custom_calls(t) for t in texts), texts[0][:2000]
