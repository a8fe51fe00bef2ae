"""Shared machinery of the GPU tests: fixed-seed inputs, float64 references, and the
FFI targets called directly on NaN-poisoned output memory.

The FFI targets are called through `jax.ffi.ffi_call` with explicit attributes (tile,
splits, reduction, raster, cluster, schedule), so every compiled program is exercised
independently of the planner. Outputs are poisoned: every call donates a NaN-filled
buffer of the output's shape, which XLA aliases to the custom call's result, so an
element the kernel fails to write stays NaN and fails the check. A compiled program that
does not alias the donated buffer to the result raises (the check would otherwise pass
on fresh memory).

The random inputs, the float64 conversion and the relative error are tests/helpers.py's
(rand, f64, rel_err_nonfinite, rel_err), imported here so the GPU tests reach them as h.*.

Importing this module starts no backend and needs neither a GPU nor the library.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from jax_cake import contract, primitives
from jax_cake.planner import router_variants, variants

from helpers import f64, rand, rel_err, rel_err_nonfinite  # noqa: F401 (the tests' h.f64, h.rel_err)

BF16 = jnp.bfloat16
F32 = jnp.float32
F64 = jnp.float64

# The accuracy contract: bf16 outputs 1e-2, fp32 dw 1e-5 (the tuner gives a plan table row
# only to a program within it: benchmarks/plan_rule.py, which test_gpu_machinery.py holds to
# these numbers).
BF16_TOL = 1e-2
F32_TOL = 1e-5
ROUTER_TOL = 5e-6  # the router's accuracy target (XLA's BF16_BF16_F32_X3 is at ~4.4e-6)

# The one tile every router program is compiled with (router_variants.VARIANTS).
ROUTER_TILE = (128, 128, 32)
REPEATS = 20  # runs of a deterministic program that must agree bit for bit

_DTYPES = {"bfloat16": BF16, "float32": F32}


def dtype_of(name: str):
    return _DTYPES[name]


# ------------------------------------------------------------------ fixed seeds
def seed_of(*parts) -> int:
    """A constant seed derived from a case's description (never from the time)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


@functools.lru_cache(maxsize=2)
def gemm_inputs(B: int, T: int, d_in: int, d_out: int):
    """(x [B, T, d_in], w [B, d_out, d_in], dy [B, T, d_out]) in bf16, fixed per shape."""
    shape = (B, T, d_in, d_out)
    return (
        rand(seed_of("x", *shape), (B, T, d_in)),
        rand(seed_of("w", *shape), (B, d_out, d_in)),
        rand(seed_of("dy", *shape), (B, T, d_out)),
    )


@functools.lru_cache(maxsize=2)
def router_inputs(T: int, d: int, E: int):
    """(x [T, d], w [E, d] scaled 0.02, g [T, E]) in fp32, fixed per shape."""
    return (
        rand(seed_of("rx", T, d, E), (T, d), F32),
        rand(seed_of("rw", T, d, E), (E, d), F32, 0.02),
        rand(seed_of("rg", T, d, E), (T, E), F32),
    )


# ------------------------------------------------------------------ float64 references
@functools.partial(jax.jit, static_argnames="spec")
def _einsum64(a, b, spec):
    return jnp.einsum(spec, a.astype(F64), b.astype(F64), precision=jax.lax.Precision.HIGHEST)


def ref64(spec: str, a, b):
    """einsum(spec, a, b) in float64 on a's device (exact products of bf16/fp32 inputs)."""
    with jax.enable_x64(True):
        return _einsum64(a, b, spec=spec)


# einsum specs of the three GEMMs, batched (x [B, T, d_in], w [B, d_out, d_in], dy [B, T, d_out])
FWD = "btk,bnk->btn"  # y = x w^T
DGRAD = "btn,bnk->btk"  # dx = dy w
WGRAD = "btn,btk->bnk"  # dw = dy^T x
# the same without the batch axis (x [T, d_in], w [d_out, d_in], dy [T, d_out])
FWD2 = "tk,nk->tn"
DGRAD2 = "tn,nk->tk"
WGRAD2 = "tn,tk->nk"


def assert_close(out, ref, tol: float, what: str = "") -> float:
    """out matches the float64 reference within tol, with no NaN/Inf (an unwritten poisoned
    element is a NaN). Returns the error."""
    err, bad = rel_err_nonfinite(out, ref)
    assert bad == 0 and err < tol, f"{what} rel_err={err:.2e} (tol {tol:.0e}) nonfinite={bad}"
    return err


