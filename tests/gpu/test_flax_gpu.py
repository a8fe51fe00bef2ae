"""Flax models with `dot_general=jax_cake.dot_general, promote_dtype=jax_cake.promote_dtype`
on the GPU: every Dense lowers to jax_cake custom calls, the compiled HLO holds no
transpose (or layout-changing copy) of a weight, and values and gradients match the
plain Flax model and float64 references. Run with `pytest -m gpu`."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cake as jc

import gpu_helpers as h

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_library")]

BF16, F32 = jnp.bfloat16, jnp.float32
HOOKS = dict(dot_general=jc.dot_general, promote_dtype=jc.promote_dtype)
MIXED = dict(dtype=BF16, param_dtype=F32)
TOKENS, D_MODEL, HEADS, HEAD_DIM, D_FF = 2048, 256, 8, 64, 1024


class Model(nn.Module):
    """Dense -> GELU -> DenseGeneral (heads) -> DenseGeneral (two contracted axes) -> Dense."""

    use_jax_cake: bool

    @nn.compact
    def __call__(self, x):
        kw = dict(MIXED, **(HOOKS if self.use_jax_cake else {}))
        h_ = jax.nn.gelu(nn.Dense(D_FF, **kw)(x))
        h_ = nn.DenseGeneral((HEADS, HEAD_DIM), **kw)(h_)
        h_ = jax.nn.gelu(nn.DenseGeneral(D_MODEL, axis=(-2, -1), **kw)(h_))
        return nn.Dense(D_MODEL, use_bias=False, **kw)(h_)


N_LAYERS = 4


def _inputs():
    x = h.rand(1, (TOKENS, D_MODEL))
    params = Model(False).init(jax.random.key(0), x)
    g = h.rand(2, (TOKENS, D_MODEL))
    return x, params, g


def _step(use_jax_cake):
    model = Model(use_jax_cake)

    @jax.jit
    def step(params, x, g):
        y, vjp = jax.vjp(model.apply, params, x)
        dparams, dx = vjp(g)
        return y, dx, dparams

    return step


def _kernel_shapes(params):
    """Every kernel's dims, as stored and flattened to [K, N] / [1, K, N], both orders."""
    shapes = set()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if "kernel" not in jax.tree_util.keystr(path):
            continue
        dims = tuple(leaf.shape)
        for split in range(1, len(dims)):
            k, n = int(np.prod(dims[:split])), int(np.prod(dims[split:]))
            shapes |= {(k, n), (n, k), (1, k, n), (1, n, k)}
        shapes |= {dims, dims[::-1]}
    return shapes


_SHAPED_OP = re.compile(r"= (?:bf16|f32)\[([\d,]*)\]\{([\d,]*)\}\S* (transpose|copy)\(")


def _weight_relayouts(hlo: str, shapes) -> list[str]:
    """transpose ops, and copies into a non-default layout, producing a weight-shaped tensor."""
    found = []
    for line in hlo.splitlines():
        m = _SHAPED_OP.search(line)
        if not m:
            continue
        dims = tuple(int(d) for d in m.group(1).split(",") if d)
        layout = tuple(int(d) for d in m.group(2).split(",") if d)
        relayout = m.group(3) == "transpose" or layout != tuple(range(len(dims) - 1, -1, -1))
        if relayout and dims in shapes:
            found.append(line.strip())
    return found


def test_every_dense_runs_on_jax_cake_without_weight_transposes():
    x, params, g = _inputs()
    step = _step(True)
    lowered = step.lower(params, x, g)
    text = lowered.as_text()
    # forward on the dgrad GEMM, dx on fwd, the kernel gradient on wgrad: one each per layer
    assert [h.custom_calls(text, f"jax_cake_{op}") for op in ("dgrad", "fwd", "wgrad")] == [N_LAYERS] * 3, text
    assert "stablehlo.transpose" not in text and "dot_general" not in text
    hlo = lowered.compile().as_text()
    for op in ("dgrad", "fwd", "wgrad"):
        assert hlo.count(f'custom_call_target="jax_cake_{op}"') == N_LAYERS, hlo
    assert _weight_relayouts(hlo, _kernel_shapes(params)) == [], hlo


