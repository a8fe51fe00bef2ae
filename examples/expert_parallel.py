"""Expert parallelism with `jax.shard_map`: each device holds E / n experts and runs
`jax_cake.grouped_projection` on the tokens routed to them, with the all-to-all written by
the caller.

One MoE expert projection y[t] = x[t] @ w[e(t)].T (top-1 routing e(t), fixed here so the
check is exact), with x [n T, d] sharded on tokens and w [E, F, d] (FP32 master weights)
sharded on experts. On each device:

1. sort the local tokens by expert (experts are contiguous per device, so this also sorts
   them by destination device) and count them per expert;
2. all-to-all the tokens: chunk j of the send buffer [n, T, d] holds the tokens for device
   j (padded to T rows: no token is dropped), and the counts [n, E / n] go along;
3. put the received rows in expert-major order (for local expert i: its rows from source
   0, then source 1, ...; the padding last) and run ONE grouped projection over them with
   the local group sizes (rows past their sum are padding: their y is 0);
4. undo the permutation, all-to-all the results back and unsort them.

Every step is a gather or an all-to-all, so autodiff gives dx and each device's dw for
its own experts. The result, dx and dw are checked against the same layer without
sharding (one grouped_projection over all tokens sorted by expert): the script prints the
max relative difference (max |sharded - unsharded| / max |unsharded|) of each and exits 1
if one is above the tolerance of its dtype.

On CPU it runs on 8 fake devices; on GPUs it uses all of them (a mesh of 1 works too):

    python examples/expert_parallel.py
"""

import os

# Eight fake CPU devices, set before jax starts. The flag only shapes the host (CPU)
# platform, so it changes nothing when a GPU is the default backend; a device count
# already given in XLA_FLAGS wins.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import sys  # noqa: E402

from absl import app, flags, logging  # noqa: E402  (imports after the XLA_FLAGS set-up above)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cake  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("tokens", 64, "Tokens per device T.")
flags.DEFINE_integer("d_model", 64, "Input width d.")
flags.DEFINE_integer("d_ff", 128, "Output width F of each expert.")
flags.DEFINE_integer("experts_per_device", 2, "Experts each device holds (E = this times the devices).")
flags.DEFINE_integer("seed", 0, "Seed for x, w, the routing and the output cotangent.")

BF16, F32 = jnp.bfloat16, jnp.float32
# bf16 results (y, dx) may differ by a bf16 ulp where a row's FP32 sum runs in another
# order; fp32 dw only by fp32 reassociation.
TOLERANCE = {jnp.dtype(BF16): 2e-2, jnp.dtype(F32): 1e-4}
AXIS = "expert"