@jax.jit
def _same_bits(a, b):
    def bits(v):
        if v.dtype.itemsize == 2:
            return jax.lax.bitcast_convert_type(v, jnp.uint16)
        return jax.lax.bitcast_convert_type(v, jnp.uint32)

    return jnp.array_equal(bits(a), bits(b))


def same_bits(a, b) -> bool:
    """Bitwise equality (NaN payloads and signed zeros included)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(_same_bits(a, b))


def assert_repeatable(run, runs: int = REPEATS, what: str = ""):
    """run() gives the same bits `runs` times in a row. Returns the first result."""
    first = run()
    same = 1 + sum(same_bits(first, run()) for _ in range(runs - 1))
    assert same == runs, f"{what} only {same}/{runs} runs bitwise identical to the first"
    return first


# ------------------------------------------------------------------ poisoned calls
@functools.lru_cache(maxsize=None)
def _donating(body):
    def run(poison, *operands):
        return body(jax.ShapeDtypeStruct(poison.shape, poison.dtype), *operands)

    # keep_unused: the body never reads the poison, and jit would otherwise drop the unused
    # argument, and its donation with it, so the result would land in fresh memory.
    return jax.jit(run, donate_argnums=0, keep_unused=True)


# The compiled module aliases parameter 0 (the poison) to the whole result.
_ALIASED = re.compile(r"input_output_alias=\{ \{\}: \(0, \{\}")
_COMPILED: dict = {}


def run_poisoned(body, shape, dtype, *operands):
    """body(result_type, *operands) computed into a donated NaN-filled buffer of `shape`.

    `body` must be hashable and stable (its compiled program is cached on it and the
    operand types). Raises AssertionError if the compiled program does not alias the
    donated buffer to the result: the poison would then not be the output memory and an
    unwritten element could pass.
    """
    poison = jnp.full(shape, jnp.nan, dtype)
    types = tuple((tuple(o.shape), jnp.dtype(o.dtype).name) for o in operands)
    key = (body, tuple(shape), jnp.dtype(dtype).name, types)
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = _donating(body).lower(poison, *operands).compile()
        if not _ALIASED.search(compiled.as_text()):
            raise AssertionError("the NaN-filled output buffer is not aliased to the result in the compiled program")
        _COMPILED[key] = compiled
    return compiled(poison, *operands)


@functools.cache
def sm_count() -> int:
    """SMs of the GPU the split-tail workspace is sized for (the FFI handler uses the same)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def ffi_attrs(tile, splits=1, reduction=0, raster=0, cluster=(1, 1), schedule: str = "tiles") -> dict:
    """The GEMM targets' attributes. A split tail (reduction 3) has the split_tail schedule."""
    if reduction == contract.REDUCTION_SPLIT_TAIL:
        schedule = "split_tail"
    return dict(
        schedule=np.int64(contract.SCHEDULES[schedule]),
        tile_m=np.int64(tile[0]),
        tile_n=np.int64(tile[1]),
        tile_k=np.int64(tile[2]),
        cluster_m=np.int64(cluster[0]),
        cluster_n=np.int64(cluster[1]),
        splits=np.int64(splits),
        reduction=np.int64(reduction),
        raster=np.int64(raster),
    )


@functools.lru_cache(maxsize=None)
def _gemm_body(target: str, ws_bytes: int, attrs_key: tuple):
    attrs = dict(attrs_key)

    def body(result, a, b):
        if target == contract.WGRAD_TARGET:
            outs = (result, jax.ShapeDtypeStruct((ws_bytes,), jnp.uint8))
            return jax.ffi.ffi_call(target, outs)(a, b, **attrs)[0]
        return jax.ffi.ffi_call(target, result)(a, b, **attrs)

    return body


def gemm_out_shape(target: str, a, b) -> tuple[int, int, int]:
    B = a.shape[0]
    if target == contract.FWD_TARGET:  # x [B, T, d_in], w [B, d_out, d_in]
        return (B, a.shape[1], b.shape[1])
    if target == contract.DGRAD_TARGET:  # dy [B, T, d_out], w [B, d_out, d_in]
        return (B, a.shape[1], b.shape[2])
    return (B, a.shape[2], b.shape[2])  # wgrad: dy [B, T, d_out], x [B, T, d_in]


def call(
    target, a, b, *, tile, out_dtype=BF16, splits=1, reduction=0, raster=0, cluster=(1, 1), schedule="tiles"
):
    """Runs one GEMM FFI target on NaN-poisoned output memory; returns the result."""
    shape = gemm_out_shape(target, a, b)
    ws = 16
    if target == contract.WGRAD_TARGET:
        ws = variants.workspace_bytes(
            splits, reduction, shape[0], shape[1], shape[2], jnp.dtype(out_dtype).name, tile=tile, sm_count=sm_count()
        )
    attrs = ffi_attrs(tile, splits, reduction, raster, cluster, schedule)
    key = tuple(sorted((k, int(v)) for k, v in attrs.items()))
    return run_poisoned(_gemm_body(target, ws, key), shape, out_dtype, a, b)


