"""The custom_vjp of every pipeline, with the operands' sharding types handled once.

A pipeline is written as the calculus of its GEMMs, `forward(static, *operands) ->
(outputs, saved)` and `backward(static, specs, saved, cotangent) -> one cotangent per
operand`, and `sharded_vjp(forward, backward)` makes the op `op(static, *operands)`:

- on entry the operands (arrays, or None for an absent option such as a residual) are made
  varying over the same manual axes inside shard_map (partitioning.to_common_varying: a
  replicated weight's gradient is then summed over the token axes by pcast's transpose);
- the backward gets `specs`, each operand's PartitionSpec under Explicit axes (None
  elsewhere and for an absent operand), to ask each gradient GEMM for its operand's
  sharding (an FSDP weight's data-parallel sum then becomes a reduce-scatter);
- the cotangents it returns are resharded to those specs: under Explicit axes JAX wants
  each cotangent in its primal's sharding type.

`static` is the op's hashable options (a nondiff argument of the custom_vjp).
"""

from __future__ import annotations

import functools

import jax

from jax_cake.primitives import partitioning


def sharded_vjp(forward, backward):
    """The op `op(static, *operands)` of a pipeline's forward and backward (module docstring)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
    def op(static, specs, *operands):
        del specs
        return forward(static, *operands)[0]

    def op_fwd(static, specs, *operands):
        del specs
        return forward(static, *operands)

    def op_bwd(static, specs, saved, cotangent):
        return partitioning.to_specs(backward(static, specs, saved, cotangent), specs)

    op.defvjp(op_fwd, op_bwd)

    def call(static, *operands):
        operands, specs = partitioning.common_operands(*operands)
        return op(static, specs, *operands)

    return call
