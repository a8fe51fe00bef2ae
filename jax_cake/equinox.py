"""`jax_cake.equinox.Linear`: eqx.nn.Linear's fields and initialization, jax_cake's GEMMs.

    from jax_cake.equinox import Linear

    layer = Linear(1024, 4096, key=key)            # float32 weight [out, in], as eqx.nn.Linear
    y = layer(x.astype(jnp.bfloat16))              # x [..., 1024] -> y [..., 4096] bfloat16

With bfloat16 inputs the product runs through `jax_cake.dot_general` (a float32 weight is
a master weight: rounded to bfloat16 for the products, its gradient float32 from the
FP32 accumulator) and the output and bias add are bfloat16. With inputs of any other dtype
the layer computes what eqx.nn.Linear computes (`weight @ x + bias`).

Unlike eqx.nn.Linear the layer also takes leading dimensions, x [..., in_features]:
calling it on the whole batch folds every token into one GEMM. `jax.vmap(layer)(x)` works
too, with the same values.

Needs equinox (not a jax_cake dependency); import this module explicitly.
"""

from __future__ import annotations

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

from jax_cake.flax_adapter import dot_general

__all__ = ["Linear"]


class Linear(eqx.Module):
    """A linear layer with eqx.nn.Linear's fields, init and calling convention, on jax_cake.

    Fields: weight [out_features, in_features], bias [out_features] or None, and the
    static in_features, out_features ("scalar" allowed, as in eqx) and use_bias.
    """

    weight: jax.Array
    bias: jax.Array | None
    in_features: int | Literal["scalar"] = eqx.field(static=True)
    out_features: int | Literal["scalar"] = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)

    def __init__(
        self,
        in_features: int | Literal["scalar"],
        out_features: int | Literal["scalar"],
        use_bias: bool = True,
        dtype=None,
        *,
        key,
    ):
        """The arguments and the initial values of eqx.nn.Linear (same key, same weights)."""
        reference = eqx.nn.Linear(in_features, out_features, use_bias, dtype, key=key)
        self.weight = reference.weight
        self.bias = reference.bias
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias

    @classmethod
    def from_eqx(cls, linear: eqx.nn.Linear) -> "Linear":
        """The same layer (the same arrays) running on jax_cake."""
        new = object.__new__(cls)
        for name in ("weight", "bias", "in_features", "out_features", "use_bias"):
            object.__setattr__(new, name, getattr(linear, name))
        return new

    def __call__(self, x: jax.Array, *, key=None) -> jax.Array:
        """x [..., in_features] (or [...] for in_features="scalar") -> [..., out_features].

        key: ignored, as in eqx.nn.Linear.
        """
        del key
        x = jnp.asarray(x)
        if self.in_features == "scalar":
            x = x[..., None]
        if x.dtype == jnp.bfloat16:
            y = dot_general(x, self.weight, (((x.ndim - 1,), (1,)), ((), ())))
            bias = None if self.bias is None else self.bias.astype(y.dtype)
        elif x.ndim == 1:
            y, bias = self.weight @ x, self.bias  # eqx.nn.Linear exactly
        else:
            y, bias = lax.dot_general(x, self.weight, (((x.ndim - 1,), (1,)), ((), ()))), self.bias
        if bias is not None:
            y = y + bias
        if self.out_features == "scalar":
            y = y[..., 0]
        return y