def test_values_and_gradients_match_the_plain_model():
    x, params, g = _inputs()
    y, dx, dparams = _step(True)(params, x, g)
    y_ref, dx_ref, dparams_ref = _step(False)(params, x, g)
    assert h.rel_err(y, y_ref) < 2e-2 and h.rel_err(dx, dx_ref) < 2e-2
    for (path, ours), ref in zip(jax.tree_util.tree_leaves_with_path(dparams), jax.tree.leaves(dparams_ref)):
        assert ours.dtype == ref.dtype == F32, path
        assert h.rel_err(ours, ref) < 2e-2, jax.tree_util.keystr(path)


@pytest.mark.parametrize(
    "features,axis,x_shape",
    [(512, -1, (4096, 1024)), ((8, 128), -1, (3, 1011, 512)), (1024, (-2, -1), (2048, 8, 64))],
    ids=["dense", "dense_general_heads", "dense_general_axes"],
)
def test_layer_against_float64(features, axis, x_shape):
    """One layer: y and dx within bf16 rounding, the FP32 kernel gradient within 1e-5 of
    float64 (from the accumulator, not bf16-rounded)."""
    layer = nn.DenseGeneral(features, axis=axis, use_bias=False, **MIXED, **HOOKS)
    x = h.rand(3, x_shape)
    params = layer.init(jax.random.key(1), x)
    g = h.rand(4, jax.eval_shape(layer.apply, params, x).shape)

    @jax.jit
    def step(params, x, g):
        y, vjp = jax.vjp(layer.apply, params, x)
        return (y,) + vjp(g)

    y, dparams, dx = step(params, x, g)
    kernel = h.f64(params["params"]["kernel"].astype(BF16))
    xr, gr = h.f64(x), h.f64(g)
    n_contract = kernel.ndim - (1 if isinstance(features, int) else len(features))
    lead = xr.ndim - n_contract
    y_ref = np.tensordot(xr, kernel, axes=n_contract)
    dx_ref = np.tensordot(gr, kernel, axes=(list(range(lead, gr.ndim)), list(range(n_contract, kernel.ndim))))
    dk_ref = np.tensordot(xr, gr, axes=(list(range(lead)), list(range(lead))))
    dk = dparams["params"]["kernel"]
    assert h.rel_err(y, y_ref) < h.BF16_TOL and h.rel_err(dx, dx_ref) < h.BF16_TOL
    assert dk.dtype == F32 and h.rel_err(dk, dk_ref) < h.F32_TOL
    assert not np.array_equal(np.asarray(dk), np.asarray(dk.astype(BF16).astype(F32)))


def test_disable_env_runs_xla_with_the_same_values(monkeypatch):
    x, params, g = _inputs()
    y, dx, dparams = _step(True)(params, x, g)
    monkeypatch.setenv("JAX_CAKE_DISABLE", "1")
    step = _step(True)  # a fresh jit: plans are made at trace time
    assert "custom_call @jax_cake" not in step.lower(params, x, g).as_text()
    y2, dx2, dparams2 = step(params, x, g)
    assert h.rel_err(y2, y) < 1e-2 and h.rel_err(dx2, dx) < 1e-2
    for a, b in zip(jax.tree.leaves(dparams2), jax.tree.leaves(dparams)):
        assert h.rel_err(a, b) < 1e-2


@pytest.mark.full  # the example in a fresh process
def test_flax_train_example_on_gpu():
    from test_flax import run_flax_example

    stdout = run_flax_example(platform="cuda")
    assert stdout.startswith("backend gpu") and "projections on jax_cake" in stdout
