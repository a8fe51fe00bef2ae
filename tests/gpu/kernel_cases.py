"""The kernel cases of the GPU tests: plain data, built at import without a GPU.

A GemmCase names one FFI call (program, shape, tile, dtype, split-K, raster, cluster,
schedule), a RouterCase one router call; `variant()` is the compiled program a call runs,
so a CPU test can check that the cases cover every entry of the variant lists.

Tiers (`params`): of each case list a test runs, the quick tier keeps one case per
`tier_key` (the compiled program, its reduction, raster and output dtype), the cheapest
that is not slow and fills a tile; every other case is marked `full`. So `pytest -m "gpu and not full"`
still calls every compiled program the list calls, and `pytest -m gpu` runs them all.
"""

from __future__ import annotations

import dataclasses

from jax_cake import contract
from jax_cake.planner import router_variants, variants

import gpu_helpers as h

RED_NAMES = {
    contract.REDUCTION_NONE: "",
    contract.REDUCTION_ORDERED: "ordered",
    contract.REDUCTION_ARRIVAL: "arrival",
    contract.REDUCTION_SPLIT_TAIL: "splittail",
}


@dataclasses.dataclass(frozen=True)
class GemmCase:
    """One GEMM FFI call; `slow` cases run only under -m "gpu and slow"."""

    program: str  # "fwd", "dgrad" or "wgrad"
    shape: tuple[int, int, int, int]  # (B, T, d_in, d_out)
    tile: tuple[int, int, int]
    out_dtype: str = "bfloat16"
    splits: int = 1
    reduction: int = 0
    raster: int = 0
    cluster: tuple[int, int] = (1, 1)
    schedule: str = "tiles"  # "tiles" or "pingpong" (a split tail follows from reduction 3)
    slow: bool = dataclasses.field(default=False, compare=False)
    # fwd only: jax_cake_fwd_residual, y = r + x w^T added by the kernel into r's buffer
    # (the bf16 reduce-add variant of the tile; tests/gpu/test_residual_gpu.py runs these).
    residual: bool = False

    @property
    def target(self) -> str:
        if self.residual:
            return contract.FWD_RESIDUAL_TARGET
        return {"fwd": contract.FWD_TARGET, "dgrad": contract.DGRAD_TARGET, "wgrad": contract.WGRAD_TARGET}[self.program]

    @property
    def tol(self) -> float:
        return h.BF16_TOL if self.out_dtype == "bfloat16" else h.F32_TOL

    @property
    def id(self) -> str:
        B, T, d_in, d_out = self.shape
        parts = [self.program + ("_residual" if self.residual else "")]
        if self.program == "wgrad":
            parts.append({"bfloat16": "bf16", "float32": "f32"}[self.out_dtype])
        parts.append(f"{self.tile[0]}x{self.tile[1]}")
        if self.splits > 1 or self.reduction:
            parts.append(f"s{self.splits}{RED_NAMES[self.reduction]}")
        if self.cluster != (1, 1):
            parts.append(f"c{self.cluster[0]}x{self.cluster[1]}")
        if self.raster:
            parts.append(f"raster{self.raster}")
        if self.schedule != "tiles":
            parts.append(self.schedule)
        return "_".join(parts) + f"-B{B}_T{T}_{d_in}to{d_out}"

    @property
    def cost(self) -> int:
        """Multiply-adds of the call (the quick tier takes the cheapest case per tier_key)."""
        B, T, d_in, d_out = self.shape
        return B * T * d_in * d_out

    @property
    def tier_key(self) -> tuple:
        """What the quick tier runs once: the target, the compiled program, how the K
        splits are summed, the raster and the output dtype (the ordered reduce writes it)."""
        return (self.target, self.variant().name, self.reduction, self.raster, self.out_dtype)

    @property
    def fills_a_tile(self) -> bool:
        """At least one whole M x N tile and two K tiles (per split): the main loop runs
        (the quick tier prefers such a case to a one-row or K-below-a-tile edge case)."""
        B, T, d_in, d_out = self.shape
        m, n, k = {"fwd": (T, d_out, d_in), "dgrad": (T, d_in, d_out), "wgrad": (d_out, d_in, T)}[self.program]
        return m >= self.tile[0] and n >= self.tile[1] and k >= 2 * self.tile[2] * self.splits

    def variant(self) -> variants.GemmVariant | None:
        """The compiled program this call runs (None: no such program)."""
        if self.residual:
            return variants.find_variant("fwd", self.tile, self.cluster, "bfloat16", "add", self.schedule)
        if self.program != "wgrad":
            return variants.find_variant(self.program, self.tile, self.cluster, "bfloat16", schedule=self.schedule)
        if self.reduction == contract.REDUCTION_ORDERED:  # fp32 partials, then the ordered reduce
            return variants.find_variant("wgrad", self.tile, self.cluster, "float32")
        if self.reduction == contract.REDUCTION_ARRIVAL:
            return variants.find_variant("wgrad", self.tile, self.cluster, "float32", "add")
        if self.reduction == contract.REDUCTION_SPLIT_TAIL:
            return variants.find_variant("wgrad", self.tile, self.cluster, self.out_dtype, schedule="split_tail")
        return variants.find_variant("wgrad", self.tile, self.cluster, self.out_dtype)

    def operands(self):
        """(a, b) of the call and the einsum spec of its float64 reference."""
        x, w, dy = h.gemm_inputs(*self.shape)
        return {"fwd": (x, w, h.FWD), "dgrad": (dy, w, h.DGRAD), "wgrad": (dy, x, h.WGRAD)}[self.program]

    def run(self):
        a, b, _ = self.operands()
        return h.call(
            self.target,
            a,
            b,
            tile=self.tile,
            out_dtype=h.dtype_of(self.out_dtype),
            splits=self.splits,
            reduction=self.reduction,
            raster=self.raster,
            cluster=self.cluster,
            schedule=self.schedule,
        )


