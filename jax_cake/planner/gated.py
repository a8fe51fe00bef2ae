"""Plans for the forward GEMM with the gated epilogue: (gu, h) = (x W^T, act(g) * u).

`plan_gated` returns a Plan with op "fwd_gated" where the library runs the gate/up
projection and its activation in one kernel (jax_cake_fwd_gated, docs/ffi_contract.md):
the forward planner's own choice (tile, cluster, schedule, raster) when a gated variant
of it is compiled, else that tile with cluster 1x1 and the tiles schedule if that one
is. The kernel writes the pre-activation gu (the accumulator rounded once to bf16, as the
plain forward writes it) and h = bf16(act(g) * u) in FP32 from those bf16 values, so the
fused call gives the values of the plain forward followed by jax_cake.reference.gate, up
to the FP32 rounding of the activation's exp.

Otherwise the result is the ordinary forward plan (op "fwd"), and the primitive runs that
forward and an XLA elementwise pass for h (one log line says why): where d_ff is not a
multiple of contract.GATE_BLOCK (the kernels' interleave), where no gated variant fits,
off the GPU or on the plan table's XLA rows (the XLA plan).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from absl import logging

from jax_cake import contract
from jax_cake.planner import choose, variants
from jax_cake.planner.plan_type import Plan

OP = "fwd_gated"
# Whether plan_gated plans the fused kernel. Held back: on the H200 (jax 0.11.2,
# 2026-12-02, `python -m jax_cake.tools.model_bench --cases=mlp --runs=1`, graph mode) the
# SwiGLU MLP step at T 8192, 4096 -> 14336 -> 4096 ran 13.84 ms with the activation in
# the 128x256 c2x1 kernel's epilogue against 13.32 ms with the plain forward and an XLA
# pass (XLA 12.65 ms): the epilogue's extra h stores and math on a cooperative tile cost
# more than the pass they replace. Off, swiglu_mlp and gated_projection run the forward
# and the pass (the same values); the kernels stay compiled and tested.
GATED_EPILOGUE_ENABLED = False


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
    reason = None
    if not (GATED_EPILOGUE_ENABLED if epilogue is None else epilogue):
        reason = "the gated kernel epilogue is held back (GATED_EPILOGUE_ENABLED: slower than the pass, measured)"
    elif d_out % (2 * contract.GATE_BLOCK) != 0:
        reason = f"d_ff = {d_out // 2} is not a multiple of {contract.GATE_BLOCK} (the kernels' gate/up interleave)"
    else:
        for cluster, schedule in dict.fromkeys(((base.cluster, base.schedule), ((1, 1), "tiles"))):
            if variants.find_variant("fwd", base.tile, cluster, "bfloat16", store, schedule) is None:
                continue
            return dataclasses.replace(
                base,
                op=OP,
                cluster=cluster,
                schedule=schedule,
                reason=(
                    f"{base.reason}; the {activation} gated epilogue in the kernel: gu (bf16) and "
                    f"h = bf16({activation}(g) * u) from each finished tile"
                ),
            )
        reason = f"no compiled {store} variant of the {base.tile[0]}x{base.tile[1]} tile"
    _log_separate_pass_once(base.device, f"{batch}x{tokens}x{d_in}->{d_out}", reason)
    return dataclasses.replace(base, reason=f"{base.reason}; then an XLA pass for h ({reason})")
