"""Gradient accumulation (`grad_accumulator=`) on CPU: values, validation, plans, and the
CUDA lowering of a micro-batch scan step (faked H200)."""

import logging
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cake as jc
from helpers import REPO, assert_raises_naming, child_env, custom_call_lines, f64, faked_device, rand, rel_err
from jax_cake import primitives
from jax_cake.pipeline import projection
from jax_cake.primitives import gemm
from jax_cake.planner import variants
from jax_cake.planner.accumulate import plan_accumulate

F32, BF16 = jnp.float32, jnp.bfloat16
MICRO = 4


def _loss(project):
    def loss(w, acc, x, dy):
        y = project(x, w, acc)
        return jnp.sum(y.astype(F32) * dy.astype(F32))

    return loss


def _dense(x, w, acc):
    return jc.dense_projection(x, w, grad_accumulator=acc)


def _batched(x, w, acc):
    return jc.batched_projection(x, w, grad_accumulator=acc)


def _scan_sum(project, w, acc0, xs, dys):
    loss = _loss(project)

    def step(acc, mb):
        return jax.grad(loss, argnums=1)(w, acc, *mb), None

    return jax.lax.scan(step, acc0, (xs, dys))[0]


def _plain_grads(project, w, xs, dys):
    def loss(w, x, dy):
        return jnp.sum(project(x, w).astype(F32) * dy.astype(F32))

    return [jax.grad(loss)(w, xs[i], dys[i]) for i in range(xs.shape[0])]


@pytest.mark.parametrize("w_dtype", [F32, BF16])
def test_dense_accumulated_gradient_is_the_sum_of_the_micro_batch_gradients(w_dtype):
    t, d_in, d_out = 48, 64, 40
    xs, dys = rand(0, (MICRO, 2, t, d_in), BF16), rand(1, (MICRO, 2, t, d_out), BF16)
    w = rand(2, (d_out, d_in), w_dtype)
    acc0 = rand(3, (d_out, d_in), F32)  # a running sum already holding earlier steps
    total = jax.jit(lambda w, a, x, d: _scan_sum(_dense, w, a, x, d))(w, acc0, xs, dys)
    # A bf16 weight's own gradient is rounded to bf16; the sum takes the FP32 one, which is
    # what an FP32 copy of the weight gets (the products use the same bf16 values).
    grads = _plain_grads(lambda x, w: jc.dense_projection(x, w), w.astype(F32), xs, dys)
    expected = f64(acc0) + sum(f64(g) for g in grads)
    assert total.dtype == F32 and total.shape == w.shape
    np.testing.assert_allclose(f64(total), expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())
    # and that sum is dw's: acc0 + sum over micro-batches of dy^T x, in float64
    assert rel_err(total, f64(acc0) + np.einsum("mbto,mbti->oi", f64(dys), f64(xs))) < 1e-5


def test_batched_accumulated_gradient_is_the_sum_of_the_micro_batch_gradients():
    b, t, d_in, d_out = 3, 32, 64, 16
    xs, dys = rand(4, (MICRO, b, t, d_in), BF16), rand(5, (MICRO, b, t, d_out), BF16)
    w = rand(6, (b, d_out, d_in), F32)
    acc0 = jnp.zeros((b, d_out, d_in), F32)
    total = jax.jit(lambda w, a, x, d: _scan_sum(_batched, w, a, x, d))(w, acc0, xs, dys)
    grads = _plain_grads(lambda x, w: jc.batched_projection(x, w), w, xs, dys)
    expected = sum(f64(g) for g in grads)
    np.testing.assert_allclose(f64(total), expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())
    assert rel_err(total, np.einsum("mbto,mbti->boi", f64(dys), f64(xs))) < 1e-5