def _dedup(cases):
    seen, out = set(), []
    for c in cases:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def shape_cases(B, T, d_in, d_out, *, extra_splits=(), raster=0, full=True, slow=False):
    """fwd, dgrad, wgrad at one shape with the simple plans: fp32 and bf16 dw without
    split, and (full) with ordered and arrival-order split-K at the auto split count and
    `extra_splits`."""
    shape = (B, T, d_in, d_out)
    cases = [
        GemmCase("fwd", shape, h.fwd_tile(d_out), raster=raster, slow=slow),
        GemmCase("dgrad", shape, h.dgrad_tile(d_in), raster=raster, slow=slow),
    ]
    runs = [(1, 0)]
    if full:
        auto = h.wgrad_splits(B, T, d_out, d_in)
        runs += [(s, r) for s in sorted({auto, *extra_splits}) if s > 1 for r in (1, 2)]
    for splits, red in runs:
        for dt in ("float32", "bfloat16"):
            cases.append(GemmCase("wgrad", shape, h.wgrad_tile(d_out), dt, splits, red, raster=raster, slow=slow))
    return cases


# One tiny ragged shape through every program (the compute-sanitizer target).
TINY = shape_cases(1, 37, 136, 64, extra_splits=(3,))

# Tiny and ragged shapes: one row, 37 rows, B = 2/3, K below one tile, odd N.
SANITY = [
    c
    for shape in (
        (1, 1, 4096, 32),
        (1, 37, 4096, 48),
        (1, 37, 136, 64),
        (2, 300, 520, 264),
        (3, 129, 264, 72),
        (1, 256, 128, 256),
    )
    for c in shape_cases(*shape, extra_splits=(3, 7))
]


def _tile_cases():
    """raster = 1, and every tile of every program at one ragged shape."""
    cases = shape_cases(1, 1000, 1024, 520, raster=1, extra_splits=(2,))
    shape = (1, 777, 1032, 200)
    cases += [GemmCase("fwd", shape, t) for t in ((128, 256, 64), (128, 128, 64), (128, 64, 64))]
    cases += [GemmCase("dgrad", shape, t) for t in ((128, 256, 64), (128, 128, 64))]
    # N = 1032 leaves a ragged last N tile for each of these (160 included).
    for t in ((64, 128, 64), (128, 128, 64), (128, 160, 64)):
        for splits, red in ((1, 0), (3, 1)):
            for dt in ("float32", "bfloat16"):
                cases.append(GemmCase("wgrad", shape, t, dt, splits, red))
    # bf16-only wgrad tiles (no fp32 register variant: splits = 1 only), e.g. 128 x 256.
    for t in h.BF16_ONLY_WGRAD_TILES:
        for r in (0, 1):
            cases.append(GemmCase("wgrad", shape, t, "bfloat16", raster=r))
    return cases


TILES = _tile_cases()


