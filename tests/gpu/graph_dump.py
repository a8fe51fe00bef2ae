"""Compiles and runs the CUDA-graph chain once, for test_graphs: run as a script in a fresh
process whose XLA_FLAGS ask for dumps of the graph_chain module (the flags must be set
before jax starts its backend, which the pytest process has done long before)."""

import jax

from jax_cake import native

import gpu_helpers as h

if __name__ == "__main__":
    native.ensure_registered()
    f = jax.jit(h.make_graph_chain(*h.GRAPH_SHAPE))
    jax.block_until_ready(f(*h.graph_inputs()))
