"""shard_map projections on 8 fake CPU devices: gradients equal the unsharded ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_cake as jc
from helpers import rand, rel_err


def _loss(y):
    return jnp.sum(jnp.sin(y.astype(jnp.float32)))


def _unsharded_grads(x, w):
    return jax.jit(jax.grad(lambda x, w: _loss(jc.dense_projection(x, w)), argnums=(0, 1)))(x, w)


def _put(mesh, a, spec):
    return jax.device_put(a, NamedSharding(mesh, spec))


def _shard_map_grads(mesh, project, loss, x_spec, w_spec):
    """(x, w) -> d/dx, d/dw of psum(loss(project(x_shard, w_shard))) over every mesh axis,
    under shard_map with x and w sharded by x_spec / w_spec (not jitted)."""

    def local_loss(x, w):
        return jax.lax.psum(loss(project(x, w)), mesh.axis_names)

    return jax.shard_map(
        jax.grad(local_loss, argnums=(0, 1)), mesh=mesh, in_specs=(x_spec, w_spec), out_specs=(x_spec, w_spec)
    )


def _sharded_grads(mesh, project, loss, x, w, x_spec, w_spec):
    """The gradients of _shard_map_grads on concrete x, w placed by their specs."""
    grads = jax.jit(_shard_map_grads(mesh, project, loss, x_spec, w_spec))
    return grads(_put(mesh, x, x_spec), _put(mesh, w, w_spec))


def _assert_close(a, b, tol):
    assert rel_err(a, b) < tol


@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
def test_data_parallel_matches_unsharded(w_dtype):
    mesh = jax.make_mesh((8,), ("dp",))
    x = rand(1, (8 * 37, 64), jnp.bfloat16)
    w = rand(2, (48, 64), w_dtype)

    # x: this device's tokens, w: replicated
    dx, dw = _sharded_grads(mesh, jc.dense_projection, _loss, x, w, P("dp"), P())
    ref_dx, ref_dw = _unsharded_grads(x, w)
    assert dw.dtype == w_dtype and dx.dtype == jnp.bfloat16
    _assert_close(dx, ref_dx, 1e-2)
    # The per-shard FP32 partial sums are reduced in another order than the unsharded sum.
    _assert_close(dw, ref_dw, 1e-5 if w_dtype == jnp.float32 else 1e-2)


def test_tensor_parallel_matches_unsharded():
    mesh = jax.make_mesh((8,), ("tp",))
    x = rand(3, (64, 128), jnp.bfloat16)
    w = rand(4, (8 * 16, 128), jnp.float32)

    # x: replicated, w: this device's output rows
    dx, dw = _sharded_grads(mesh, jc.dense_projection, _loss, x, w, P(), P("tp"))
    ref_dx, ref_dw = _unsharded_grads(x, w)
    _assert_close(dx, ref_dx, 1e-2)
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(ref_dw))  # same sums, one device each


def test_data_and_tensor_parallel_on_a_2d_mesh():
    mesh = jax.make_mesh((4, 2), ("dp", "tp"))
    x = rand(5, (4 * 19, 64), jnp.bfloat16)
    w = rand(6, (2 * 24, 64), jnp.float32)

    dx, dw = _sharded_grads(mesh, jc.dense_projection, _loss, x, w, P("dp"), P("tp"))
    ref_dx, ref_dw = _unsharded_grads(x, w)
    _assert_close(dx, ref_dx, 1e-2)
    _assert_close(dw, ref_dw, 1e-5)


def test_forward_under_shard_map_keeps_per_shard_shapes():
    mesh = jax.make_mesh((8,), ("dp",))
    x = rand(7, (8, 5, 32), jnp.bfloat16)
    w = rand(8, (8, 16, 32), jnp.bfloat16)
    f = jax.jit(jax.shard_map(jc.batched_projection, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=P("dp")))
    y = f(_put(mesh, x, P("dp")), _put(mesh, w, P("dp")))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jc.batched_projection(x, w)))


def _custom_calls_on_faked_h200_mesh(project, loss, x_shape, x_dtype, w_shape, prefix):
    """The gradient step of psum(loss(project(x, w))) under shard_map on a faked 4 x 2 H200
    mesh (x rows over the first axis, w rows over the second), lowered for CUDA: the
    custom-call lines of each GEMM (fwd, dgrad, wgrad) whose target starts with `prefix`."""
    from jax.sharding import AbstractDevice, AbstractMesh

    mesh = AbstractMesh((4, 2), ("a", "b"), abstract_device=AbstractDevice("NVIDIA H200", 132, "cuda"))

    f = _shard_map_grads(mesh, project, loss, P("a"), P("b"))
    x = jax.ShapeDtypeStruct(x_shape, x_dtype, sharding=NamedSharding(mesh, P("a")))
    w = jax.ShapeDtypeStruct(w_shape, jnp.float32, sharding=NamedSharding(mesh, P("b")))
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    return {
        op: [l for l in text.splitlines() if f"custom_call @{prefix}{op}(" in l] for op in ("fwd", "dgrad", "wgrad")
    }


def test_cuda_lowering_under_shard_map_uses_per_shard_custom_calls():
    """On a faked 8-GPU H200 mesh, each GEMM is one custom call on the per-shard shapes."""
    calls = _custom_calls_on_faked_h200_mesh(
        jc.dense_projection, _loss, (4 * 1024, 512), jnp.bfloat16, (2 * 256, 512), "jax_cake_"
    )
    assert all(len(c) == 1 for c in calls.values()), calls
    assert "(tensor<1x1024x512xbf16>, tensor<1x256x512xbf16>) -> tensor<1x1024x256xbf16>" in calls["fwd"][0]
    assert "-> (tensor<1x256x512xf32>," in calls["wgrad"][0]


def _router_loss(logits):
    return jnp.sum(jnp.tanh(logits))


def test_router_data_and_expert_parallel_matches_unsharded():
    """router_logits with tokens over dp and experts over ep: value and both gradients."""
    mesh = jax.make_mesh((4, 2), ("dp", "ep"))
    x = rand(9, (4 * 37, 64), jnp.float32)
    w = 0.02 * rand(10, (2 * 16, 64), jnp.float32)

    dx, dw = _sharded_grads(mesh, jc.router_logits, _router_loss, x, w, P("dp"), P("ep"))
    ref_dx, ref_dw = jax.jit(jax.grad(lambda x, w: _router_loss(jc.router_logits(x, w)), argnums=(0, 1)))(x, w)
    assert dx.dtype == dw.dtype == jnp.float32
    _assert_close(dx, ref_dx, 1e-5)  # BF16x3: ~4e-6 either way, different summation order
    _assert_close(dw, ref_dw, 1e-5)


def test_router_cuda_lowering_under_shard_map_uses_per_shard_custom_calls():
    """On a faked 8-GPU H200 mesh: one router custom call per GEMM, per-shard shapes, w and
    g as bf16 hi/lo pairs of the shard."""
    calls = _custom_calls_on_faked_h200_mesh(
        jc.router_logits, _router_loss, (4 * 1024, 512), jnp.float32, (2 * 128, 512), "jax_cake_router_"
    )
    assert all(len(c) == 1 for c in calls.values()), calls
    w16, g16 = "tensor<128x512xbf16>", "tensor<1024x128xbf16>"
    assert f"(tensor<1024x512xf32>, {w16}, {w16}) -> tensor<1024x128xf32>" in calls["fwd"][0]
    assert f"({g16}, {g16}, {w16}, {w16}) -> tensor<1024x512xf32>" in calls["dgrad"][0]
    assert f"({g16}, {g16}, tensor<1024x512xf32>) -> (tensor<128x512xf32>" in calls["wgrad"][0]
