"""jax_cake projections under `jax.shard_map`: data parallel and tensor parallel.

- Data parallel: x [T, d_in] sharded on tokens, w [d_out, d_in] replicated. Each device
  computes its dw partial; autodiff sums them over the mesh (the transpose of using a
  replicated w on sharded x is a psum), so dw comes out replicated and complete.
- Tensor parallel: w sharded on d_out, x replicated. Each device owns y[:, its d_out
  slice]; dx is the sum of the per-device dgrads.

Both are checked against the same computation without sharding: the script prints the
max relative difference (max |sharded - unsharded| / max |unsharded|) of y, dx and dw
and exits 1 if one is above the tolerance of its dtype.

On CPU it runs on 8 fake devices; on GPUs it uses all of them (a mesh of 1 works too):

    python examples/shard_map_projection.py
"""

import os

# Eight fake CPU devices, set before jax starts. The flag only shapes the host (CPU)
# platform, so it changes nothing when a GPU is the default backend; a device count
# already given in XLA_FLAGS wins.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from absl import app, flags, logging  # noqa: E402  (imports after the XLA_FLAGS set-up above)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cake  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("tokens", 256, "Tokens T; a multiple of the device count.")
flags.DEFINE_integer("d_in", 256, "Input width.")
flags.DEFINE_integer("d_out", 512, "Output width; d_out / devices should be a multiple of 8.")
flags.DEFINE_integer("seed", 0, "Seed for x, w and the output cotangent.")
flags.DEFINE_bool("deterministic", True, "Bitwise reproducible weight gradients.")

BF16, F32 = jnp.bfloat16, jnp.float32
# bf16 results (y, dx) may differ by a few bf16 ulps where the sharded program sums
# partials in another order; fp32 dw only by fp32 reassociation.
TOLERANCE = {jnp.dtype(BF16): 2e-2, jnp.dtype(F32): 1e-4}


def max_rel_diff(a, b):
    a, b = jnp.asarray(a, F32), jnp.asarray(b, F32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def main(argv):
    del argv
    if not FLAGS["verbosity"].present:  # hide jax's INFO line about the absent TPU backend
        logging.set_verbosity(logging.WARNING)
    # Auto axes: shard_map reshards its inputs itself, so callers pass plain arrays.
    mesh = jax.make_mesh((jax.device_count(),), ("devices",), axis_types=(jax.sharding.AxisType.Auto,))
    n = mesh.size
    if FLAGS.tokens % n or FLAGS.d_out % n:
        raise app.UsageError(f"tokens and d_out must be multiples of the {n} devices")
    kx, kw, kdy = jax.random.split(jax.random.key(FLAGS.seed), 3)
    x = jax.random.normal(kx, (FLAGS.tokens, FLAGS.d_in), F32).astype(BF16)
    w = jax.random.normal(kw, (FLAGS.d_out, FLAGS.d_in), F32) / FLAGS.d_in**0.5
    dy = jax.random.normal(kdy, (FLAGS.tokens, FLAGS.d_out), F32)  # fixed output cotangent

    def project(x, w):
        return jax_cake.dense_projection(x, w, deterministic=FLAGS.deterministic)

    data_parallel = jax.shard_map(project, mesh=mesh, in_specs=(P("devices"), P()), out_specs=P("devices"))
    tensor_parallel = jax.shard_map(project, mesh=mesh, in_specs=(P(), P("devices")), out_specs=P(None, "devices"))

    @jax.jit(static_argnums=0)
    def forward_and_grads(fn, x, w, dy):
        # Loss sum(y * dy): its gradient with respect to y is exactly dy.
        y, vjp = jax.vjp(fn, x, w)
        return (y, *vjp(dy.astype(y.dtype)))

    expected = forward_and_grads(project, x, w, dy)
    print(
        f"mesh: {n} {jax.default_backend()} device(s) on axis 'devices'; "
        f"T {FLAGS.tokens}, d_in {FLAGS.d_in}, d_out {FLAGS.d_out}"
    )
    failed = False
    for name, fn in (("data_parallel", data_parallel), ("tensor_parallel", tensor_parallel)):
        got = forward_and_grads(fn, x, w, dy)
        for label, g, e in zip(("y", "dx", "dw"), got, expected):
            diff = max_rel_diff(g, e)
            ok = g.dtype == e.dtype and diff <= TOLERANCE[e.dtype]
            failed |= not ok
            print(f"{name:16s} {label:2s} {str(g.dtype):8s} max_rel_diff {diff:.3e} {'ok' if ok else 'FAIL'}")
    print("FAIL" if failed else "PASS: sharded gradients match the unsharded ones")
    return int(failed)


if __name__ == "__main__":
    app.run(main)