def _seed_grid():
    """T x d_in x d_out, every program, against float64. T = 16172 runs by default, the
    other two T only with the `slow` marker."""
    cases = []
    for T in (16172, 16231, 16384):
        for d_in in (4096, 5120):
            for d_out in (32, 48, 64, 512, 1024, 4096):
                cases += shape_cases(1, T, d_in, d_out, full=(T != 16231 or d_out <= 512), slow=T != 16172)
    return cases


SEED_GRID = _seed_grid()


def _split_tail():
    """Split-tail wgrad (reduction 3) of every split-tail variant: tails of fewer tiles than
    SMs (every tile cut), a full wave plus a tail (whole-wave fp32 tiles promoting into
    dw), batch 2, pieces of one K tile, and the planner's 5120 -> 1024 / 512 cases."""
    cases = []
    for B, T, d_in, d_out, splits in (
        (1, 777, 1032, 200, 4),  # 13 K tiles: pieces of 4, 4, 4, 1
        (2, 300, 520, 264, 3),
        (1, 4096, 4096, 1024, 2),  # 128 x 256: all 128 tiles in the tail, 256 pieces in two waves
        (1, 16172, 5120, 1024, 4),
        (1, 16384, 5120, 512, 3),
        (1, 2000, 8192, 2560, 2),  # 128 x 128 tiles would be 1280: a tail of 92 over 9 waves
    ):
        for v in variants.VARIANTS:
            if v.schedule == "split_tail":
                cases.append(
                    GemmCase("wgrad", (B, T, d_in, d_out), v.tile, v.out_dtype, splits, contract.REDUCTION_SPLIT_TAIL)
                )
    return cases


SPLIT_TAIL = _split_tail()