def test_forward_and_dx_are_unchanged_and_w_gets_a_zero_cotangent():
    x, w, dy = rand(7, (24, 32), BF16), rand(8, (16, 32), F32), rand(9, (24, 16), BF16)
    acc = rand(10, (16, 32), F32)
    y_acc, vjp_acc = jax.vjp(lambda x, w, a: jc.dense_projection(x, w, grad_accumulator=a), x, w, acc)
    y, vjp = jax.vjp(lambda x, w: jc.dense_projection(x, w), x, w)
    dx_acc, dw_acc, new_acc = vjp_acc(dy)
    dx, dw = vjp(dy)
    np.testing.assert_array_equal(np.asarray(y_acc, np.float32), np.asarray(y, np.float32))
    np.testing.assert_array_equal(np.asarray(dx_acc, np.float32), np.asarray(dx, np.float32))
    assert not np.any(np.asarray(dw_acc))
    np.testing.assert_allclose(np.asarray(new_acc), np.asarray(acc) + np.asarray(dw), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(
    "acc_shape,acc_dtype,error,words",
    [
        ((16, 32), BF16, TypeError, ["grad_accumulator", "float32", "bfloat16"]),
        ((16, 32), jnp.float16, TypeError, ["grad_accumulator", "float32", "float16"]),
        ((32, 16), F32, ValueError, ["grad_accumulator", "(16, 32)", "(32, 16)"]),
        ((1, 16, 32), F32, ValueError, ["grad_accumulator", "(16, 32)", "(1, 16, 32)"]),
    ],
)
def test_dense_validation_names_the_accumulator(acc_shape, acc_dtype, error, words):
    x, w = jnp.zeros((8, 32), BF16), jnp.zeros((16, 32), F32)
    acc = jnp.zeros(acc_shape, acc_dtype)
    assert_raises_naming(error, "dense_projection: ", words, lambda: jc.dense_projection(x, w, grad_accumulator=acc))


def test_batched_validation_names_the_accumulator():
    x, w = jnp.zeros((2, 8, 32), BF16), jnp.zeros((2, 16, 32), BF16)
    with pytest.raises(ValueError, match=r"batched_projection: grad_accumulator must have w's shape \(2, 16, 32\)"):
        jc.batched_projection(x, w, grad_accumulator=jnp.zeros((16, 32), F32))
    with pytest.raises(TypeError, match="batched_projection: grad_accumulator must be an array"):
        jc.batched_projection(x, w, grad_accumulator=[0.0])


def test_plans_on_the_h200():
    with faked_device():
        square = plan_accumulate(tokens=8192, d_in=4096, d_out=4096)
        skinny = plan_accumulate(tokens=8192, d_in=4096, d_out=48)
    assert square.op == "wgrad_accumulate" and square.splits == 1 and square.reduction == "none"
    assert variants.find_variant("wgrad", square.tile, (1, 1), "float32", "add") is not None
    assert square.tile == (128, 128, 64)  # 64-row tiles only where memory bound
    # Skinny: whole tiles would leave most SMs idle; ordered splits, summed into the sum.
    assert skinny.op == "wgrad_accumulate" and skinny.splits > 1 and skinny.reduction == "ordered"
    assert skinny.workspace_bytes == skinny.splits * 48 * 4096 * 4
    for p in (square, skinny):
        assert variants.supports(
            "wgrad", p.tile, p.cluster, "float32", p.splits, int(p.ffi_attributes()["reduction"]), accumulate=True
        )
        assert p.deterministic and "gradient accumulation" in p.reason


def test_no_accumulating_variant_falls_back_to_wgrad_and_an_add(monkeypatch, caplog):
    real = variants.supports

    def no_accumulate(*args, accumulate=False, **kwargs):
        return False if accumulate else real(*args, **kwargs)

    monkeypatch.setattr(variants, "supports", no_accumulate)
    with faked_device(), caplog.at_level(logging.WARNING):
        p = plan_accumulate(tokens=8192, d_in=5120, d_out=1024, batch=2)  # no plan-table row here
        text = _step_text(8192, 5120, 1024)
    assert p.op == "wgrad" and p.uses_kernel and "separate add" in p.reason
    assert any("separate add" in r.getMessage() for r in caplog.records)
    assert custom_call_lines(text, "jax_cake_wgrad_accumulate") == [] and len(custom_call_lines(text, "jax_cake_wgrad")) == 1
    assert _f32_adds(text, 1024, 5120), "the fallback must add dw into the sum"


def test_unaligned_shapes_run_the_xla_reference_on_cuda():
    with faked_device():
        p = plan_accumulate(tokens=100, d_in=4096, d_out=12)
        text = _step_text(100, 4096, 12)
    assert not p.uses_kernel
    assert "custom_call @jax_cake" not in text


# --- the CUDA lowering of a scan step ---------------------------------------------------


def _f32_adds(text: str, d_out: int, d_in: int) -> list[str]:
    """Elementwise f32 adds over a [d_out, d_in] (or [1, d_out, d_in]) tensor."""
    pattern = re.compile(rf"stablehlo\.add .*tensor<(1x)?{d_out}x{d_in}xf32>")
    return [line for line in text.splitlines() if pattern.search(line)]


def _step_text(t: int, d_in: int, d_out: int) -> str:
    """A jitted 4-micro-batch accumulation step, the sum donated, lowered for CUDA."""

    def step(w, acc, xs, dys):
        return _scan_sum(_dense, w, acc, xs, dys)

    args = (
        jax.ShapeDtypeStruct((d_out, d_in), F32),
        jax.ShapeDtypeStruct((d_out, d_in), F32),
        jax.ShapeDtypeStruct((MICRO, t, d_in), BF16),
        jax.ShapeDtypeStruct((MICRO, t, d_out), BF16),
    )
    return jax.jit(step, donate_argnums=1).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _attr(call: str, name: str) -> int:
    return int(re.search(rf"\b{name} = (\d+) : i64", call).group(1))


@pytest.mark.parametrize("t,d_in,d_out", [(8192, 4096, 4096), (8192, 4096, 48)])
def test_scan_step_lowers_to_the_accumulating_call_in_place(t, d_in, d_out):
    with faked_device():
        text = _step_text(t, d_in, d_out)
        p = plan_accumulate(tokens=t, d_in=d_in, d_out=d_out)
    (call,) = custom_call_lines(text, "jax_cake_wgrad_accumulate")
    # acc (operand 2) is the result 0's buffer; the donated sum is the step's output.
    alias = "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [0], operand_index = 2"
    assert alias in call
    assert "tf.aliasing_output = 0" in text
    assert (_attr(call, "tile_m"), _attr(call, "tile_n"), _attr(call, "tile_k")) == p.tile
    assert _attr(call, "splits") == p.splits
    assert _attr(call, "reduction") == int(p.ffi_attributes()["reduction"])
    assert f"tensor<1x{d_out}x{d_in}xf32>, tensor<{p.workspace_bytes}xui8>" in call
    # No wgrad, no dgrad (dx is unused), no XLA GEMM and no separate add or reduce over dw.
    for target in ("jax_cake_wgrad", "jax_cake_dgrad"):
        assert custom_call_lines(text, target) == [], target
    assert "dot_general" not in text
    assert _f32_adds(text, d_out, d_in) == []
    assert not re.search(rf"stablehlo\.reduce.*tensor<1x{d_out}x{d_in}xf32>", text)


def test_grad_accumulator_is_a_keyword_of_both_ops():
    import inspect

    for fn in (jc.dense_projection, jc.batched_projection):
        param = inspect.signature(fn).parameters["grad_accumulator"]
        assert param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is None
    assert "add_to" in primitives.wgrad.__doc__


def test_example_runs_on_cpu():
    env = child_env(drop=("XLA_FLAGS",), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "grad_accumulation.py"), "--steps=8", "--micro_batches=4",
         "--tokens=32", "--d_model=32", "--lr=0.3", "--log_every=1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "accumulated gradient matches the sum of micro-batch gradients" in proc.stdout, proc.stdout
    losses = [float(v) for v in re.findall(r"^step\s+\d+\s+loss\s+(\S+)", proc.stdout, re.MULTILINE)]
    assert len(losses) >= 2 and losses[-1] < 0.9 * losses[0], proc.stdout


# --- out_sharding, sharded operands, vmap --------------------------------------------------

from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402



def _grad_sum(x, w, acc, dy):
    return jax.grad(lambda a: jnp.sum(jc.dense_projection(x, w, grad_accumulator=a).astype(F32) * dy.astype(F32)))(acc)


def _explicit_mesh():
    return jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


@pytest.mark.parametrize("fn", ["dense", "batched"])
def test_invalid_out_sharding_with_an_accumulator_raises(fn):
    x, w = jnp.zeros((2, 8, 32), BF16), jnp.zeros((2, 16, 32), F32)
    if fn == "dense":
        x, w = x[0], w[0]
    call = getattr(jc, f"{fn}_projection")
    assert_raises_naming(
        TypeError, f"{fn}_projection: ", ["out_sharding"],
        lambda: call(x, w, grad_accumulator=jnp.zeros(w.shape, F32), out_sharding="rows"),
    )
    with pytest.raises(ValueError, match="out_sharding"):
        call(x, w, grad_accumulator=jnp.zeros(w.shape, F32), out_sharding=P("nope"))


@pytest.mark.parametrize("fn", ["dense", "batched"])
def test_out_sharding_with_an_accumulator_is_applied(fn):
    x, w = rand(11, (2, 8, 32), BF16), rand(12, (2, 16, 32), F32)
    if fn == "dense":
        x, w = x[0], w[0]
    call = getattr(jc, f"{fn}_projection")
    want = P(*([None] * (x.ndim - 1)), "model")
    with jax.set_mesh(_explicit_mesh()):
        xs, ws, accs = (jax.device_put(v, P("data")) for v in (x, w, jnp.zeros(w.shape, F32)))
        y = jax.jit(lambda x, w, a: call(x, w, grad_accumulator=a, out_sharding=want))(xs, ws, accs)
        assert jax.typeof(y).sharding.spec == want
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(call(x, w), np.float32))


