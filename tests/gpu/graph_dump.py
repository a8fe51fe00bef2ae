"""Compiles and runs the CUDA-graph chain once, for test_graphs: run as a script in a fresh
process whose XLA_FLAGS ask for dumps of the graph_chain module (the flags must be set
before jax starts its backend, which the pytest process has done long before)."""

import pathlib
import sys

import jax

from jax_cake import native

sys.path.insert(1, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: gpu_helpers imports helpers
import gpu_helpers as h  # noqa: E402

if __name__ == "__main__":
    native.ensure_registered()
    f = jax.jit(h.make_graph_chain(*h.GRAPH_SHAPE))
    jax.block_until_ready(f(*h.graph_inputs()))
