"""Drop-in hooks for Flax (and any code that takes a `dot_general`): jax_cake GEMMs
behind `lax.dot_general`'s signature, and a promote function that keeps FP32 master
kernels uncast.

    import flax.linen as nn
    import jax_cake as jc

    layer = nn.Dense(1024, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                     dot_general=jc.dot_general, promote_dtype=jc.promote_dtype)

`dot_general` routes projection-shaped contractions to jax_cake's kernels and sends
everything else to `lax.dot_general`:

- routed: a bfloat16 lhs whose contracting axes are its trailing axes, against a
  bfloat16 or float32 rhs whose contracting axes are either its leading axes (Flax's
  kernel layout [d_in, d_out], possibly [d_in..., features...] as in DenseGeneral) or
  its trailing axes ([d_out, d_in], jax_cake's own layout), in the same order as the
  lhs's; no batch dimensions; preferred_element_type None or bfloat16; default
  precision; no out_sharding. The result is bfloat16 from an FP32 accumulator, as
  `lax.dot_general` of the same bf16 operands.
- everything else (float32 or other activation dtypes, batch dimensions on both sides
  as in attention, axes that would need a transpose, preferred_element_type float32, a
  non-default precision, out_sharding, bad dimension numbers, ...) is `lax.dot_general`
  with the caller's arguments, unchanged except for a float32 master rhs (below).

The master weight: a bfloat16 lhs against a float32 rhs. That is the FP32 kernel that
`promote_dtype` below passes through uncast, where Flax's own promote_dtype casts it to
the layer's dtype (bfloat16) before the layer calls its dot_general, whatever the
preferred_element_type, precision or layout. So on every path the rhs is rounded to
bfloat16 first:

- routed, the kernels round it; the result is bfloat16 and the rhs's gradient is
  float32, written from the kernel's FP32 accumulator rather than rounded to bfloat16
  (the one difference from Flax's default promote, and the point of the hooks);
- not routed, the call is `lax.dot_general(lhs, rhs.astype(bfloat16), ...)` with the
  caller's other arguments: bitwise what the layer computes, value and gradients, with
  Flax's default promote_dtype and `lax.dot_general`.

The rule goes by the dtypes alone (dot_general cannot tell who called it), so a direct
call with a bfloat16 lhs and a float32 rhs rounds the rhs too, where `lax.dot_general`
would contract the float32 values as they are. To contract bfloat16 activations against
float32 values in float32, cast the lhs to float32: float32 operands are
`lax.dot_general` unchanged, as is a float32 lhs against a bfloat16 rhs.

The Flax layout [d_in, d_out] runs without a transpose of the weight: with
w_kn = [K, N] (N contiguous), y = x w_kn is the dgrad GEMM (dgrad(dy=x, w=w_kn)), the
input gradient dy w_kn^T is the fwd GEMM (fwd(x=dy, w=w_kn)), and the weight gradient
x^T dy, in w_kn's layout, is the wgrad GEMM with its operands swapped
(wgrad(dy=x, x=dy)); see docs/ffi_contract.md for the three GEMMs.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from jax_cake import remat
from jax_cake.api import dense_projection
from jax_cake.pipeline import projection, validation

_BF16 = jnp.dtype(jnp.bfloat16)
_F32 = jnp.dtype(jnp.float32)

__all__ = ["dot_general", "promote_dtype"]


def _kn_dense(x2, w_kn, deterministic: bool):
    """x2 [T, K] bf16 . w_kn [K, N] (bf16 or float32 master) -> [T, N] bf16: the
    projection pipeline in Flax's layout (its GEMM roles swapped, no transpose)."""
    x3 = jnp.reshape(x2, (1,) + x2.shape)
    y3 = projection.project(x3, jnp.reshape(w_kn, (1,) + w_kn.shape), deterministic=deterministic, layout="kn")
    return remat.name_output(y3[0])


# --- routing -----------------------------------------------------------------------------


def _is_default_precision(precision) -> bool:
    if precision is None:
        return True
    if isinstance(precision, (tuple, list)):
        return len(precision) == 2 and all(_is_default_precision(p) for p in precision)
    try:
        return lax.Precision(precision) == lax.Precision.DEFAULT
    except (ValueError, TypeError):
        return False  # a DotAlgorithm / preset or something lax will judge


def _axes(seq) -> tuple[int, ...] | None:
    try:
        return tuple(int(a) for a in seq)
    except (TypeError, ValueError):
        return None


def _layout(lhs, rhs, dimension_numbers):
    """"kn" (rhs contracting axes leading), "nk" (trailing) or None (not a projection)."""
    try:
        (lhs_c, rhs_c), (lhs_b, rhs_b) = dimension_numbers
    except (TypeError, ValueError):
        return None
    lhs_c, rhs_c, lhs_b, rhs_b = (_axes(a) for a in (lhs_c, rhs_c, lhs_b, rhs_b))
    if None in (lhs_c, rhs_c, lhs_b, rhs_b) or lhs_b or rhs_b:
        return None
    c = len(lhs_c)
    if c == 0 or len(rhs_c) != c or rhs.ndim <= c or lhs.ndim < c:
        return None
    if lhs_c != tuple(range(lhs.ndim - c, lhs.ndim)):
        return None  # contraction not on the activations' trailing axes, in order
    if tuple(lhs.shape[a] for a in lhs_c) != tuple(rhs.shape[a] for a in rhs_c):
        return None
    if rhs_c == tuple(range(c)):
        return "kn"
    if rhs_c == tuple(range(rhs.ndim - c, rhs.ndim)):
        return "nk"
    return None


