"""The GEMM primitives: one function per GEMM role, a Plan and an epilogue in, one XLA
FFI custom call (CUDA) or the XLA reference (elsewhere) out, with the sharding and vmap
rules next to the calls.

  gemm.py          the custom calls on unbatched, unpartitioned operands ("store" and
                   "add" epilogues) and the reference fallback
  partitioning.py  the sharding rule (custom_partitioning, Explicit axes) and the
                   operands' sharding types (shard_map's varying axes)
  batching.py      the vmap rule: a vmapped axis folds into the kernels' tokens or batch
  call.py          (role, plan, epilogue) -> the call with both rules around it
"""

from jax_cake.primitives.call import (
    dgrad,
    dgrad_gate_up,
    dgrad_gated,
    fwd,
    fwd_gated,
    router_dgrad,
    router_fwd,
    router_wgrad,
    wgrad,
)
from jax_cake.primitives.gemm import router_ffi_operands, targets_from
from jax_cake.primitives import grouped  # the grouped (ragged) GEMM roles of the MoE projections

__all__ = [
    "dgrad",
    "dgrad_gate_up",
    "dgrad_gated",
    "fwd",
    "fwd_gated",
    "grouped",
    "router_dgrad",
    "router_ffi_operands",
    "router_fwd",
    "router_wgrad",
    "targets_from",
    "wgrad",
]
