"""The FP32 router GEMM's pipeline: plans -> custom_vjp -> the router primitives (BF16x3)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_cake import primitives
from jax_cake.planner import device as device_lib
from jax_cake.planner import plan as make_plan
from jax_cake.primitives import partitioning


def plans(x, w, deterministic: bool):
    """(fwd, dgrad, wgrad) plans of the router GEMM of x [T, d] by w [E, d]."""
    t, d = x.shape
    sizes = dict(tokens=t, d_in=d, d_out=w.shape[0], out_dtype=jnp.float32, device=device_lib.current(x, w))
    return (
        make_plan("router_fwd", **sizes),
        make_plan("router_dgrad", **sizes),
        make_plan("router_wgrad", **sizes, deterministic=deterministic),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _router(x, w, deterministic: bool):
    fwd_plan, _, _ = plans(x, w, deterministic)
    return primitives.router_fwd(x, w, fwd_plan)


def _router_fwd(x, w, deterministic):
    fwd_plan, _, _ = plans(x, w, deterministic)
    return primitives.router_fwd(x, w, fwd_plan), (x, w)


def _router_bwd(deterministic, saved, g):
    x, w = saved
    _, dgrad_plan, wgrad_plan = plans(x, w, deterministic)
    g = g.astype(jnp.float32)
    x_spec, w_spec = partitioning.explicit_specs(x, w) or (None, None)
    dx = primitives.router_dgrad(g, w, dgrad_plan, out_sharding=x_spec)
    dw = primitives.router_wgrad(g, x, wgrad_plan, deterministic=deterministic, out_sharding=w_spec)
    return partitioning.as_primal_types((dx, dw), (x, w))


_router.defvjp(_router_fwd, _router_bwd)


def route(x, w, *, deterministic: bool):
    """logits [T, E] f32 of validated x [T, d] f32 and w [E, d] f32 (made varying over the
    same manual axes inside shard_map)."""
    x, w = partitioning.to_common_varying(x, w)
    return _router(x, w, deterministic)