def dot_general(
    lhs,
    rhs,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
    *,
    deterministic: bool = True,
):
    """`lax.dot_general` with projection-shaped bfloat16 contractions on jax_cake's GEMMs.

    Same signature and semantics as `jax.lax.dot_general`; pass it as `dot_general=` to
    flax.linen.Dense / DenseGeneral or flax.nnx.Linear / LinearGeneral, or as
    `_dot_general=` to `jnp.einsum`. See the module docstring for what is routed; the
    rest is `lax.dot_general` unchanged.

    A bfloat16 lhs against a float32 rhs is a master weight: on every path the product
    uses the rhs rounded to bfloat16, as Flax's default promote_dtype would have cast it.
    Routed, the result is bfloat16 and the rhs's gradient is float32 from the FP32
    accumulator; not routed (preferred_element_type float32 included), it is
    `lax.dot_general(lhs, rhs.astype(bfloat16), ...)` exactly.

    deterministic: keyword-only, as in `jax_cake.dense_projection` (True: bitwise
    reproducible weight gradients; False lets the planner pick a split-K program whose
    sum order can vary, where measured faster). Use `functools.partial` to set it.
    """
    deterministic = validation.check_deterministic("dot_general", deterministic)
    arrays = hasattr(lhs, "dtype") and hasattr(rhs, "dtype") and hasattr(lhs, "shape") and hasattr(rhs, "shape")
    if not (arrays and jnp.dtype(lhs.dtype) == _BF16 and jnp.dtype(rhs.dtype) in (_BF16, _F32)):
        return lax.dot_general(
            lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding=out_sharding
        )
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    bf16_result = preferred_element_type is None or jnp.dtype(preferred_element_type) == _BF16
    layout = _layout(lhs, rhs, dimension_numbers)
    routed = (
        bf16_result
        and layout is not None
        and out_sharding is None
        and _is_default_precision(precision)
        and 0 not in lhs.shape
        and 0 not in rhs.shape
    )
    if not routed:
        # lax with the caller's arguments; a float32 master rhs is rounded to bfloat16 first,
        # as Flax's promote_dtype would have cast it (see the module docstring).
        if rhs.dtype == _F32:
            rhs = rhs.astype(_BF16)
        return lax.dot_general(
            lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding=out_sharding
        )
    c = len(dimension_numbers[0][0])
    lead = lhs.shape[: lhs.ndim - c]
    k = math.prod(lhs.shape[lhs.ndim - c :])
    x2 = jnp.reshape(lhs, (math.prod(lead), k))
    if layout == "kn":
        features = rhs.shape[c:]
        y2 = _kn_dense(x2, jnp.reshape(rhs, (k, math.prod(features))), deterministic)
    else:
        features = rhs.shape[: rhs.ndim - c]
        y2 = dense_projection(x2, jnp.reshape(rhs, (math.prod(features), k)), deterministic=deterministic)
    return jnp.reshape(y2, lead + features)


# --- the promote function ------------------------------------------------------------------


def _target_dtype(args, dtype, inexact: bool):
    """Flax's canonicalize_dtype: the given dtype, else the arguments' result type."""
    if dtype is None:
        dtype = jnp.result_type(*[jnp.asarray(a) for a in args if a is not None])
        if inexact and not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.promote_types(jnp.float32, dtype)
    if inexact and not jnp.issubdtype(dtype, jnp.inexact):
        raise ValueError(f"Dtype must be inexact: {dtype}")
    return jnp.dtype(dtype)


def _promote(args: tuple, dtype, inexact: bool) -> tuple:
    target = _target_dtype(args, dtype, inexact)
    out = [jnp.asarray(a, target) if a is not None else None for a in args]
    if len(args) == 3 and args[1] is not None and target == _BF16 and jnp.asarray(args[1]).dtype == _F32:
        out[1] = jnp.asarray(args[1])  # the float32 master kernel: jax_cake.dot_general rounds it
    return tuple(out)


def promote_dtype(*args, dtype=None, inexact: bool = True):
    """Flax's promote_dtype, except that a float32 kernel stays float32 under dtype=bfloat16.

    For the linear layers' (inputs, kernel, bias) triple: inputs and bias are cast to
    the computation dtype as Flax does; when that dtype is bfloat16 a float32 kernel is
    passed through uncast, so `jax_cake.dot_general` gets the master weight and returns
    its gradient in float32 from the FP32 accumulator. (With Flax's own promote_dtype the
    kernel's gradient is float32 in dtype but bfloat16-rounded in value.) In every other
    case, and for any number of arguments other than three, it is Flax's promote_dtype.

    Both calling conventions work: flax.linen's variadic `promote_dtype(inputs, kernel,
    bias, dtype=...)` (returns a list) and flax.nnx's `promote_dtype((inputs, kernel,
    bias), dtype=...)` (one tuple; returns a tuple).

    Use it only together with `dot_general=jax_cake.dot_general`, on layers whose
    (inputs, kernel, bias) reach that dot_general as its (lhs, rhs): nn.Dense,
    nn.DenseGeneral, nnx.Linear, nnx.LinearGeneral (and MultiHeadAttention's qkv/out
    promote functions). There every call computes what Flax's promote_dtype would give,
    bitwise where dot_general does not route it (see `dot_general`). Not for attention
    functions (their triple is query, key, value), convolutions, or the Einsum layers,
    where the uncast kernel would reach a plain XLA op or `jnp.einsum`, which picks a
    float32 result from a float32 operand itself. nnx.Einsum runs its projection on
    jax_cake with `einsum_op=functools.partial(jnp.einsum, _dot_general=jax_cake.dot_general)`
    and Flax's own promote_dtype (the kernel is then cast before the contraction).
    """
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return _promote(tuple(args[0]), dtype, inexact)
    return list(_promote(args, dtype, inexact))
