"""Plans for the GEMMs of the gated projection that other GEMMs do not have: the forward
with the gated epilogue, (gu, h) = (x W^T, act(g) * u), the down projection's dgrad with the
activation's gradient, and the gated projection's dx from its cotangent's halves.

`plan_gated` returns a Plan with op "fwd_gated" where the library runs the gate/up
projection and its activation in one kernel (jax_cake_fwd_gated, docs/ffi_contract.md);
`plan_gate_grad` one with op "dgrad_gated" where it runs the down projection's dgrad
dh = dy W_down and, from dh and the saved pre-activation, d[gate|up] in one kernel
(jax_cake_dgrad_gated). Both where the plain GEMM's planner picks a wide tile
(choose.is_wide_tile: 128 x 256 or a wide ping-pong tile, the large, compute-bound shapes),
and for the gradient only where enabled
(GATE_GRAD_EPILOGUE_ENABLED: held back, slower than the pass it replaces as built): then
the epilogue runs on the ping-pong 128 x 192 tile (GATED_TILE) with the planner's cluster,
or 1x1; under a force() pin of the tile or schedule, on the pinned tile. The forward kernel writes the pre-activation gu (the
accumulator rounded once to bf16, as the plain forward writes it) and h = bf16(act(g) * u)
in FP32 from those bf16 values; the dgrad kernel rounds dh to bf16 (the plain dgrad's
output) and applies jax_cake.reference.gate_grad to it in FP32. So either fused call gives
the values of the plain GEMM followed by the reference's elementwise pass, up to the FP32
rounding of the activation's exp.

For the two epilogues, otherwise the result is the plain GEMM's plan (op "fwd" or "dgrad"),
and the primitive runs that GEMM and an XLA elementwise pass (one log line says why): where d_ff is not a
multiple of contract.GATE_BLOCK (the kernels' interleave), where the planner picks a
narrower tile (smaller shapes, not measured with the epilogue), where no variant fits
(gelu's gradient epilogue is not built), off the GPU or on the plan table's XLA rows (the
XLA plan).

`plan_gate_up_dgrad` turns the gated projection's dx (the plain dgrad's plan over K = 2F)
into op "dgrad_gate_up" where a variant of its tile reads the cotangent's halves dg, du and
the interleaved weight's gate and up rows in place (jax_cake_dgrad_gate_up); elsewhere the
plan stays the plain dgrad's and an XLA pass interleaves dg, du for it (one log line says
why).

These plans start from the plain GEMM's rule (choose.plan with tile_rows=False), fallbacks
included: the plan table's fwd/dgrad tile rows timed the plain GEMMs' kernels, not the
fused ones, and a row's tile would move the fused kernels off their measured tile.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from jax_cake import contract, logs
from jax_cake.planner import choose, overrides, variants
from jax_cake.planner.plan_type import Plan

OP = "fwd_gated"
GATE_GRAD_OP = "dgrad_gated"
GATE_UP_DGRAD_OP = "dgrad_gate_up"
# Whether plan_gate_up_dgrad may plan the gated projection's dx from the cotangent's halves
# (the benchmark's step profile turns it off to time dx over the interleaved cotangent).
GATE_UP_DGRAD_ENABLED = True
# Whether plan_gated may plan the fused kernel at all (the benchmark passes epilogue= to
# time both ways).
GATED_EPILOGUE_ENABLED = True
# Whether plan_gate_grad may plan the gradient kernel by default (epilogue=None). Held back:
# in the SwiGLU MLP step (H200, jax 0.11.2, 2026-12-03, T 8192, 4096 -> 14336 -> 4096,
# each kernel's device time in the step, the gradient epilogue forced on) the
# kernel ran 2388 us where the plain dgrad and the XLA passes it replaces took 1306 + 549,
# and the step 13.84 ms against 13.15. Its epilogue's gu loads and doubled stores are not
# hidden behind the other warpgroup's K loop (docs/benchmarks.md).
GATE_GRAD_EPILOGUE_ENABLED = False
# The tile the gated epilogue runs on unless a force() pins another: the ping-pong
# 128 x 192, whose gu and h stores run under the other warpgroup's K loop. Measured on the
# H200 (jax 0.11.2, 2026-12-03, the benchmark's gated family, 8 paired groups, T 8192,
# 4096 -> 2 x 14336, device time): fused on it 2814 us, on the cooperative 128 x 256 c2x1
# tile 3168 us, the plain forward + XLA pass 3079 us, XLA's dot + pass 3036 us. Where the forward planner picks a narrower tile than its wide ones
# (choose.is_wide_tile; smaller shapes) the pass runs after the GEMM.
GATED_TILE = (128, 192, 64)
GATED_SCHEDULE = "pingpong"
_GATED_TILE_NAME = f"ping-pong {GATED_TILE[0]}x{GATED_TILE[1]}"


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
    block = overrides.active()
    base = choose.plan_with(
        block, "fwd", tokens=tokens, d_in=d_in, d_out=d_out, batch=batch, device=device, tile_rows=False
    )
    if epilogue is None:
        epilogue = GATED_EPILOGUE_ENABLED
    return _with_epilogue(
        base, block, OP, f"gated_{activation}", d_out // 2, activation, epilogue, "h = bf16({act}(g) * u)"
    )


def plan_gate_grad(
    *,
    tokens: int,
    d_ff: int,
    d_out: int,
    activation: str,
    batch: int = 1,
    device: Any = None,
    epilogue: bool | None = None,
) -> Plan:
    """The Plan that computes the down projection's dh = dy W_down and, in the same
    kernel, d[gate|up] from dh and the saved pre-activation gu.

    tokens, d_ff, d_out: dy [batch, tokens, d_out], W_down [batch, d_out, d_ff], gu and
    d_gu [2, batch, tokens, d_ff] (the planes dg, du). Returns a Plan with op
    "dgrad_gated" (the fused kernel), op "dgrad" (a kernel dgrad plus an XLA pass) or an
    XLA plan; the rule is plan_gated's. epilogue: whether the fused kernel may be planned
    (None: GATE_GRAD_EPILOGUE_ENABLED).
    """
    block = overrides.active()
    base = choose.plan_with(
        block, "dgrad", tokens=tokens, d_in=d_ff, d_out=d_out, batch=batch, device=device, tile_rows=False
    )
    if epilogue is None:
        epilogue = GATE_GRAD_EPILOGUE_ENABLED
    return _with_epilogue(
        base, block, GATE_GRAD_OP, f"gate_grad_{activation}", d_ff, activation, epilogue, "d[gate|up] from dh and gu"
    )


def _with_epilogue(
    base: Plan,
    block: overrides.Pins | None,
    op: str,
    store: str,
    d_ff: int,
    activation: str,
    epilogue: bool,
    what: str,
) -> Plan:
    """base (the plain GEMM's plan, planned under the force block `block`) turned into
    op's on the gated tile where epilogue (the caller's resolved switch) allows it, or base
    itself with the reason the epilogue runs as an XLA pass (module docstring)."""
    if not base.uses_kernel:
        return base
    program = base.program
    pins = overrides.for_gemm(block, base.op, base.m, base.n, base.k)
    pinned = pins is not None and (pins.tile is not None or pins.schedule is not None)
    reason = None
    if not epilogue:
        reason = "the gated kernel epilogue is switched off"
    elif d_ff % contract.GATE_BLOCK != 0:
        reason = f"d_ff = {d_ff} is not a multiple of {contract.GATE_BLOCK} (the kernels' gate/up interleave)"
    elif not choose.is_wide_tile(base.tile) and not pinned:
        reason = f"the planner's {base.tile[0]}x{base.tile[1]} tiles (the epilogue runs on the {_GATED_TILE_NAME} tile)"
    else:
        # A force() pin keeps the pinned tile; else the wide ping-pong tile.
        tile, schedule = (base.tile, base.schedule) if pinned else (GATED_TILE, GATED_SCHEDULE)
        for cluster in dict.fromkeys((base.cluster, (1, 1))):
            if variants.find_variant(program, tile, cluster, "bfloat16", store, schedule) is None:
                continue
            return dataclasses.replace(
                base,
                op=op,
                tile=tile,
                cluster=cluster,
                schedule=schedule,
                reason=(
                    (
                        base.reason
                        if pinned or (base.tile, base.schedule) == (tile, schedule)
                        else f"{base.reason}; for the epilogue the {_GATED_TILE_NAME} tile instead"
                    )
                    + f"; the {activation} epilogue in the kernel: " + what.format(act=activation)
                ),
            )
        reason = f"no compiled {store} variant of the {tile[0]}x{tile[1]} {schedule} tile"
    logs.once(
        logging.INFO,
        "jax_cake: the gated epilogue of the %s GEMM %s on %s runs as an XLA pass after it: %s",
        program,
        f"{base.batch}x{base.m}x{base.k}->{base.n}",
        base.device,
        reason,
    )
    return dataclasses.replace(base, reason=f"{base.reason}; then an XLA pass ({reason})")


def plan_gate_up_dgrad(base: Plan, block: int) -> Plan:
    """The gated projection's dx = dg Wg + du Wu as one kernel over K = 2F that reads the
    cotangent's halves dg, du and the interleaved weight's gate and up rows in place (op
    "dgrad_gate_up", jax_cake_dgrad_gate_up), or base itself.

    base: the plain dgrad's plan for that GEMM (dy [batch, T, 2F], W [batch, 2F, d_in]),
    planned with tile_rows=False (module docstring);
    block: the weight's gate/up interleave (pipeline.gated: contract.GATE_BLOCK, or 1 where
    d_ff is not a multiple of it or the operands need partitioning). The kernel reads
    blocks of contract.GATE_BLOCK and runs base's tile, cluster and schedule where a
    "gate_up_halves" variant of them is compiled; it sums the gate half's K tiles, then the
    up half's (the plain dgrad over the interleaved cotangent sums them in W's row order:
    the same FP32 sum in another order). Elsewhere (one log line says why) XLA interleaves
    dg and du and base's dgrad runs over that.
    """
    if not GATE_UP_DGRAD_ENABLED or not base.uses_kernel or base.op != "dgrad" or base.splits != 1:
        return base
    reason = None
    if block != contract.GATE_BLOCK:
        reason = f"the weight is interleaved row by row, not in blocks of {contract.GATE_BLOCK}"
    elif variants.find_variant("dgrad", base.tile, base.cluster, "bfloat16", "gate_up_halves", base.schedule) is None:
        (tm, tn, _), (cm, cn) = base.tile, base.cluster
        reason = f"no gate_up_halves variant of the {tm}x{tn} {base.schedule} tile, cluster {cm}x{cn}"
    if reason is not None:
        logs.once(
            logging.INFO,
            "jax_cake: the gated projection's dx %s on %s runs over its cotangent interleaved by an XLA pass: %s",
            f"{base.batch}x{base.m}x{base.k}->{base.n}",
            base.device,
            reason,
        )
        return dataclasses.replace(base, reason=f"{base.reason}; dg and du interleaved by an XLA pass first ({reason})")
    return dataclasses.replace(
        base,
        op=GATE_UP_DGRAD_OP,
        reason=f"{base.reason}; reads dg, du and the weight's gate and up rows in place (K: gate half, then up half)",
    )