# ------------------------------------------------------------------ router calls
def router_attrs(tile, splits=1, reduction=0) -> dict:
    return dict(
        tile_m=np.int64(tile[0]),
        tile_n=np.int64(tile[1]),
        tile_k=np.int64(tile[2]),
        splits=np.int64(splits),
        reduction=np.int64(reduction),
    )


@functools.lru_cache(maxsize=None)
def _router_body(target: str, ws_bytes: int, attrs_key: tuple):
    attrs = dict(attrs_key)
    program = target[len("jax_cake_router_") :]

    def body(result, a, b):
        # The split of the pre-split operands runs in the same jit, as in primitives.
        operands = primitives.router_ffi_operands(program, a, b)
        if program == "wgrad":
            outs = (result, jax.ShapeDtypeStruct((ws_bytes,), jnp.uint8))
            return jax.ffi.ffi_call(target, outs)(*operands, **attrs)[0]
        return jax.ffi.ffi_call(target, result)(*operands, **attrs)

    return body


def router_call(target, a, b, *, tile=ROUTER_TILE, splits=1, reduction=0):
    """One router FFI call on NaN-poisoned output memory; a, b the logical fp32 operands."""
    if target == contract.ROUTER_FWD_TARGET:  # x [T, d], w [E, d] -> [T, E]
        shape = (a.shape[0], b.shape[0])
    elif target == contract.ROUTER_DGRAD_TARGET:  # g [T, E], w [E, d] -> [T, d]
        shape = (a.shape[0], b.shape[1])
    else:  # g [T, E], x [T, d] -> [E, d]
        shape = (a.shape[1], b.shape[1])
    ws = router_variants.workspace_bytes(splits, reduction, shape[0], shape[1]) if target.endswith("wgrad") else 16
    key = tuple(sorted((k, int(v)) for k, v in router_attrs(tile, splits, reduction).items()))
    return run_poisoned(_router_body(target, ws, key), shape, F32, a, b)


# ------------------------------------------------------------------ simple plans
def fwd_tile(d_out):
    return (128, 64, 64) if d_out <= 128 else (128, 256, 64)


def dgrad_tile(d_in):
    return (128, 256, 64) if d_in >= 1024 else (128, 128, 64)


def wgrad_tile(d_out):
    return (64, 128, 64) if d_out <= 64 else (128, 128, 64)