@pytest.mark.parametrize(
    "x_spec,w_spec,acc_spec",
    [
        (P("data"), P("model"), P()),  # a replicated sum next to a model-sharded weight
        (P("data"), P(), P("data")),  # a sum sharded on the data axis
        (P("data"), P("model"), P("data", "model")),
        (P(None, "model"), P(None, "model"), P("model")),
    ],
)
def test_explicit_axes_the_new_sum_has_the_sums_sharding_and_value(x_spec, w_spec, acc_spec):
    x, w, acc, dy = rand(13, (16, 32), BF16), rand(14, (16, 32), F32), rand(15, (16, 32), F32), rand(16, (16, 16), BF16)
    expected = np.asarray(_grad_sum(x, w, acc, dy))
    with jax.set_mesh(_explicit_mesh()):
        args = [jax.device_put(v, s) for v, s in ((x, x_spec), (w, w_spec), (acc, acc_spec), (dy, P()))]
        out = jax.jit(_grad_sum)(*args)
        assert jax.typeof(out).sharding.spec == jax.typeof(args[2]).sharding.spec
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=1e-5)


def test_named_sharding_operands_without_a_mesh_run_the_partitioned_wgrad(monkeypatch):
    with faked_device():
        kernel_plan = plan_accumulate(tokens=8192, d_in=4096, d_out=4096)
    assert kernel_plan.op == "wgrad_accumulate"
    monkeypatch.setattr(projection, "plan_accumulate", lambda **sizes: kernel_plan)
    dispatched = []
    real = gemm.dispatch

    def spy(plan, *args, **kwargs):
        dispatched.append(plan.op)
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(gemm, "dispatch", spy)
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
    x, dy = rand(17, (64, 32), BF16), rand(18, (64, 16), BF16)
    w, acc = rand(19, (16, 32), F32), rand(20, (16, 32), F32)
    args = [
        jax.device_put(v, NamedSharding(mesh, s)) for v, s in ((x, P("data")), (w, P()), (acc, P()), (dy, P("data")))
    ]
    step = jax.jit(lambda x, w, a, d: _grad_sum(x, w, a, d))
    hlo = step.lower(*args).compile().as_text()
    # The fused call has no partitioning rule: it must not run here (XLA would replicate it,
    # all-gathering dy and x); the partitioned wgrad and an add run instead.
    assert "wgrad_accumulate" not in dispatched
    assert not re.search(r"all-gather", hlo), hlo
    np.testing.assert_allclose(np.asarray(step(*args)), np.asarray(_grad_sum(x, w, acc, dy)), rtol=1e-6, atol=1e-5)
    # One device (a one-device mesh): the fused call runs.
    dispatched.clear()
    with jax.set_mesh(jax.make_mesh((1,), ("data",))):
        jax.jit(_grad_sum).trace(x, w, acc, dy)
    assert "wgrad_accumulate" in dispatched


