"""The XLA path: the same GEMMs as the kernels, written with `lax.dot_general`.

Runs on CPU, on GPUs without jax_cake kernels, and for shapes the kernels do not take.
Semantics match the kernels: BF16 operands, FP32 accumulation, one rounding to the
output dtype at the end; the router splits each FP32 operand into hi + lo BF16 parts and
accumulates hi*hi + hi*lo + lo*hi in FP32 (BF16x3). The gated epilogue (SwiGLU /
GeGLU: `gate`, `gate_grad`, and the `interleave`d layout of gate and up) is defined here
too, once, for the XLA pass and for the kernel epilogue that computes the same values.

All GEMMs take a leading batch dimension: x [B, T, d_in], w [B, d_out, d_in],
dy [B, T, d_out] (docs/ffi_contract.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_cake import contract

_F32 = jnp.float32
_BF16 = jnp.bfloat16


def round_once(x, dtype):
    """x rounded once to dtype (to nearest even), a rounding that stays when a later op
    reads the result back in FP32.

    A plain convert does not promise that inside a jit: XLA drops a f32 -> bf16 -> f32
    round trip within a fusion as excess precision (--xla_allow_excess_precision, on by
    default; it does on GPU), so the next op would read the unrounded FP32 value. Measured
    on an H100 with jax 0.11.2 (2026-12-06): moe_mlp's FP32 weight gradients were 2.8e-3
    from the float64 wgrads of its own bf16 intermediates with plain converts, 1.9e-7 with
    the flag off. `reduce_precision` to dtype's bits first is kept by XLA."""
    dtype = jnp.dtype(dtype)
    if x.dtype == dtype:
        return x
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < jnp.finfo(x.dtype).bits:
        info = jnp.finfo(dtype)
        x = lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return x.astype(dtype)


def _bmm(a, b, contract_a: int, contract_b: int, out_dtype):
    """Batched a . b over one contracted axis each, batch axis 0: FP32 accumulation, one
    rounding to out_dtype.

    By construction: the dot asks XLA for its FP32 result and rounds that once, because a
    dot asked for a BF16 result directly is backend- and version-dependent on CPU (jaxlib
    0.10.2 converts the BF16 operands to FP32 and runs an FP32 x FP32 dot, another
    summation order than its BF16 x BF16 -> FP32 dot: a few results land one BF16 step
    away; jaxlib 0.11.2 gives the FP32 dot's bits). On CUDA the dot asks for out_dtype
    directly, where XLA's GEMMs round their FP32 accumulator once (cuBLAS; a Triton GEMM's
    split-K partial sums stay FP32 under XLA's default flags) and write the BF16 result
    themselves, with no FP32 result and convert pass behind it (the plan table's xla rows
    send BF16 forwards and input gradients to this dot on the H200)."""
    dims = (((contract_a,), (contract_b,)), ((0,), (0,)))
    if jnp.dtype(out_dtype) == jnp.dtype(_F32):
        return lax.dot_general(a, b, dims, preferred_element_type=_F32)
    once = lambda a, b: round_once(lax.dot_general(a, b, dims, preferred_element_type=_F32), out_dtype)
    direct = lambda a, b: lax.dot_general(a, b, dims, preferred_element_type=out_dtype)
    return lax.platform_dependent(a, b, default=once, cuda=direct)


def fwd(x, w, out_dtype=_BF16):
    """y[B, T, d_out] (bf16, or out_dtype) = x[B, T, d_in] . w[B, d_out, d_in]^T."""
    return _bmm(x, w, 2, 2, out_dtype)


def dgrad(dy, w, out_dtype=_BF16):
    """dx[B, T, d_in] (bf16, or out_dtype) = dy[B, T, d_out] . w[B, d_out, d_in]."""
    return _bmm(dy, w, 2, 1, out_dtype)