def _promote_to_output():
    """fp32 wgrad adding its chains of P = OUTPUT_PROMOTE_EVERY K tiles into dw by TMA:
    where the chains end (1, P / 2 and P K tiles: one chain, stored plainly; P + 1,
    2P + 5 rows past, 3P: a chain every P K tiles, then the rest reduce-added), ragged
    M / N edges, batch 2, more tiles than CTAs, and long K."""
    P = variants.OUTPUT_PROMOTE_EVERY
    tiles = [
        v.tile
        for v in variants.VARIANTS
        if v.program == "wgrad" and v.promote_in == "output" and v.schedule == "tiles"
    ]
    shapes = (
        (1, 37, 264, 136),
        (1, 64 * (P // 2), 520, 200),
        (1, 64 * P, 1032, 264),
        (2, 64 * (P + 1) + 5, 264, 136),
        (1, 64 * 2 * P + 5, 520, 264),
        (1, 64 * 3 * P, 520, 264),
        (1, 64 * (P + 1), 4096, 2048),  # 256 tiles on 132 CTAs
        (1, 16384, 4096, 1024),
        (1, 16231, 5120, 520),
    )
    return [GemmCase("wgrad", s, t, "float32") for s in shapes for t in tiles]


PROMOTE_TO_OUTPUT = _promote_to_output()


def _pingpong():
    """Every ping-pong fwd/dgrad variant (128 x 128, and the wider 128 x 160 / 128 x 192
    whose warpgroups share the epilogue ring; some in CTA pairs): ragged edges (odd M tile
    counts leave a pair's second tile out of range; N = 1032, 520, 264, 200 leave a ragged
    last N tile for each width), one tile per CTA (warpgroup 1 idle), and many tiles per
    CTA in both parities, the last at a Llama shape (8192 x 4096 -> 1024 / 14336 -> 4096
    dgrad)."""
    cases = []
    shapes = ((1, 777, 1032, 200), (2, 300, 520, 264), (1, 300, 4096, 48), (1, 4096, 1024, 512), (1, 16384, 4096, 512))
    pp = [v for v in variants.VARIANTS if v.schedule == "pingpong" and v.store == "plain"]
    for shape in shapes:
        for v in pp:
            for raster in (0, 1):
                cases.append(GemmCase(v.program, shape, v.tile, raster=raster, cluster=v.cluster, schedule="pingpong"))
    for v in pp:
        if v.tile_n != 128:
            cases.append(GemmCase(v.program, (1, 8192, 4096, 1024), v.tile, raster=1, cluster=v.cluster, schedule="pingpong"))
    return cases


PINGPONG = _pingpong()


def _clusters():
    """Cluster (2, 1) variants with B multicast: odd M-tile counts, batches, split-K."""
    cases = []
    c2 = (2, 1)
    for shape in ((1, 16172, 4096, 512), (1, 37, 1024, 264), (3, 300, 520, 1032), (1, 16384, 5120, 1024)):
        for r in (0, 1):
            cases.append(GemmCase("fwd", shape, (128, 256, 64), raster=r, cluster=c2))
            cases.append(GemmCase("dgrad", shape, (128, 256, 64), raster=r, cluster=c2))
        for splits, red in ((1, 0), (3, 1)):
            for dt in ("float32", "bfloat16"):
                cases.append(GemmCase("wgrad", shape, (128, 128, 64), dt, splits, red, cluster=c2))
    return cases


CLUSTERS = _clusters()

def _bands():
    """Tiles walked in bands of cluster rows (raster codes >= 2): 7 M tiles in bands of 3
    (a short last band), batch 2, a band wider than M, and many tiles per CTA at a Llama
    width in bands of 8, on the cooperative, CTA-pair, ping-pong, wgrad (one pass and ordered
    K splits) and split-tail programs."""
    c2 = (2, 1)
    fwd_dgrad = [
        dict(tile=(128, 256, 64)),
        dict(tile=(128, 256, 64), cluster=c2),
        dict(tile=(128, 192, 64), cluster=c2, schedule="pingpong"),
    ]
    cases = []
    for shape, band in (((1, 777, 1032, 200), 3), ((2, 300, 520, 264), 3), ((1, 777, 1032, 200), 64)):
        for program in ("fwd", "dgrad"):
            cases += [GemmCase(program, shape, raster=band, **kw) for kw in fwd_dgrad]
        for dt in ("float32", "bfloat16"):
            cases.append(GemmCase("wgrad", shape, (128, 128, 64), dt, raster=band))
        cases.append(GemmCase("wgrad", shape, (128, 256, 64), "bfloat16", 4, contract.REDUCTION_SPLIT_TAIL, raster=band))
        cases.append(GemmCase("wgrad", shape, (128, 128, 64), "float32", 3, contract.REDUCTION_ORDERED, raster=band))
    for program in ("fwd", "dgrad"):
        cases += [GemmCase(program, (1, 8192, 4096, 2048), raster=8, **kw) for kw in fwd_dgrad]
    return cases


BANDS = _bands()


def _residual():
    """The residual add (jax_cake_fwd_residual) on every reduce-add fwd tile: one row, K
    below one tile, ragged M / N edges, batches, the M-first, N-first and band walks, and the
    down projection of a Llama-3-8B-shaped block (8192 x 14336 -> 4096) in bands of 8."""
    tiles = [v.tile for v in variants.VARIANTS if v.program == "fwd" and v.store == "add"]
    cases = []
    for shape in ((1, 1, 4096, 32), (1, 37, 136, 64), (1, 777, 1032, 200), (2, 300, 520, 264), (3, 129, 264, 72)):
        for t in tiles:
            for raster in (0, 1, 3, 8):
                cases.append(GemmCase("fwd", shape, t, raster=raster, residual=True))
    for t in tiles:
        cases.append(GemmCase("fwd", (1, 8192, 14336, 4096), t, raster=8, residual=True))
    return cases


# Checked against float64 r + x w^T by tests/gpu/test_residual_gpu.py (their input r is
# not poisoned memory, so they are not among the cases below).
RESIDUAL_CASES = _residual()

# Every case checked against float64, each once (the groups overlap in places).
ALL_VALUE_CASES = _dedup(
    TINY + SANITY + TILES + SEED_GRID + SPLIT_TAIL + PROMOTE_TO_OUTPUT + PINGPONG + CLUSTERS + BANDS
)


def _ordered_determinism():
    """Ordered split-K at the seed-grid shapes (both dw dtypes) and the split-free fp32
    program: deterministic, so bitwise repeatable."""
    cases = []
    for T, d_in, d_out in ((16172, 4096, 48), (16231, 5120, 512), (16384, 4096, 64)):
        tile = h.wgrad_tile(d_out)
        s = max(2, h.wgrad_splits(1, T, d_out, d_in))
        for dt in ("float32", "bfloat16"):
            cases.append(GemmCase("wgrad", (1, T, d_in, d_out), tile, dt, s, contract.REDUCTION_ORDERED))
        cases.append(GemmCase("wgrad", (1, T, d_in, d_out), tile, "float32"))
    cases.append(GemmCase("wgrad", (1, 16172, 4096, 512), (128, 128, 64), "float32", 2, 1, cluster=(2, 1)))
    return cases


# Deterministic programs run REPEATS times, bitwise equal.
REPEAT_CASES = _dedup(_ordered_determinism() + SPLIT_TAIL + PROMOTE_TO_OUTPUT + PINGPONG + BANDS)

# Arrival-order (atomic) split-K against its ordered twin: not bitwise, within 1e-5.
ATOMIC_CASES = [
    GemmCase("wgrad", c.shape, c.tile, "float32", c.splits, contract.REDUCTION_ARRIVAL)
    for c in _ordered_determinism()
    if c.reduction == contract.REDUCTION_ORDERED and c.out_dtype == "float32" and c.cluster == (1, 1)
]


# ------------------------------------------------------------------ router
@dataclasses.dataclass(frozen=True)
class RouterCase:
    """One router FFI call at (T, d, E) with the one compiled tile."""

    program: str
    T: int
    d: int
    E: int
    splits: int = 1

    @property
    def target(self) -> str:
        return {
            "fwd": contract.ROUTER_FWD_TARGET,
            "dgrad": contract.ROUTER_DGRAD_TARGET,
            "wgrad": contract.ROUTER_WGRAD_TARGET,
        }[self.program]

    def variant(self) -> router_variants.RouterVariant | None:
        return router_variants.find_variant(self.program, h.ROUTER_TILE)

    @property
    def cost(self) -> int:
        return self.T * self.d * self.E

    @property
    def fills_a_tile(self) -> bool:
        return min(self.T, self.d, self.E) >= max(h.ROUTER_TILE[:2])

    @property
    def tier_key(self) -> tuple:
        """The compiled program, and for wgrad whether K is split (the ordered reduce)."""
        return (self.target, self.variant().name, self.splits > 1)

    @property
    def id(self):
        s = f"_s{self.splits}" if self.program == "wgrad" else ""
        return f"{self.program}{s}-T{self.T}_d{self.d}_E{self.E}"

    def run_and_ref(self):
        """(output on poisoned memory, float64 reference)."""
        x, w, g = h.router_inputs(self.T, self.d, self.E)
        target = self.target
        if self.program == "fwd":
            return h.router_call(target, x, w), h.ref64(h.FWD2, x, w)
        if self.program == "dgrad":
            return h.router_call(target, g, w), h.ref64(h.DGRAD2, g, w)
        red = contract.REDUCTION_ORDERED if self.splits > 1 else contract.REDUCTION_NONE
        return h.router_call(target, g, x, splits=self.splits, reduction=red), h.ref64(h.WGRAD2, g, x)


ROUTER_CASES = [
    RouterCase(p, T, d, E, s)
    for T, d, E, splits in (
        (37, 4096, 256, (1, 3)),
        (333, 520, 104, (1, 2)),
        (1000, 1024, 128, (1, 5)),
        (16384, 4096, 256, (1, 4)),
        (16231, 7168, 256, (2,)),
    )
    for p, s in [("fwd", 1), ("dgrad", 1)] + [("wgrad", s) for s in splits]
]


def quick_tier(cases, xfail=()) -> list[int]:
    """Indices of the quick tier's cases of a list: per tier_key, the cheapest case that is
    not slow, whose shape is not an expected failure (`xfail`) and that fills a tile if
    one does; first in list order among equals."""

    def rank(c):
        return (getattr(c, "slow", False), getattr(c, "shape", None) in xfail, not c.fills_a_tile, c.cost)

    best: dict[tuple, int] = {}
    for i, c in enumerate(cases):
        j = best.get(c.tier_key)
        if j is None or rank(c) < rank(cases[j]):
            best[c.tier_key] = i
    return sorted(best.values())


def params(cases, xfail=None):
    """pytest.param per case, id naming the program, tile and shape. Marks: `slow` (the seed
    grid beyond its first T), `full` on every case outside quick_tier(cases), and
    xfail[shape] (a mark, e.g. a strict expected failure) on the cases of that shape."""
    import pytest

    quick = set(quick_tier(cases, xfail or ()))
    out = []
    for i, c in enumerate(cases):
        marks = []
        if getattr(c, "slow", False):
            marks.append(pytest.mark.slow)
        if i not in quick:
            marks.append(pytest.mark.full)
        if xfail and getattr(c, "shape", None) in xfail:
            marks.append(xfail[c.shape])
        out.append(pytest.param(c, id=c.id, marks=tuple(marks)))
    return out
