"""The Plan: what one GEMM call runs, decided at trace time (jax_cake.planner.choose).

Primitives pass a kernel Plan to the native handler as FFI attributes
(`Plan.ffi_attributes`, docs/ffi_contract.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax_cake import contract
from jax_cake.planner import variants

OPS = ("fwd", "dgrad", "wgrad", "router_fwd", "router_dgrad", "router_wgrad")
# The grouped (ragged) GEMMs of grouped_projection / ragged_dot: rows sorted by group, one
# weight per group (MoE experts); jax_cake.planner.grouped plans them.
GROUPED_OPS = ("grouped_fwd", "grouped_dgrad", "grouped_wgrad")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one GEMM call runs. Frozen and hashable: it is static under jit.

    The GEMM is C[batch, m, n] = A[batch, m, k] . B[batch, n, k]^T (see
    docs/ffi_contract.md for how fwd/dgrad/wgrad map onto it).
    """

    op: str  # one of OPS or GROUPED_OPS
    backend: str  # "sm90a" (CuTe DSL kernels) or "xla"
    batch: int
    m: int
    n: int
    k: int
    out_dtype: str
    device: str
    # How the K sum is ordered, as jax_cake.planner.force and the plan tables name it:
    # "det" (a fixed order: one pass, ordered split-K or a split tail; bitwise reproducible)
    # or "split" (arrival-order split-K, wgrad only). fwd, dgrad and the router are "det".
    algorithm: str = "det"
    tile: tuple[int, int, int] = (0, 0, 0)
    cluster: tuple[int, int] = (1, 1)
    splits: int = 1
    # "none", "ordered" (fixed split order, second pass), "arrival" (atomics), "split_tail"
    # (the last partial wave's tiles cut into `splits` K pieces summed in piece order in
    # the kernel: reproducible); contract.REDUCTIONS holds their codes
    reduction: str = "none"
    raster: str = "m"  # tiles walk along m first, "n" first, or "m<B>" in bands of B rows (contract.raster_code)
    workspace_bytes: int = 0
    reason: str = ""
    sm_count: int = 0  # the device's SM count the plan was made for (kernel plans)
    schedule: str = "tiles"  # "tiles", "split_tail" (wgrad, reduction "split_tail"), "pingpong" (fwd/dgrad)
    groups: int = 0  # the grouped ops (GROUPED_OPS): G, the number of groups (weights); 0 for the others

    @property
    def uses_kernel(self) -> bool:
        return self.backend != "xla"

    @property
    def program(self) -> str | None:
        """The kernel program the FFI handler runs, as the variant tables name it: "fwd",
        "dgrad" or "wgrad" (of the router's family for the router ops; "wgrad" for
        "wgrad_accumulate", "fwd" for "fwd_residual" and "fwd_gated", "dgrad" for
        "dgrad_gated" and "dgrad_gate_up", "grouped_fwd" for "grouped_fwd_gated"); None on
        the XLA path."""
        if not self.uses_kernel:
            return None
        fused = {
            "wgrad_accumulate": "wgrad",
            "fwd_residual": "fwd",
            "fwd_gated": "fwd",
            "dgrad_gated": "dgrad",
            "dgrad_gate_up": "dgrad",
            "grouped_fwd_gated": "grouped_fwd",
        }
        return fused.get(self.op, self.op.removeprefix("router_"))

    def with_add_in_kernel(
        self,
        op: str,
        tile,
        *,
        reason: str,
        splits: int = 1,
        reduction: str = "none",
        workspace_bytes: int = 0,
        **changes,
    ) -> Plan:
        """This kernel plan turned into op's ("wgrad_accumulate", "fwd_residual": the GEMM
        adds into an existing buffer in the kernel, jax_cake.planner.accumulate and
        .residual): a fixed-order ("det") program on `tile`, cluster 1x1, the tiles
        schedule; `changes` are further fields to replace."""
        return dataclasses.replace(
            self,
            op=op,
            algorithm="det",
            tile=tile,
            cluster=(1, 1),
            splits=splits,
            reduction=reduction,
            schedule="tiles",
            workspace_bytes=workspace_bytes,
            reason=reason,
            **changes,
        )

    def unfused(self) -> Plan:
        """A "fwd_gated", "dgrad_gated", "dgrad_gate_up" or "grouped_fwd_gated" plan as the
        plain GEMM of the same program (op "fwd", "dgrad", "grouped_fwd"): its GEMM without the
        gated epilogue, or over one operand pair."""
        plain = {"fwd_gated": "fwd", "dgrad_gated": "dgrad", "dgrad_gate_up": "dgrad", "grouped_fwd_gated": "grouped_fwd"}
        return dataclasses.replace(self, op=plain[self.op]) if self.op in plain else self

    @property
    def deterministic(self) -> bool:
        return self.reduction != "arrival"

    @property
    def ctas(self) -> int:
        if not self.uses_kernel:
            return 0
        tm, tn, _ = self.tile
        tiles = self.batch * math.ceil(self.m / tm) * math.ceil(self.n / tn)
        if self.reduction == "split_tail":  # whole tiles, then splits pieces per tail tile
            return tiles + variants.split_tail_slots(tiles, self.splits, self.sm_count)
        return tiles * self.splits

    def ffi_attributes(self) -> dict[str, Any]:
        """The attributes the native handler reads (docs/ffi_contract.md)."""
        import numpy as np

        return {
            "tile_m": np.int64(self.tile[0]),
            "tile_n": np.int64(self.tile[1]),
            "tile_k": np.int64(self.tile[2]),
            "cluster_m": np.int64(self.cluster[0]),
            "cluster_n": np.int64(self.cluster[1]),
            "splits": np.int64(self.splits),
            "reduction": np.int64(contract.REDUCTIONS[self.reduction]),
            "raster": np.int64(contract.raster_code(self.raster)),
            "schedule": np.int64(contract.SCHEDULES[self.schedule]),
        }