def wgrad(dy, x, out_dtype):
    """dw[B, d_out, d_in] (out_dtype, from the FP32 sum) = dy[B, T, d_out]^T . x[B, T, d_in]."""
    return _bmm(dy, x, 1, 1, out_dtype)


def add_into(c, y):
    """c + y rounded once to c's dtype: the "add" epilogue's value. For the residual of
    the forward (bf16 c and y) bf16(r + y), for the running sum of the weight gradient
    (FP32 c) c + y in FP32."""
    return round_once(c.astype(_F32) + y.astype(_F32), c.dtype)


def split_bf16x3(a):
    """FP32 a -> (hi, lo) in BF16 with hi + lo carrying about 16 mantissa bits of a.

    hi is rounded with `round_once`, not a convert pair: were the f32 -> bf16 -> f32 round
    trip dropped as excess precision, lo would be zero and the result a single BF16 pass
    (2.3e-3 error, seen on the H200).
    """
    hi = round_once(a, _BF16)
    return hi, round_once(a - hi.astype(_F32), _BF16)


def _bf16x3(a, b, contract_a: int, contract_b: int):
    """a . b for FP32 a, b by the BF16x3 emulation: hi*hi + hi*lo + lo*hi, FP32 sums.

    The small terms are summed first so they are not lost against the large one.
    """
    a_hi, a_lo = split_bf16x3(a)
    b_hi, b_lo = split_bf16x3(b)
    dims = (((contract_a,), (contract_b,)), ((), ()))
    dot = lambda p, q: lax.dot_general(p, q, dims, preferred_element_type=_F32)
    return (dot(a_hi, b_lo) + dot(a_lo, b_hi)) + dot(a_hi, b_hi)


def router_fwd(x, w):
    """logits[T, E] (f32) = x[T, d] . w[E, d]^T by BF16x3."""
    return _bf16x3(x, w, 1, 1)


def router_dgrad(g, w):
    """dx[T, d] (f32) = g[T, E] . w[E, d] by BF16x3."""
    return _bf16x3(g, w, 1, 0)


def router_wgrad(g, x):
    """dw[E, d] (f32) = g[T, E]^T . x[T, d] by BF16x3."""
    return _bf16x3(g, x, 0, 0)


# --- the gated epilogue (SwiGLU / GeGLU): its values, defined once ---------------------------
#
# From the bf16 pre-activation g = bf16(x Wg^T), u = bf16(x Wu^T) (each the GEMM's FP32
# accumulator rounded once):
#
#   forward   h  = bf16(act(g) * u)                     in FP32 from the bf16 g, u
#   backward  dg = bf16(dh * u * act'(g)),  du = bf16(dh * act(g))   in FP32 from the
#             bf16 dh, g, u
#
# act is "silu" (z sigmoid(z)) or "gelu" (the tanh approximation of jax.nn.gelu with
# approximate=True, 0.5 z (1 + tanh(y)), y = sqrt(2 / pi) (z + 0.044715 z^3), evaluated as
# z sigmoid(2 y): the same function, without the cancellation of 1 + tanh(y) in FP32 for
# negative z, where the tanh form is exactly 0 below z ~ -5.4). A kernel epilogue
# computing these on the accumulator tile must give the same values.

ACTIVATIONS = ("silu", "gelu")


def _act_and_slope(z, activation: str):
    """(act(z), act'(z)) for FP32 z."""
    if activation == "silu":
        s = jax.nn.sigmoid(z)
        return z * s, s * (1.0 + z * (1.0 - s))
    if activation == "gelu":
        # 0.5 (1 + tanh(y)) = sigmoid(2 y), and its derivative 2 s (1 - s) dy/dz.
        s = jax.nn.sigmoid((2.0 * contract.GELU_C) * (z + contract.GELU_A * (z * z * z)))
        slope = s + z * (2.0 * s * (1.0 - s)) * (contract.GELU_C * (1.0 + 3.0 * contract.GELU_A * (z * z)))
        return z * s, slope
    raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")