def max_rel_diff(a, b):
    a, b = jnp.asarray(a, F32), jnp.asarray(b, F32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def moe_unsharded(x, e, w):
    """The same layer on one device: every token sorted by expert, one grouped projection."""
    order = jnp.argsort(e, stable=True)
    counts = jnp.bincount(e, length=w.shape[0]).astype(jnp.int32)
    y_sorted = jax_cake.grouped_projection(x[order], w, counts)
    return y_sorted[jnp.argsort(order)]


def moe_local(x, e, w, n: int):
    """One device's part: x [T, d] its tokens, e [T] their experts, w [E / n, F, d] its
    experts; n the devices on AXIS."""
    t = x.shape[0]
    local = w.shape[0]
    # 1. sort by expert (= by destination device), count per expert and per destination
    order = jnp.argsort(e, stable=True)
    xs, dest = x[order], e[order] // local
    counts = jnp.bincount(e, length=n * local).astype(jnp.int32).reshape(n, local)
    per_dest = counts.sum(1)
    start = jnp.cumsum(per_dest) - per_dest
    # 2. send buffer [n, T, d]: chunk j holds this device's tokens for device j, padded
    row = jnp.arange(t)
    valid = row[None, :] < per_dest[:, None]
    send = jnp.where(valid[..., None], xs[jnp.clip(start[:, None] + row[None, :], 0, t - 1)], 0)
    recv = jax.lax.all_to_all(send, AXIS, 0, 0)  # recv[s]: source s's tokens for my experts
    recv_counts = jax.lax.all_to_all(counts, AXIS, 0, 0)  # [n sources, local experts]
    # 3. expert-major order: for local expert i, its rows from source 0, 1, ...; padding last
    group_sizes = recv_counts.sum(0)
    group_start = jnp.cumsum(group_sizes) - group_sizes
    before_source = jnp.cumsum(recv_counts, 0) - recv_counts  # rows of expert i from earlier sources
    in_source = jnp.cumsum(recv_counts, 1)  # [n, local]: end of each expert's rows in a chunk
    expert = jax.vmap(lambda ends: jnp.searchsorted(ends, row, side="right"))(in_source)  # [n, T]
    is_row = row[None, :] < in_source[:, -1:]
    expert = jnp.minimum(expert, local - 1)
    rank = row[None, :] - (in_source - recv_counts)[jnp.arange(n)[:, None], expert]
    position = group_start[expert] + before_source[jnp.arange(n)[:, None], expert] + rank
    key = jnp.where(is_row, position, n * t + jnp.arange(n * t).reshape(n, t))
    perm = jnp.argsort(key.reshape(-1))
    y_grouped = jax_cake.grouped_projection(recv.reshape(n * t, -1)[perm], w, group_sizes)
    # 4. back to the received layout, back to the sources, back to the tokens' order
    y_recv = y_grouped[jnp.argsort(perm)].reshape(n, t, -1)
    y_back = jax.lax.all_to_all(y_recv, AXIS, 0, 0)  # y_back[j]: my tokens' results from device j
    y_sorted = y_back[dest, row - start[dest]]
    return y_sorted[jnp.argsort(order)]


def main(argv):
    del argv
    if not FLAGS["verbosity"].present:  # hide jax's INFO line about the absent TPU backend
        logging.set_verbosity(logging.WARNING)
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    n = mesh.size
    experts = n * FLAGS.experts_per_device
    kx, kw, ke, kdy = jax.random.split(jax.random.key(FLAGS.seed), 4)
    tokens = n * FLAGS.tokens
    x = jax.random.normal(kx, (tokens, FLAGS.d_model), F32).astype(BF16)
    w = jax.random.normal(kw, (experts, FLAGS.d_ff, FLAGS.d_model), F32) / FLAGS.d_model**0.5
    e = jax.random.randint(ke, (tokens,), 0, experts, jnp.int32)  # top-1 routing, fixed
    dy = jax.random.normal(kdy, (tokens, FLAGS.d_ff), F32).astype(BF16)  # fixed output cotangent

    sharded = jax.shard_map(
        lambda x, e, w: moe_local(x, e, w, n),
        mesh=mesh,
        in_specs=(P(AXIS), P(AXIS), P(AXIS)),
        out_specs=P(AXIS),
    )

    @jax.jit(static_argnums=0)
    def forward_and_grads(fn, x, e, w, dy):
        # Loss sum(y * dy): its gradient with respect to y is exactly dy.
        y, vjp = jax.vjp(lambda x, w: fn(x, e, w), x, w)
        return (y, *vjp(dy))

    expected = forward_and_grads(moe_unsharded, x, e, w, dy)
    got = forward_and_grads(sharded, x, e, w, dy)
    load = jnp.bincount(e, length=experts)
    print(
        f"mesh: {n} {jax.default_backend()} device(s) on axis '{AXIS}'; {experts} experts "
        f"({FLAGS.experts_per_device} per device), {tokens} tokens (from {int(load.min())} to {int(load.max())} "
        f"per expert), d {FLAGS.d_model} -> F {FLAGS.d_ff}"
    )
    ok = True
    for name, a, b in zip(("y", "dx", "dw"), got, expected):
        diff = max_rel_diff(a, b)
        good = a.dtype == b.dtype and diff <= TOLERANCE[jnp.dtype(b.dtype)]
        ok &= good
        verdict = "ok" if good else "MISMATCH"
        print(f"{name:3s} {jnp.dtype(a.dtype).name:9s} max rel diff vs unsharded {diff:.2e} {verdict}")
    if not ok:
        sys.exit(1)
    print("expert-parallel results and gradients match the unsharded layer")


if __name__ == "__main__":
    app.run(main)
