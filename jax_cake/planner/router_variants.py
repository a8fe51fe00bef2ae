"""The AOT-compiled variants of the fused BF16x3 router GEMM: plain data, no cutlass import.

`jax_cake/kernels/router_bf16x3_sm90.py:export_router_kernels` compiles exactly these;
the planner may import this module at run time to know which (program, tile) the
native library can run. An FFI call naming anything else gets INVALID_ARGUMENT.

GEMM convention (as docs/ffi_contract.md, no batch): C[M, N] = sum_k A[m, k] B[n, k],
logical operands and the output float32, each product done as BF16x3
(a_hi b_hi + a_hi b_lo + a_lo b_hi, fp32 accumulation, hi = bf16(a), lo = bf16(a - hi)).
  fwd:   A = x [T, d] K-major,               B = w [E, d] K-major,               C = logits [T, E]
  dgrad: A = g [T, E] K-major,               B = w viewed [N=d, K=E] N-major,    C = dx [T, d]
  wgrad: A = x viewed [M=d, K=T] M-major,    B = g viewed [N=E, K=T] N-major,    C = dw^T [d, E]
         (TRANSPOSED: dw^T = x^T g, C M-major, i.e. dw [E, d] row-major; splits > 1: fp32
         partials [splits, E, d] in the workspace + the ordered reduce)

Where the split happens (PRESPLIT, in FFI operand order): the activation x (T x d, the big
operand) is read as fp32 and split on chip. The weight w and the logit gradient g are small next to it and
every CTA column re-reads them, so the caller splits them once per call into bf16 hi and
lo arrays (jax_cake.primitives does it in XLA: ~4 MB for w, ~16 MB for g at T = 16384),
and the kernel TMA-loads those straight into its bf16 ring: no split work per CTA.

Constraints the kernels rely on (the planner falls back to XLA otherwise):
  d and E multiples of 8 (16-byte TMA row strides for the bf16 hi/lo arrays), T >= 1
  any value, E <= 65535 * tile_m etc. (grid limits, never hit in practice).
"""

from __future__ import annotations

import dataclasses

from jax_cake.contract import REDUCTION_NONE, REDUCTION_ORDERED  # the `reduction` codes
from jax_cake.planner.variants import PROGRAM_MAJORS  # the router's operands sit as the GEMM's

# wgrad runs transposed (dw^T = x^T g): x, the operand split on chip, is then the kernel's
# A, which wgmma can take from registers as in fwd (A in registers, see a_in_registers).
TRANSPOSED = frozenset({"wgrad"})

# Which FFI operands arrive pre-split as bf16 (hi, lo) pairs, in the handler's operand order
# (fwd: x, w; dgrad: g, w; wgrad: g, x). RouterVariant.a_presplit / b_presplit map this to
# the kernel's A and B (swapped where TRANSPOSED).
PRESPLIT = {
    "fwd": (False, True),  # x split on chip, w pre-split
    "dgrad": (True, True),  # g and w pre-split: the kernel only runs the three wgmma
    "wgrad": (True, False),  # g pre-split, x split on chip
}

# Row-stride alignment (elements) of every router operand: 16 bytes of bf16.
ALIGN_ELEMENTS = 8

# The router's reductions: none, or ordered (fp32 partials [splits, E, d] + the reduce pass
# in split order). Arrival-order split-K is not built for the router: it is always
# deterministic.


@dataclasses.dataclass(frozen=True)
class RouterVariant:
    """One compiled BF16x3 kernel: program and CTA tile (M, N, K). Serves every M/N/K."""

    program: str
    tile_m: int
    tile_n: int
    tile_k: int = 32

    @property
    def a_major(self) -> str:
        return PROGRAM_MAJORS[self.program][0]

    @property
    def b_major(self) -> str:
        return PROGRAM_MAJORS[self.program][1]

    @property
    def transposed(self) -> bool:
        return self.program in TRANSPOSED

    @property
    def a_presplit(self) -> bool:
        """Whether the kernel's A operand arrives pre-split (PRESPLIT is in FFI operand order)."""
        return PRESPLIT[self.program][1 if self.transposed else 0]

    @property
    def b_presplit(self) -> bool:
        return PRESPLIT[self.program][0 if self.transposed else 1]

    @property
    def c_major(self) -> str:
        return "m" if self.transposed else "n"

    @property
    def a_in_registers(self) -> bool:
        """fwd and wgrad (A = x, split on chip): the MMA warpgroups load their x fragment
        (fp32) from shared memory, split it in registers and feed wgmma's A from registers
        (RS). The split's bf16 tiles then never go through shared memory (96 KB of traffic
        per 128x128x32 K tile against 136 KB for a split into shared memory)."""
        return not self.a_presplit

    @property
    def tile(self) -> tuple[int, int, int]:
        return (self.tile_m, self.tile_n, self.tile_k)

    @property
    def name(self) -> str:
        """Unique C identifier, also the exported object's file name."""
        return f"jax_cake_router_{self.program}_{self.tile_m}x{self.tile_n}x{self.tile_k}"


# tile_n is at most 128: each MMA thread holds two 64 x tile_n fp32 accumulators (the
# wgmma chain of one K tile and the promoted fp32 total, see router_bf16x3_sm90.py).
# fwd: N = E (E = 256 takes two N tiles, x is read twice, from L2 the second time).
# dgrad: N = d is large, K = E. wgrad: M = E, N = d, K = T, split-K over T.
VARIANTS: tuple[RouterVariant, ...] = (
    RouterVariant("fwd", 128, 128),
    RouterVariant("dgrad", 128, 128),
    RouterVariant("wgrad", 128, 128),
)


def find_variant(program: str, tile) -> RouterVariant | None:
    """The compiled variant with this program and tile, or None."""
    for v in VARIANTS:
        if v.program == program and v.tile == tuple(tile):
            return v
    return None


def supports(program: str, tile, splits: int, reduction: int) -> bool:
    """Whether the native library can run this (program, tile, split-K) combination."""
    if find_variant(program, tile) is None:
        return False
    if splits == 1:
        return reduction == REDUCTION_NONE
    return program == "wgrad" and splits > 1 and reduction == REDUCTION_ORDERED


def workspace_bytes(splits: int, reduction: int, e: int, d: int) -> int:
    """Workspace of jax_cake_router_wgrad (at least 16 bytes so the arity stays fixed)."""
    need = splits * e * d * 4 if (reduction == REDUCTION_ORDERED and splits > 1) else 0
    return max(need, 16)