def gate(g, u, activation: str):
    """h = bf16(act(g) * u), in FP32 from bf16 g, u (the gated epilogue's forward value)."""
    value, _ = _act_and_slope(g.astype(_F32), activation)
    return round_once(value * u.astype(_F32), _BF16)


def gate_grad(dh, g, u, activation: str):
    """(dg, du) = (bf16(dh * u * act'(g)), bf16(dh * act(g))), in FP32 from bf16 dh, g, u."""
    value, slope = _act_and_slope(g.astype(_F32), activation)
    dh = dh.astype(_F32)
    return round_once(dh * u.astype(_F32) * slope, _BF16), round_once(dh * value, _BF16)


def interleave(a, b, axis: int, block: int = 1):
    """a and b (the same shape) interleaved along `axis` in blocks of `block` rows (it must
    divide F = a.shape[axis]): index 2 * block * j + i holds a's block * j + i, and
    2 * block * j + block + i b's, for i < block.

    The gated GEMMs' layout of gate and up: the rows of the stacked weight, the columns of
    the pre-activation and of its cotangent. With block 1, any shard of a's and b's `axis`
    (d_ff sharded, column-parallel) is one shard of the result holding the matching gate
    and up entries, so no stacked operand needs resharding. With block
    contract.GATE_BLOCK (16), every 32-column sub-tile of a kernel's accumulator holds 16
    gate columns and the 16 up columns of the same d_ff entries at the same register
    positions: the layout of the gated kernel epilogue."""
    axis = axis % a.ndim
    f = a.shape[axis]
    # A select between the halves, not jnp.stack: XLA runs the stack as a concatenate
    # fusion at about half a copy's bandwidth, the select as a loop fusion (H200,
    # 2026-12-03: the SwiGLU MLP step's interleaves 555 + 280 -> 281 + 190 us,
    # docs/benchmarks.md).
    blocks = a.shape[:axis] + (f // block, 1, block) + a.shape[axis + 1 :]
    pairs = blocks[: axis + 1] + (2,) + blocks[axis + 2 :]
    half = lax.broadcasted_iota(jnp.int32, pairs, axis + 1)
    pair = jnp.where(half == 0, jnp.reshape(a, blocks), jnp.reshape(b, blocks))
    return jnp.reshape(pair, a.shape[:axis] + (2 * f,) + a.shape[axis + 1 :])


def deinterleave(v, axis: int, block: int = 1):
    """(a, b) of v = interleave(a, b, axis, block)."""
    axis = axis % v.ndim
    f = v.shape[axis] // 2
    pairs = jnp.reshape(v, v.shape[:axis] + (f // block, 2, block) + v.shape[axis + 1 :])
    halves = (lax.index_in_dim(pairs, i, axis + 1, keepdims=False) for i in (0, 1))
    return tuple(jnp.reshape(h, v.shape[:axis] + (f,) + v.shape[axis + 1 :]) for h in halves)


# --- grouped (ragged) GEMMs: one weight per group of rows (MoE experts) ----------------------
#
# The rows of the activations are sorted by group and group_sizes [G] (int32, a run-time
# array) says how many rows each group holds. The sizes are made safe first
# (`grouped_sizes`): a negative size counts as 0 and the groups are cut where their running
# sum reaches the row count M, so no GEMM reads or writes a row past M. Rows from
# sum(sizes) on belong to no group: their y and dx are 0 (a select, so whatever those rows
# hold never reaches a result) and they add nothing to dw. Each result is the FP32 product
# rounded once to its dtype, by construction (an FP32 ragged dot, then one convert), on
# every backend. Leading dimensions, where present, are batch dimensions of every operand
# alike (a vmapped batch of independent calls): x [..., M, K], w [..., G, N, K],
# group_sizes [..., G].


def grouped_sizes(group_sizes, rows: int):
    """group_sizes [..., G] made safe for `rows` rows: max(s, 0) each, and cut where the
    running sum reaches `rows` (a later group keeps what is left, then 0). The running sum
    saturates at `rows` (min(a, rows - b) + b for a, b in [0, rows]: no int32 overflow)."""
    clipped = jnp.clip(group_sizes.astype(jnp.int32), 0, rows)
    if clipped.shape[-1] == 0:
        return clipped
    ends = lax.associative_scan(lambda a, b: jnp.minimum(a, rows - b) + b, clipped, axis=clipped.ndim - 1)
    starts = jnp.concatenate([jnp.zeros_like(ends[..., :1]), ends[..., :-1]], axis=-1)
    return ends - starts


def _grouped(a, b, group_sizes, role: str, out_dtype):
    """The grouped GEMM `role` ("fwd", "dgrad", "wgrad") over any leading batch dimensions
    (flattened into one for lax.ragged_dot_general)."""
    lead, m = a.shape[:-2], a.shape[-2]
    nb = 1 if lead else 0
    if lead:
        flat = 1
        for size in lead:
            flat *= size
        a, b = jnp.reshape(a, (flat,) + a.shape[-2:]), jnp.reshape(b, (flat,) + b.shape[len(lead) :])
        group_sizes = jnp.reshape(group_sizes, (flat, group_sizes.shape[-1]))
    sizes = grouped_sizes(group_sizes, m)
    batch = ((0,), (0,)) if lead else ((), ())
    if role == "fwd":  # a [M, K] . b [G, N, K]^T, rows of a ragged
        dims = lax.RaggedDotDimensionNumbers((((nb + 1,), (nb + 2,)), batch), [nb], [nb])
    elif role == "dgrad":  # a [M, N] . b [G, N, K], rows of a ragged
        dims = lax.RaggedDotDimensionNumbers((((nb + 1,), (nb + 1,)), batch), [nb], [nb])
    else:  # wgrad: a [M, N]^T . b [M, K], the contracted rows ragged: [G, N, K]
        dims = lax.RaggedDotDimensionNumbers((((nb,), (nb,)), batch), [nb], [])
    out = lax.ragged_dot_general(a, b, sizes, dims, preferred_element_type=_F32)
    if role == "wgrad":
        if lead:  # the group dimension comes first: [G, B, N, K] -> [B, G, N, K]
            out = jnp.moveaxis(out, 0, 1)
    else:  # rows past the groups' sum are 0, whatever the backend's ragged dot leaves there
        live = lax.broadcasted_iota(jnp.int32, out.shape[:-1] + (1,), nb) < jnp.sum(sizes, axis=-1)[..., None, None]
        out = jnp.where(live, out, jnp.zeros((), _F32))
    out = round_once(out, out_dtype)
    return jnp.reshape(out, lead + out.shape[nb:])


def grouped_fwd(x, w, group_sizes, out_dtype=_BF16):
    """y[M, N] (bf16, or out_dtype) with y[r] = x[r] . w[g(r)]^T: x [M, K], w [G, N, K],
    g(r) the group row r falls in; 0 for rows past the groups."""
    return _grouped(x, w, group_sizes, "fwd", out_dtype)


def grouped_dgrad(dy, w, group_sizes, out_dtype=_BF16):
    """dx[M, K] (bf16, or out_dtype) with dx[r] = dy[r] . w[g(r)]: dy [M, N], w [G, N, K];
    0 for rows past the groups."""
    return _grouped(dy, w, group_sizes, "dgrad", out_dtype)


def grouped_wgrad(dy, x, group_sizes, out_dtype):
    """dw[G, N, K] (out_dtype, from the FP32 sum) with dw[g] = dy[rows of g]^T . x[rows of g]:
    dy [M, N], x [M, K]; exactly 0 for an empty group."""
    return _grouped(dy, x, group_sizes, "wgrad", out_dtype)
