"""Plans for the forward GEMM with the gated epilogue: (gu, h) = (x W^T, act(g) * u).

`plan_gated` returns a Plan with op "fwd_gated" where the library runs the gate/up
projection and its activation in one kernel (jax_cake_fwd_gated, docs/ffi_contract.md):
where the forward planner picks its widest tiles (128 x 256: the large, compute-bound
shapes), the gated ping-pong 128 x 192 tile (GATED_TILE) with the planner's cluster, or
1x1; under a force() pin of the tile or schedule, the pinned tile. The kernel writes the pre-activation gu (the accumulator rounded once to bf16, as the
plain forward writes it) and h = bf16(act(g) * u) in FP32 from those bf16 values, so the
fused call gives the values of the plain forward followed by jax_cake.reference.gate, up
to the FP32 rounding of the activation's exp.

Otherwise the result is the ordinary forward plan (op "fwd"), and the primitive runs that
forward and an XLA elementwise pass for h (one log line says why): where d_ff is not a
multiple of contract.GATE_BLOCK (the kernels' interleave), where the planner picks a
narrower tile (smaller shapes, not measured with the epilogue), where no gated variant fits,
off the GPU or on the plan table's XLA rows (the XLA plan).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from absl import logging

from jax_cake import contract
from jax_cake.planner import choose, overrides, variants
from jax_cake.planner.plan_type import Plan

OP = "fwd_gated"
# Whether plan_gated may plan the fused kernel at all (the benchmark passes epilogue= to
# time both ways).
GATED_EPILOGUE_ENABLED = True
# The tile the gated epilogue runs on unless a force() pins another: the ping-pong
# 128 x 192, whose gu and h stores run under the other warpgroup's K loop. Measured on the
# H200 (jax 0.11.2, 2026-12-03, `python -m jax_cake.tools.gated_bench --runs=2 --modes=g
# --groups=8`, T 8192, 4096 -> 2 x 14336, device time): fused on it 2814 us, on the
# cooperative 128 x 256 c2x1 tile 3168 us, the plain forward + XLA pass 3079 us, XLA's dot
# + pass 3036 us. Where the forward planner picks a narrower tile than 128 x 256 (smaller
# shapes) the pass runs after the GEMM.
GATED_TILE = (128, 192, 64)
GATED_SCHEDULE = "pingpong"
_GATED_TILE_NAME = f"ping-pong {GATED_TILE[0]}x{GATED_TILE[1]}"


@functools.cache
def _log_separate_pass_once(device: str, shape: str, reason: str) -> None:
    logging.info("jax_cake: the gated activation of %s on %s runs as an XLA pass after the GEMM: %s", shape, device, reason)


def plan_gated(
    *,
    tokens: int,
    d_in: int,
    d_out: int,
    activation: str,
    batch: int = 1,
    device: Any = None,
    epilogue: bool | None = None,
) -> Plan:
    """The Plan that computes gu = x W^T and h = act(g) * u in one kernel.

    tokens, d_in, d_out: x [batch, tokens, d_in], W [batch, d_out = 2F, d_in] (gate and up
    rows interleaved), gu [batch, tokens, 2F], h [batch, tokens, F]. activation: "silu" or
    "gelu". device: as `jax_cake.plan`. epilogue: whether the fused kernel may be planned
    (None: GATED_EPILOGUE_ENABLED; the benchmark times both). Returns a Plan with op
    "fwd_gated" (the fused kernel), op "fwd" (a kernel forward plus an XLA pass) or an XLA
    plan.
    """
    base = choose.plan("fwd", tokens=tokens, d_in=d_in, d_out=d_out, batch=batch, device=device)
    if not base.uses_kernel:
        return base
    store = f"gated_{activation}"
    pinned = overrides.forced("tile") is not None or overrides.forced("schedule") is not None
    reason = None
    if not (GATED_EPILOGUE_ENABLED if epilogue is None else epilogue):
        reason = "the gated kernel epilogue is switched off"
    elif d_out % (2 * contract.GATE_BLOCK) != 0:
        reason = f"d_ff = {d_out // 2} is not a multiple of {contract.GATE_BLOCK} (the kernels' gate/up interleave)"
    elif base.tile[1] < 256 and not pinned:
        reason = f"the planner's {base.tile[0]}x{base.tile[1]} tiles (the epilogue runs on the {_GATED_TILE_NAME} tile)"
    else:
        # A force() pin keeps the pinned tile; else the wide ping-pong tile.
        tile, schedule = (base.tile, base.schedule) if pinned else (GATED_TILE, GATED_SCHEDULE)
        for cluster in dict.fromkeys((base.cluster, (1, 1))):
            if variants.find_variant("fwd", tile, cluster, "bfloat16", store, schedule) is None:
                continue
            return dataclasses.replace(
                base,
                op=OP,
                tile=tile,
                cluster=cluster,
                schedule=schedule,
                reason=(
                    (base.reason if pinned else f"{base.reason}; for the epilogue the {_GATED_TILE_NAME} tile instead")
                    + f"; the {activation} gated epilogue in the kernel: gu (bf16) and "
                    f"h = bf16({activation}(g) * u) from each finished tile"
                ),
            )
        reason = f"no compiled {store} variant of the {tile[0]}x{tile[1]} {schedule} tile"
    _log_separate_pass_once(base.device, f"{batch}x{tokens}x{d_in}->{d_out}", reason)
    return dataclasses.replace(base, reason=f"{base.reason}; then an XLA pass for h ({reason})")
