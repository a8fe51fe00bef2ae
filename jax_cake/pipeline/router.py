"""The FP32 router GEMM's pipeline: plans -> custom_vjp -> the router primitives (BF16x3)."""

from __future__ import annotations

import jax.numpy as jnp

from jax_cake import primitives
from jax_cake.pipeline.sharded_vjp import sharded_vjp
from jax_cake.planner import device as device_lib
from jax_cake.planner import plan as make_plan


def plans(x, w, deterministic: bool):
    """(fwd, dgrad, wgrad) plans of the router GEMM of x [T, d] by w [E, d]."""
    t, d = x.shape
    sizes = dict(tokens=t, d_in=d, d_out=w.shape[0], out_dtype=jnp.float32, device=device_lib.current(x, w))
    return (
        make_plan("router_fwd", **sizes),
        make_plan("router_dgrad", **sizes),
        make_plan("router_wgrad", **sizes, deterministic=deterministic),
    )


def _forward(deterministic: bool, x, w):
    fwd_plan, _, _ = plans(x, w, deterministic)
    return primitives.router_fwd(x, w, fwd_plan), (x, w)


def _backward(deterministic: bool, specs, saved, g):
    x, w = saved
    x_spec, w_spec = specs
    _, dgrad_plan, wgrad_plan = plans(x, w, deterministic)
    g = g.astype(jnp.float32)
    dx = primitives.router_dgrad(g, w, dgrad_plan, out_sharding=x_spec)
    dw = primitives.router_wgrad(g, x, wgrad_plan, deterministic=deterministic, out_sharding=w_spec)
    return dx, dw


_router = sharded_vjp(_forward, _backward)


def route(x, w, *, deterministic: bool):
    """logits [T, E] f32 of validated x [T, d] f32 and w [E, d] f32."""
    return _router(deterministic, x, w)