def _vmapped_step(in_axes):
    return jax.vmap(lambda w, acc, x, dy: _grad_sum(x, w, acc, dy), in_axes=in_axes)


@pytest.mark.parametrize("in_axes", [(None, 0, 0, 0), (None, None, 0, 0), (0, 0, 0, 0)])
def test_vmap_of_an_accumulating_step_lowers_to_one_call_and_equals_the_loop(in_axes):
    v, t, d_in, d_out = 4, 8192, 4096, 4096
    shapes = [(d_out, d_in), (d_out, d_in), (t, d_in), (t, d_out)]
    dtypes = [F32, F32, BF16, BF16]
    specs = [jax.ShapeDtypeStruct(((v,) if a == 0 else ()) + s, d) for a, s, d in zip(in_axes, shapes, dtypes)]
    with faked_device():
        text = jax.jit(_vmapped_step(in_axes)).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
        p = plan_accumulate(tokens=t, d_in=d_in, d_out=d_out, batch=v)
    assert "while" not in text
    (call,) = custom_call_lines(text, "jax_cake_wgrad_accumulate")
    assert f"tensor<{v}x{d_out}x{d_in}xf32>, tensor<{p.workspace_bytes}xui8>" in call  # V folded into B
    assert custom_call_lines(text, "jax_cake_wgrad") == []
    # CPU values: those of a per-element loop.
    small = [(16, 32), (16, 32), (24, 32), (24, 16)]
    args = [rand(30 + i, ((3,) if a == 0 else ()) + s, d) for i, (a, s, d) in enumerate(zip(in_axes, small, dtypes))]
    got = jax.jit(_vmapped_step(in_axes))(*args)
    for i in range(3):
        w, acc, x, dy = (a[i] if ax == 0 else a for a, ax in zip(args, in_axes))
        np.testing.assert_allclose(np.asarray(got[i]), np.asarray(_grad_sum(x, w, acc, dy)), rtol=1e-6, atol=1e-5)
