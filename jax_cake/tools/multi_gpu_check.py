"""Multi-device check: `python -m jax_cake.tools.multi_gpu_check`.

A two-layer projection block (x -> dense(w1) -> gelu -> dense(w2)) trained under
`jax.shard_map` on every device of the host, two ways:
- data parallel: tokens sharded, weights replicated (weight gradients summed by the
  transpose of jax_cake's pcast, i.e. an all-reduce);
- tensor parallel: one column-parallel projection (w sharded on d_out, x replicated,
  each device's output columns and their loss local; dx summed over devices).
Gradients are compared with the same step on one device: bf16 dx within 1e-2 relative,
fp32 dw within 1e-5 (a device's K split may differ from the one-device plan, which
reorders the FP32 sums). The per-device step time is compared with one device running
the same per-device shapes (target: within 5 %). Prints PASS/FAIL per check and a timing table;
exits non-zero on a failed gradient check.

On CPU it runs on the fake devices of --xla_force_host_platform_device_count (tests use
8) and labels its times host wall time.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_cake

FLAGS = flags.FLAGS
flags.DEFINE_integer("tokens_per_device", 8192, "Tokens each device holds in the data-parallel step.")
flags.DEFINE_integer("d_model", 4096, "Block input/output width.")
flags.DEFINE_integer("d_ff", 4096, "Hidden width; the tensor-parallel projection's d_out (sharded).")
flags.DEFINE_integer("reps", 15, "Timed steps (median).")
flags.DEFINE_bool("deterministic", True, "jax_cake's deterministic flag.")

BF16, F32 = jnp.bfloat16, jnp.float32
RESULTS: list[bool] = []


def report(name: str, ok: bool, detail: str) -> None:
    RESULTS.append(ok)
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def block(x, w1, w2, det):
    h = jax.nn.gelu(jax_cake.dense_projection(x, w1, deterministic=det))
    return jax_cake.dense_projection(h, w2, deterministic=det)


def loss_one_device(x, t, w1, w2, det):
    y = block(x, w1, w2, det).astype(F32)
    return jnp.sum((y - t) ** 2)


def dp_step(mesh, det):
    def local(x, t, w1, w2):
        return jax.lax.psum(loss_one_device(x, t, w1, w2, det), "d")

    grads = jax.grad(local, argnums=(0, 2, 3))
    return jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(P("d"), P("d"), P(), P()), out_specs=(P("d"), P(), P())))


def projection_loss(x, t, w, det):
    y = jax_cake.dense_projection(x, w, deterministic=det).astype(F32)
    return jnp.sum((y - t) ** 2)


def tp_step(mesh, det):
    def local(x, t, w):  # w: this device's [d_out / n, d_in] rows, t: the matching columns
        return jax.lax.psum(projection_loss(x, t, w, det), "d")

    grads = jax.grad(local, argnums=(0, 2))
    return jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(P(), P(None, "d"), P("d")), out_specs=(P(), P("d"))))


def median_time_us(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(FLAGS.reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main(argv):
    del argv
    devices = jax.devices()
    n = len(devices)
    if n < 2:
        print(f"FAIL need >= 2 devices, found {n}")
        sys.exit(1)
    mesh = jax.make_mesh((n,), ("d",))
    det = FLAGS.deterministic
    t_local, d, f = FLAGS.tokens_per_device, FLAGS.d_model, FLAGS.d_ff
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (n * t_local, d), F32).astype(BF16)
    t = jax.random.normal(keys[1], (n * t_local, d), F32)
    w1 = jax.random.normal(keys[2], (f, d), F32) * d**-0.5
    w2 = jax.random.normal(keys[3], (d, f), F32) * f**-0.5
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    one = functools.partial(jax.device_put, device=devices[0])
    one_step = jax.jit(jax.grad(functools.partial(loss_one_device, det=det), argnums=(0, 2, 3)))
    platform = devices[0].platform
    clock = "us (wall, block_until_ready)" if platform != "cpu" else "us (host wall time, CPU: not a GPU measurement)"
    print(
        f"{n} x {devices[0].device_kind}, jax {jax.__version__}, tokens/device {t_local}, d_model {d}, d_ff {f}, deterministic {det}"
    )

    # Data parallel: the same global batch on n devices and on one.
    ref = one_step(one(x), one(t), one(w1), one(w2))
    dp = dp_step(mesh, det)
    got = dp(put(x, P("d")), put(t, P("d")), put(w1, P()), put(w2, P()))
    errs = [rel(a, b) for a, b in zip(got, ref)]
    report(
        "data_parallel_grads",
        errs[0] < 1e-2 and errs[1] < 1e-5 and errs[2] < 1e-5,
        f"rel diff vs one device: dx {errs[0]:.2e} (bf16), dw1 {errs[1]:.2e}, dw2 {errs[2]:.2e} (fp32)",
    )

    # Tensor parallel: the first projection alone, its output columns sharded.
    tp_one = jax.jit(jax.grad(functools.partial(projection_loss, det=det), argnums=(0, 2)))
    th = jax.random.normal(jax.random.key(1), (n * t_local, f), F32)
    ref = tp_one(one(x), one(th), one(w1))
    tp = tp_step(mesh, det)
    got = tp(put(x, P()), put(th, P(None, "d")), put(w1, P("d")))
    errs = [rel(a, b) for a, b in zip(got, ref)]
    report(
        "tensor_parallel_grads",
        errs[0] < 1e-2 and errs[1] < 1e-5,
        f"rel diff vs one device: dx {errs[0]:.2e} (bf16), dw {errs[1]:.2e} (fp32)",
    )

    # Step times: n devices against one device holding the same per-device shapes.
    xl, tl = x[:t_local], t[:t_local]
    one_dp = median_time_us(one_step, one(xl), one(tl), one(w1), one(w2))
    n_dp = median_time_us(dp, put(x, P("d")), put(t, P("d")), put(w1, P()), put(w2, P()))
    one_tp = median_time_us(tp_one, one(x), one(th[:, : f // n]), one(w1[: f // n]))
    n_tp = median_time_us(tp, put(x, P()), put(th, P(None, "d")), put(w1, P("d")))
    print(f"\n| parallelism | per-device shapes | 1 device {clock} | {n} devices | ratio |")
    print("|---|---|---|---|---|")
    print(
        f"| data | x [{t_local}, {d}], w1 [{f}, {d}], w2 [{d}, {f}] | {one_dp:.0f} | {n_dp:.0f} | {n_dp / one_dp:.3f} |"
    )
    print(f"| tensor | x [{n * t_local}, {d}], w [{f // n}, {d}] | {one_tp:.0f} | {n_tp:.0f} | {n_tp / one_tp:.3f} |")
    if platform != "cpu":
        print(
            f"\nper-device step time within 5 % of one device: data {n_dp / one_dp <= 1.05}, tensor {n_tp / one_tp <= 1.05}"
        )
    sys.exit(0 if all(RESULTS) else 1)


if __name__ == "__main__":
    app.run(main)