def wgrad_splits(B, T, d_out, d_in, sms: int = 132):
    """Enough splits to give every SM a CTA, keeping >= 8 K tiles per split."""
    tm, tn, tk = wgrad_tile(d_out)
    tiles = B * math.ceil(d_out / tm) * math.ceil(d_in / tn)
    k_tiles = math.ceil(T / tk)
    return max(1, min(sms // tiles, k_tiles // 8))


# wgrad tiles compiled for bf16 dw only (no fp32 register-total variant of the tile).
BF16_ONLY_WGRAD_TILES = tuple(
    sorted(
        {
            v.tile
            for v in variants.VARIANTS
            if v.program == "wgrad" and v.out_dtype == "bfloat16" and v.cluster == (1, 1) and v.grouping is None
        }
        - {
            v.tile
            for v in variants.VARIANTS
            if v.program == "wgrad" and v.out_dtype == "float32" and v.promote_in == "registers"
        }
    )
)


# ------------------------------------------------------------------ the public API
def api_vjp(op, x, w, dy, **kw):
    y, vjp = jax.vjp(lambda x, w: op(x, w, **kw), x, w)
    return (y,) + vjp(dy)


def custom_calls(lowered_text: str, target: str) -> int:
    """How many custom calls to `target` a lowered (StableHLO) text holds."""
    return lowered_text.count(f"custom_call @{target}(")


@dataclasses.dataclass(frozen=True)
class DenseCase:
    """dense_projection(x [T, d_in], w [d_out, d_in], deterministic=det) under jit + grad."""

    T: int
    d_in: int
    d_out: int
    w_dtype: str
    det: bool

    @property
    def id(self):
        w = {"bfloat16": "bf16", "float32": "f32"}[self.w_dtype]
        return f"T{self.T}_{self.d_in}to{self.d_out}_w{w}_{'det' if self.det else 'nondet'}"


DENSE_CASES = [
    DenseCase(16172, 4096, 48, "float32", True),
    DenseCase(16231, 5120, 512, "float32", False),
    DenseCase(16384, 4096, 1024, "bfloat16", True),
    # compute bound: CTA pairs (cluster 2x1) in all three GEMMs, ordered splits that fill
    # the last wave in wgrad (3 at 5120 -> 512, 2 at 5120 -> 1024)
    DenseCase(16384, 4096, 4096, "float32", True),
    DenseCase(16384, 5120, 512, "float32", True),
    DenseCase(16172, 5120, 1024, "bfloat16", True),
    DenseCase(1011, 256, 64, "bfloat16", False),
    DenseCase(37, 64, 32, "float32", True),
]


@functools.lru_cache(maxsize=1)
def dense_inputs(case: DenseCase):
    shape = (case.T, case.d_in, case.d_out, case.w_dtype)
    return (
        rand(seed_of("api_x", *shape), (case.T, case.d_in)),
        rand(seed_of("api_w", *shape), (case.d_out, case.d_in), dtype_of(case.w_dtype)),
        rand(seed_of("api_dy", *shape), (case.T, case.d_out)),
    )


@functools.cache
def dense_step(det: bool):
    """jit(vjp of dense_projection): (x, w, dy) -> (y, dx, dw). One jit per det value, so
    the tests share its compiled programs (the planner runs when it traces)."""
    import jax_cake

    return jax.jit(functools.partial(api_vjp, jax_cake.dense_projection, deterministic=det))


ROUTER_API_SHAPES = [(16384, 4096), (16231, 7168), (37, 512)]  # T, d; E = 256


@functools.lru_cache(maxsize=1)
def router_api_inputs(T: int, d: int, E: int = 256):
    """(x [T, d], w [E, d] scaled 0.05, g [T, E]) in fp32 for router_logits."""
    suffix = () if E == 256 else (E,)  # the E = 256 cases keep their seeds
    return (
        rand(seed_of("api_router_x", T, d, *suffix), (T, d), F32),
        rand(seed_of("api_router_w", T, d, *suffix), (E, d), F32, 0.05),
        rand(seed_of("api_router_g", T, d, *suffix), (T, E), F32),
    )


@functools.cache
def router_step():
    import jax_cake

    return jax.jit(functools.partial(api_vjp, jax_cake.router_logits))


# ------------------------------------------------------------------ the CUDA-graph chain
GRAPH_SHAPE = (4096, 1024, 256)  # T, d_in, d_out
GRAPH_WGRAD_SPLITS = 4


def make_graph_chain(T: int, d_in: int, d_out: int):
    """A jit-able chain of 12 custom calls (4 x fwd, dgrad, ordered split-K wgrad), each
    feeding the next; XLA runs such a sequence as one command buffer (CUDA graph)."""
    a_fwd = ffi_attrs(fwd_tile(d_out))
    a_dg = ffi_attrs(dgrad_tile(d_in))
    a_wg = ffi_attrs(wgrad_tile(d_out), splits=GRAPH_WGRAD_SPLITS, reduction=contract.REDUCTION_ORDERED)
    ws = variants.workspace_bytes(GRAPH_WGRAD_SPLITS, contract.REDUCTION_ORDERED, 1, d_out, d_in, "float32")

    def graph_chain(x, w):
        outs = []
        for _ in range(4):
            y = jax.ffi.ffi_call(contract.FWD_TARGET, jax.ShapeDtypeStruct((1, T, d_out), BF16))(x, w, **a_fwd)
            dx = jax.ffi.ffi_call(contract.DGRAD_TARGET, jax.ShapeDtypeStruct((1, T, d_in), BF16))(y, w, **a_dg)
            dw, _ = jax.ffi.ffi_call(
                contract.WGRAD_TARGET,
                (jax.ShapeDtypeStruct((1, d_out, d_in), F32), jax.ShapeDtypeStruct((ws,), jnp.uint8)),
            )(y, dx, **a_wg)
            outs.append(dw)
            x = dx
        return outs

    return graph_chain


def graph_inputs():
    T, d_in, d_out = GRAPH_SHAPE
    x = rand(seed_of("graph_x", *GRAPH_SHAPE), (1, T, d_in))
    w = rand(seed_of("graph_w", *GRAPH_SHAPE), (1, d_out, d_in))
    return x, w


def command_buffer_holds_custom_calls(thunk_sequence_text: str) -> bool:
    """Whether a thunk-sequence dump holds a command buffer with the custom calls inside it
    (after the kCommandBuffer thunk, not beside it before)."""
    idx = thunk_sequence_text.find("kCommandBuffer")
    return idx >= 0 and "kCustomCall" in thunk_sequence_text[idx:]
