"""The CUDA lowering, checked on CPU for a faked H200: custom calls, plan attributes, remat."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cuda_text, custom_call_lines, faked_device

import jax_cake as jc


def _attr(call: str, name: str) -> int:
    return int(re.search(rf"\b{name} = (\d+) : i64", call).group(1))


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _train_step(deterministic=True):
    def step(x, w):
        loss = lambda x, w: jnp.sum(jc.dense_projection(x, w, deterministic=deterministic).astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1))(x, w)

    return step


@pytest.mark.parametrize("t,d_in,d_out", [(16172, 4096, 48), (16231, 5120, 512), (16384, 4096, 4096), (37, 64, 32)])
@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
def test_step_lowers_to_one_custom_call_per_gemm_with_the_plan(t, d_in, d_out, w_dtype, kernel_rules_only):
    text = cuda_text(_train_step(), _spec((t, d_in), jnp.bfloat16), _spec((d_out, d_in), w_dtype))
    fwd, dgrad, wgrad = (custom_call_lines(text, f"jax_cake_{op}") for op in ("fwd", "dgrad", "wgrad"))
    assert (len(fwd), len(dgrad), len(wgrad)) == (1, 1, 1), text
    assert "dot_general" not in text  # no XLA GEMM left on the CUDA path
    with faked_device():
        expected = jc.plan("wgrad", tokens=t, d_in=d_in, d_out=d_out, out_dtype=w_dtype)
    call = wgrad[0]
    assert (_attr(call, "tile_m"), _attr(call, "tile_n"), _attr(call, "tile_k")) == expected.tile
    assert _attr(call, "splits") == expected.splits
    assert _attr(call, "reduction") == int(expected.ffi_attributes()["reduction"])
    # dw in w's dtype, workspace sized by the plan
    dtype = "f32" if w_dtype == jnp.float32 else "bf16"
    assert f"tensor<1x{d_out}x{d_in}x{dtype}>, tensor<{expected.workspace_bytes}xui8>" in call


def test_skinny_wgrad_splits_k_to_fill_the_h200():
    with faked_device():
        p = jc.plan("wgrad", tokens=16172, d_in=4096, d_out=48, out_dtype=jnp.float32)
    assert p.algorithm == "det" and p.program == "wgrad" and p.splits > 1 and p.reduction == "ordered"
    assert 100 <= p.ctas <= 132
    assert p.workspace_bytes == p.splits * 48 * 4096 * 4


def test_unaligned_shape_lowers_to_xla_on_cuda():
    text = cuda_text(_train_step(), _spec((37, 20), jnp.bfloat16), _spec((12, 20), jnp.float32))
    assert "custom_call @jax_cake" not in text
    assert text.count("dot_general") >= 3


def test_the_xla_path_asks_xla_for_bf16_results_directly():
    """The unaligned step's fwd and dgrad on CUDA: dots with a bf16 result, not an f32
    result and a convert (cuBLAS writes bf16 itself); the FP32 dw stays an f32 dot."""
    text = cuda_text(_train_step(), _spec((37, 20), jnp.bfloat16), _spec((12, 20), jnp.float32))
    dots = [l for l in text.splitlines() if "stablehlo.dot_general" in l]
    results = sorted(re.search(r"-> tensor<[^>]*x(\w+)>$", l.strip()).group(1) for l in dots)
    assert results == ["bf16", "bf16", "f32"], dots


def test_a_bf16_result_dot_has_the_bits_of_an_fp32_dot_rounded_once():
    from jax_cake import reference

    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (1, 64, 8192), jnp.bfloat16)
    w = jax.random.normal(kw, (1, 96, 8192), jnp.bfloat16)
    once = jax.lax.dot_general(x, w, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32)
    y = reference.fwd(x, w)
    assert y.dtype == jnp.bfloat16
    assert bool(jnp.array_equal(y, once.astype(jnp.bfloat16)))


def test_round_once_has_the_bits_of_a_convert():
    """reference.round_once rounds as a convert does (to nearest even), specials included."""
    from jax_cake import reference

    x = jax.random.normal(jax.random.key(5), (4096,), jnp.float32) * 1e3
    ties = jnp.asarray([1.00390625, 1.01171875, -1.00390625], jnp.float32)  # halfway between bf16 steps
    specials = jnp.asarray([jnp.inf, -jnp.inf, jnp.nan, 3.4e38, 1e-40, -0.0, 0.0], jnp.float32)
    x = jnp.concatenate([x, ties, specials])
    got = jax.jit(reference.round_once, static_argnums=1)(x, jnp.bfloat16)
    want = np.asarray(x).astype(jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(got).view(np.uint16), want.view(np.uint16))


def _rounding_cases():
    from jax_cake import reference
    from jax_cake.pipeline import moe

    bf = lambda *s: jnp.zeros(s, jnp.bfloat16)
    sizes = jnp.zeros((4,), jnp.int32)
    return {
        "fwd": (lambda x, w: reference.fwd(x, w), (bf(1, 8, 16), bf(1, 4, 16))),
        "grouped_fwd": (lambda x, w, s: reference.grouped_fwd(x, w, s), (bf(8, 16), bf(4, 4, 16), sizes)),
        "gate": (lambda g, u: reference.gate(g, u, "silu"), (bf(8, 4), bf(8, 4))),
        "gate_grad": (lambda d, g, u: reference.gate_grad(d, g, u, "gelu"), (bf(8, 4), bf(8, 4), bf(8, 4))),
        "add_into": (reference.add_into, (bf(8, 4), bf(8, 4))),
        "combine": (lambda o, e: moe.combine(o, e, jnp.ones(e.shape, bool)), (bf(8, 2, 4), jnp.zeros((8, 2)))),
    }


@pytest.mark.parametrize("case", sorted(_rounding_cases()))
def test_every_bf16_rounding_of_the_xla_path_survives_excess_precision(case):
    """Each bf16 result the XLA path computes in FP32 is rounded by a reduce_precision, which
    XLA keeps, not by a bare convert, which XLA's excess-precision pass may drop when the next
    op reads the value back in FP32 (it does on GPU: moe_mlp's FP32 dw were 2.8e-3 off)."""
    fn, args = _rounding_cases()[case]
    text = jax.jit(fn).lower(*args).as_text()
    assert re.search(r"stablehlo.reduce_precision .*format = e8m7", text), text


def test_cpu_lowering_has_no_custom_calls():
    text = jax.jit(_train_step()).trace(_spec((64, 128), jnp.bfloat16), _spec((32, 128), jnp.float32)).lower().as_text()
    assert "custom_call @jax_cake" not in text


def test_batched_projection_is_one_launch_for_the_batch():
    def step(x, w):
        return jax.grad(lambda x, w: jnp.sum(jc.batched_projection(x, w).astype(jnp.float32) ** 2), argnums=(0, 1))(
            x, w
        )

    text = cuda_text(step, _spec((16, 4096, 128), jnp.bfloat16), _spec((16, 512, 128), jnp.bfloat16))
    fwd = custom_call_lines(text, "jax_cake_fwd")
    assert len(fwd) == 1 and "(tensor<16x4096x128xbf16>, tensor<16x512x128xbf16>) -> tensor<16x4096x512xbf16>" in fwd[0]


# --- remat ------------------------------------------------------------------------------


def _two_layer_loss(policy):
    """Two projections with a nonlinearity between: the second one's backward needs the
    first one's output, which remat either recomputes or saves."""

    def block(x, w1, w2):
        h = jax.nn.gelu(jc.dense_projection(x, w1))
        return jc.dense_projection(h, w2)

    block = jax.checkpoint(block, policy=policy)

    def loss(x, w1, w2):
        return jnp.sum(block(x, w1, w2).astype(jnp.float32) ** 2)

    return jax.grad(loss, argnums=(1, 2))


@pytest.mark.parametrize(
    "policy,fwd_calls",
    [
        (None, 3),  # plain checkpoint: both forwards, then the first one again in the backward
        (jax.checkpoint_policies.dots_saveable, 3),  # dots_saveable does not see custom calls
        (jc.remat.save_projections, 2),
        (jc.remat.save_projections_and_dots, 2),
    ],
)
def test_checkpoint_recomputes_the_forward_unless_the_policy_saves_it(policy, fwd_calls):
    args = (_spec((1024, 256), jnp.bfloat16), _spec((512, 256), jnp.float32), _spec((256, 512), jnp.float32))
    text = cuda_text(_two_layer_loss(policy), *args)
    assert len(custom_call_lines(text, "jax_cake_fwd")) == fwd_calls
    assert len(custom_call_lines(text, "jax_cake_dgrad")) == 1  # x is not differentiated: only the second layer needs dx
    assert len(custom_call_lines(text, "jax_cake_wgrad")) == 2


def test_router_step_lowers_to_the_three_router_custom_calls(monkeypatch):
    monkeypatch.setattr(jc.planner.choose, "ROUTER_KERNELS_ENABLED", True)

    def step(x, w):
        return jax.grad(lambda x, w: jnp.sum(jc.router_logits(x, w) ** 2), argnums=(0, 1))(x, w)

    text = cuda_text(step, _spec((16231, 4096), jnp.float32), _spec((256, 4096), jnp.float32))
    calls = {op: custom_call_lines(text, f"jax_cake_router_{op}") for op in ("fwd", "dgrad", "wgrad")}
    assert all(len(c) == 1 for c in calls.values()), calls
    # x goes as fp32 (split on chip); w and g as bf16 (hi, lo) pairs split once by XLA.
    w16, g16 = "tensor<256x4096xbf16>", "tensor<16231x256xbf16>"
    assert f"(tensor<16231x4096xf32>, {w16}, {w16}) -> tensor<16231x256xf32>" in calls["fwd"][0]
    assert f"({g16}, {g16}, {w16}, {w16}) -> tensor<16231x4096xf32>" in calls["dgrad"][0]
    assert f"({g16}, {g16}, tensor<16231x4096xf32>) -> (tensor<256x4096xf32>" in calls["wgrad"][0]
    with faked_device():
        wgrad = jc.plan("router_wgrad", tokens=16231, d_in=4096, d_out=256, out_dtype=jnp.float32)
    assert f"-> (tensor<256x4096xf32>, tensor<{wgrad.workspace_bytes}xui8>)" in calls["wgrad"][0]
    assert "raster" not in calls["fwd"][0] and "cluster_m" not in calls["fwd"][0]  # the router takes five attributes
    assert "dot_general" not in text


@pytest.mark.parametrize("experts", [8, 16])
def test_few_experts_lower_the_router_to_xlas_bf16x3_dot_on_cuda(experts, monkeypatch):
    """At E <= ROUTER_XLA_MAX_EXPERTS the router's three GEMMs are XLA dots with the BF16x3
    algorithm (three bf16 products, FP32 accumulation) on CUDA, one each, on the FP32
    operands: no custom call, no split copies."""
    monkeypatch.setattr(jc.planner.choose, "ROUTER_KERNELS_ENABLED", True)

    def step(x, w):
        return jax.grad(lambda x, w: jnp.sum(jc.router_logits(x, w) ** 2), argnums=(0, 1))(x, w)

    text = cuda_text(step, _spec((16384, 4096), jnp.float32), _spec((experts, 4096), jnp.float32))
    assert "custom_call @jax_cake" not in text
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 3, dots
    for line in dots:
        assert "num_primitive_operations = 3" in line and "lhs_precision_type = bf16" in line, line
        assert "accumulation_type = f32" in line and "xf32>, tensor<" in line, line


def test_every_lowered_target_is_registered_and_built():
    """The custom calls the primitives emit are the ones native.py registers and the build exports."""
    from jax_cake import build, contract, native
    from jax_cake.primitives import gemm

    used = {v for k, v in vars(gemm).items() if k.endswith("_TARGET")}
    assert used == set(native.TARGETS) == set(contract.TARGETS)
    assert {contract.handler_symbol(t) for t in contract.TARGETS} == set(build.HANDLER_SYMBOLS)


@pytest.mark.parametrize(
    "program,a_shape,b_shape,dtypes",
    [
        ("fwd", (37, 24), (16, 24), ["float32", "bfloat16", "bfloat16"]),  # x, w_hi, w_lo
        ("dgrad", (37, 16), (16, 24), ["bfloat16"] * 4),  # g_hi, g_lo, w_hi, w_lo
        ("wgrad", (37, 16), (37, 24), ["bfloat16", "bfloat16", "float32"]),  # g_hi, g_lo, x
    ],
)
def test_router_ffi_operands_split_w_and_g_once_and_exactly(program, a_shape, b_shape, dtypes):
    """What the router kernels receive: x as fp32, w and g as RNE bf16 (hi, lo) pairs, under jit."""
    import ml_dtypes
    import numpy as np

    from jax_cake import primitives
    from jax_cake.planner import router_variants

    ka, kb = jax.random.split(jax.random.key(7))
    a = jax.random.normal(ka, a_shape, jnp.float32)
    b = 0.02 * jax.random.normal(kb, b_shape, jnp.float32)
    ops = jax.jit(lambda a, b: primitives.router_ffi_operands(program, a, b))(a, b)
    assert [str(o.dtype) for o in ops] == dtypes
    pre = router_variants.PRESPLIT[program]
    it = iter(ops)
    for v, is_pre in ((a, pre[0]), (b, pre[1])):
        v = np.asarray(v)
        if not is_pre:
            np.testing.assert_array_equal(np.asarray(next(it)), v)
            continue
        hi, lo = (np.asarray(next(it)).astype(np.float32) for _ in range(2))
        want_hi = v.astype(ml_dtypes.bfloat16).astype(np.float32)  # round to nearest even
        np.testing.assert_array_equal(hi, want_hi)
        np.testing.assert_array_equal(lo, (v - want_hi).astype(ml_dtypes.bfloat16).astype(np.float32))
        assert np.all(np.abs(v - hi - lo) <= 2.0**-16 * np.abs(v))  # lo survived jit
        assert np.count_nonzero(lo) > lo.size // 2


def test_targets_from_names_another_builds_targets():
    """A second build's calls are traced under its prefix: every custom call names the
    prefixed target, and outside the context the default names come back."""
    from jax_cake import primitives

    args = (_spec((16384, 4096), jnp.bfloat16), _spec((48, 4096), jnp.float32))
    with primitives.targets_from("before__"):
        text = cuda_text(_train_step(), *args)
    for op in ("fwd", "dgrad", "wgrad"):
        assert len(custom_call_lines(text, f"before__jax_cake_{op}")) == 1, text
    assert "@jax_cake_" not in text
    text = cuda_text(_train_step(), *args)
    assert len(custom_call_lines(text, "jax_cake_fwd")) == 1 and "before__" not in text


def test_forced_pingpong_lowers_fwd_and_dgrad_with_schedule_2():
    with jc.planner.force("det", schedule="pingpong"):
        text = cuda_text(_train_step(), _spec((4096, 1024), jnp.bfloat16), _spec((512, 1024), jnp.float32))
    (fwd,), (dgrad,), (wgrad,) = (custom_call_lines(text, f"jax_cake_{op}") for op in ("fwd", "dgrad", "wgrad"))
    for call, pair in ((fwd, 1), (dgrad, 2)):  # dgrad (N = 1024, K = 512) pairs CTAs; no fwd pp pair is built
        assert (_attr(call, "schedule"), _attr(call, "tile_m"), _attr(call, "tile_n")) == (2, 128, 128)
        assert (_attr(call, "cluster_m"), _attr(call, "splits")) == (pair, 1)
    assert _attr(wgrad, "schedule") == 0


def test_split_tail_lowers_with_schedule_1_and_reduction_3():
    text = cuda_text(_train_step(), _spec((16384, 5120), jnp.bfloat16), _spec((1024, 5120), jnp.bfloat16))
    (wgrad,) = custom_call_lines(text, "jax_cake_wgrad")
    assert (_attr(wgrad, "schedule"), _attr(wgrad, "reduction"), _attr(wgrad, "splits")) == (1, 3, 4)
    (fwd,) = custom_call_lines(text, "jax_cake_fwd")
    assert _attr(fwd, "schedule") == 0
