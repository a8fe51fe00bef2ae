"""The grouped kernels' path on CPU: the padded layout the kernels read (checked by running
the kernels' arithmetic in float64 on it: what each 128-row tile and each group's K range
computes), the plan, and the CUDA lowering of grouped_projection, ragged_dot and
moe_mlp with and without it. The kernels' own values are tests/gpu/test_grouped_gpu.py's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cake as jc
from jax_cake import contract
from jax_cake.pipeline.fused import WIDE_D_OUT
from jax_cake.planner import grouped as grouped_planner
from jax_cake.primitives import grouped
from helpers import H200, cuda_text, custom_call_lines, f64, grouped_reference64, rand

BF16, F32 = jnp.bfloat16, jnp.float32
ALIGN = contract.GROUP_ROW_ALIGN
K_TILE = grouped_planner.KERNEL_TILE[2]  # the wgrad kernel's tile_k: k_table's unit
M, K, N, G = 700, 48, 40, 6
SIZES = {
    "ragged": [130, 0, 257, 1, 0, 200],  # empty groups, a one-row group, 112 rows past the sum
    "aligned": [128, 256, 0, 128, 0, 188],
    "one_group_takes_all": [0, 0, 700, 0, 0, 0],
    "negative": [300, -5, 30, -100, 60, 10],
    "sum_above_m": [400, 290, 70, 50, 0, 3],
    "int32_max": [2**31 - 1, 5, 2**31 - 1, -(2**31), 7, 2**31 - 1],
    "all_empty": [0, 0, 0, 0, 0, 0],
}


def _row_kernel(a_pad, b, row_table, role):
    """What the fwd / dgrad kernel computes (float64): each tile t below row_table[-1] times
    weight row_table[t]; the other tiles NaN (unwritten)."""
    width = b.shape[1] if role == "fwd" else b.shape[2]
    out = np.full((a_pad.shape[0], width), np.nan)
    for t in range(int(row_table[-1])):
        rows = slice(t * ALIGN, (t + 1) * ALIGN)
        w = b[int(row_table[t])]
        out[rows] = a_pad[rows] @ (w.T if role == "fwd" else w)
    return out


def _k_kernel(dy_pad, x_pad, k_table):
    """What the wgrad kernel computes (float64): group g sums the K_TILE-row K tiles
    [k_table[g], k_table[g + 1])."""
    dw = np.zeros((len(k_table) - 1, dy_pad.shape[1], x_pad.shape[1]))
    for g in range(len(k_table) - 1):
        rows = slice(int(k_table[g]) * K_TILE, int(k_table[g + 1]) * K_TILE)
        dw[g] = dy_pad[rows].T @ x_pad[rows]
    return dw


@pytest.mark.parametrize("case", sorted(SIZES))
def test_the_kernels_arithmetic_on_the_layout_gives_the_grouped_projection(case):
    x, w, dy = rand(0, (M, K)), rand(1, (G, N, K)), rand(2, (M, N))
    sizes = jnp.asarray(SIZES[case], jnp.int32)
    layout = grouped.padded_layout(sizes, M, K_TILE)
    row_table, k_table = np.asarray(layout.row_table), np.asarray(layout.k_table)
    assert layout.capacity % ALIGN == 0 and layout.capacity >= M + (ALIGN - 1) * G
    assert row_table.shape == (layout.capacity // ALIGN + 1,) and k_table.shape == (G + 1,)
    assert 0 <= row_table[-1] <= layout.capacity // ALIGN and np.all((0 <= row_table[:-1]) & (row_table[:-1] < G))
    assert np.all(np.diff(k_table) >= 0) and k_table[-1] * K_TILE == row_table[-1] * ALIGN
    x_pad, dy_pad = f64(layout.lay_out(x)), f64(layout.lay_out(dy))
    assert x_pad.shape == (layout.capacity, K)
    ry, rdx, rdw = grouped_reference64(x, w, SIZES[case], dy)
    # The unwritten tiles are NaN: a row gathered from one would show.
    with jax.enable_x64(True):
        y = layout.gather(jnp.asarray(_row_kernel(x_pad, f64(w), row_table, "fwd")))
        dx = layout.gather(jnp.asarray(_row_kernel(dy_pad, f64(w), row_table, "dgrad")))
    dw = _k_kernel(dy_pad, x_pad, k_table)
    for got, want in ((y, ry), (dx, rdx), (dw, rdw)):
        assert not np.isnan(np.asarray(got)).any()
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)


def test_rows_between_the_groups_are_zero_and_each_row_lands_once():
    x = rand(3, (M, K))
    sizes = jnp.asarray(SIZES["ragged"], jnp.int32)
    layout = grouped.padded_layout(sizes, M, K_TILE)
    dest = np.asarray(layout.dest)
    used = dest[dest < layout.capacity]
    assert len(used) == sum(SIZES["ragged"]) and len(set(used.tolist())) == len(used)
    assert np.all(dest[sum(SIZES["ragged"]) :] == layout.capacity)  # rows past the groups: not copied
    x_pad = np.asarray(layout.lay_out(x), np.float32)
    others = np.setdiff1d(np.arange(layout.capacity), used)
    assert np.all(x_pad[others] == 0)
    starts = np.cumsum([0] + [-(-s // ALIGN) * ALIGN for s in SIZES["ragged"]])[:-1]
    assert np.all(starts % ALIGN == 0) and dest[0] == 0 and dest[130] == starts[2]
    # source is dest's inverse: the gather that lays the rows out
    source = np.asarray(layout.source)
    assert source.shape == (layout.capacity,)
    np.testing.assert_array_equal(source[used], np.flatnonzero(dest < layout.capacity))
    assert np.all(source[others] == M)


# --- the plan -----------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["grouped_fwd", "grouped_dgrad", "grouped_wgrad"])
def test_the_plan_runs_the_kernel_on_an_h200(op):
    out = "float32" if op == "grouped_wgrad" else "bfloat16"
    p = jc.plan(op, tokens=4096, groups=64, d_in=2048, d_out=1408, out_dtype=out, device=H200)
    assert p.uses_kernel and p.tile == grouped_planner.default_tile(op) and p.cluster == (1, 1) and p.groups == 64
    assert p.tile == ((128, 128, 64) if op == "grouped_wgrad" else (128, 256, 64))
    assert p.program == op and p.sm_count == 132
    assert "the grouped kernel: each group's rows laid out" in jc.explain(p)


@pytest.mark.parametrize("op,walk", [("grouped_fwd", "m4"), ("grouped_dgrad", "m4"), ("grouped_wgrad", "m16")])
def test_the_grouped_kernels_walk_in_bands(op, walk):
    # Walking M first would read the rows once per N tile; bands keep a wave's rows in L2.
    args = {"tokens": 16384, "groups": 8, "d_in": 14336, "d_out": 4096, "device": H200}
    out = "float32" if op == "grouped_wgrad" else "bfloat16"
    p = jc.plan(op, **args, out_dtype=out)
    assert p.raster == walk and p.ffi_attributes()["raster"] == contract.raster_code(walk)
    assert contract.describe_raster(walk) in p.reason
    with jc.planner.force("det", raster="m"):  # a pin wins over the rule
        assert jc.plan(op, **args, out_dtype=out).raster == "m"


def test_a_force_block_pins_a_compiled_grouped_tile():
    args = {"tokens": 16384, "groups": 8, "d_in": 4096, "d_out": 14336, "device": H200}
    narrow, wide = (128, 128, 64), (128, 256, 64)
    for op in ("grouped_fwd", "grouped_dgrad"):
        assert {narrow, wide} <= set(grouped_planner.kernel_tiles(op, "bfloat16"))
    with jc.planner.force("det", tile=narrow):
        fwd, dgrad = jc.plan("grouped_fwd", **args), jc.plan("grouped_dgrad", **args)
    assert fwd.tile == dgrad.tile == narrow and "128 tiles (forced)" in fwd.reason, fwd.reason
    with jc.planner.force("det", tile=wide):  # no grouped wgrad of that tile: its default
        wgrad = jc.plan("grouped_wgrad", **args, out_dtype="float32")
    assert wgrad.tile == narrow and "(forced)" not in wgrad.reason
    with jc.planner.force("det", tile=narrow, gemm=("grouped_dgrad", 16384, 4096, 14336)):  # one GEMM only
        assert jc.plan("grouped_dgrad", **args).tile == narrow and jc.plan("grouped_fwd", **args).tile == wide
    with jc.planner.force("det", tile=(128, 192, 64)):  # a tile no grouped variant has
        assert jc.plan("grouped_fwd", **args).tile == wide


@pytest.mark.parametrize(
    "kw,why",
    [
        ({"device": None}, "no grouped kernel for cpu"),
        ({"d_in": 2044}, "must be multiples of 8"),
    ],
)
def test_the_plan_runs_xla_where_the_kernel_cannot(kw, why):
    args = {"tokens": 4096, "groups": 64, "d_in": 2048, "d_out": 1408, "device": H200} | kw
    p = jc.plan("grouped_fwd", **args)
    assert not p.uses_kernel and why in p.reason, p.reason


def test_a_force_block_of_xla_or_split_runs_xla_and_det_the_kernel():
    args = {"tokens": 4096, "groups": 64, "d_in": 2048, "d_out": 1408, "device": H200}
    with jc.planner.force("det"):
        assert jc.plan("grouped_fwd", **args).uses_kernel
    for program, why in (("xla", "forced by jax_cake.planner.force"), ("split", "the grouped kernels have no split-K")):
        with jc.planner.force(program):
            p = jc.plan("grouped_fwd", **args)
        assert not p.uses_kernel and why in p.reason, p.reason


def test_a_k_tile_that_does_not_divide_the_row_alignment_is_refused():
    with pytest.raises(ValueError, match="k_tile=48 does not divide 128"):
        grouped.padded_layout(jnp.asarray(SIZES["ragged"], jnp.int32), M, 48)


def test_disable_runs_xla(monkeypatch):
    monkeypatch.setenv("JAX_CAKE_DISABLE", "1")
    p = jc.plan("grouped_fwd", tokens=4096, groups=64, d_in=2048, d_out=1408, device=H200)
    assert not p.uses_kernel and "JAX_CAKE_DISABLE" in p.reason


def _gated(base_args=None, **kw):
    args = {"tokens": 16384, "groups": 8, "d_in": 4096, "d_out": 2 * 14336, "device": H200} | (base_args or {})
    return grouped_planner.plan_grouped_gated(jc.plan("grouped_fwd", **args), **kw)


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_the_gated_forward_plans_the_epilogue_in_the_kernel(activation):
    p = _gated(activation=activation, block=contract.GATE_BLOCK)
    assert p.op == grouped_planner.GATED_OP and p.unfused().op == "grouped_fwd" and p.program == "grouped_fwd"
    assert p.tile == (128, 256, 64) and p.groups == 8
    assert f"the {activation} epilogue in the kernel" in jc.explain(p)
    assert jc.explain(p).startswith("grouped_fwd_gated: C[16384x28672] over K=4096, its 16384 rows in 8 groups")


@pytest.mark.parametrize(
    "base_args,kw,why",
    [
        ({}, {"block": 1}, "the weight's gate and up rows are interleaved row by row"),
        ({}, {"block": contract.GATE_BLOCK, "epilogue": False}, "the gated kernel epilogue is switched off"),
        ({"device": None}, {"block": contract.GATE_BLOCK}, None),  # the XLA plan stays as it is
    ],
)
def test_the_gated_forward_runs_the_activation_after_the_gemm_where_it_must(base_args, kw, why):
    p = _gated(base_args, activation="silu", **kw)
    assert p.op == "grouped_fwd"
    if why is not None:
        assert p.uses_kernel and f"; then an XLA pass ({why}" in p.reason, p.reason


def test_a_forced_tile_without_a_gated_variant_runs_the_activation_after_the_gemm():
    with jc.planner.force("det", tile=(128, 128, 64)):
        p = _gated(activation="silu", block=contract.GATE_BLOCK)
    assert p.op == "grouped_fwd" and "no compiled gated_silu variant of the grouped 128x128 tile" in p.reason


# --- the CUDA lowering ----------------------------------------------------------------------

TARGETS = (
    contract.GROUPED_FWD_TARGET,
    contract.GROUPED_DGRAD_TARGET,
    contract.GROUPED_WGRAD_TARGET,
    contract.GROUPED_FWD_GATED_TARGET,
)


def _train_step():
    """A new function each call: jit's trace cache would keep an earlier plan."""

    def step(x, w, sizes):
        loss = lambda x, w: jnp.sum(jc.grouped_projection(x, w, sizes).astype(F32) ** 2)
        return jax.grad(loss, argnums=(0, 1))(x, w)

    return step


def _calls(text):
    return [len(custom_call_lines(text, t)) for t in TARGETS]


def test_the_lowering_runs_the_three_kernels_and_no_ragged_dot():
    x, w = rand(0, (M, K)), rand(1, (G, N, K), F32)
    text = cuda_text(_train_step(), x, w, jnp.asarray(SIZES["ragged"], jnp.int32))
    assert _calls(text) == [1, 1, 1, 0], text
    assert '"chlo.ragged_dot"(' not in text and "ragged_dot" not in text
    (wgrad,) = custom_call_lines(text, contract.GROUPED_WGRAD_TARGET)
    assert f"tensor<{G}x{N}x{K}xf32>" in wgrad  # dw in the FP32 master's dtype, from the kernel
    (fwd,) = custom_call_lines(text, contract.GROUPED_FWD_TARGET)
    assert f"raster = {contract.raster_code('m4')} : i64" in fwd, fwd  # the banded walk reaches the kernel
    assert "tile_n = 256 : i64" in fwd, fwd


def test_disabled_the_lowering_is_xla(monkeypatch):
    monkeypatch.setenv("JAX_CAKE_DISABLE", "1")
    x, w = rand(0, (M, K)), rand(1, (G, N, K), F32)
    text = cuda_text(_train_step(), x, w, jnp.asarray(SIZES["ragged"], jnp.int32))
    assert _calls(text) == [0, 0, 0, 0]


def test_vmap_runs_xla():
    """The kernels take unbatched operands; a vmapped grouped projection runs XLA's ragged
    dot with a batch dimension (the same semantics)."""
    xs, w = rand(0, (2, M, K)), rand(1, (G, N, K))
    sizes = jnp.asarray([SIZES["ragged"], SIZES["negative"]], jnp.int32)
    fn = jax.vmap(jc.grouped_projection, in_axes=(0, None, 0))
    assert _calls(cuda_text(fn, xs, w, sizes)) == [0, 0, 0, 0]


def test_ragged_dot_and_moe_mlp_lower_to_the_kernels():
    x, rhs = rand(0, (M, K)), rand(1, (G, K, N))
    sizes = jnp.asarray(SIZES["ragged"], jnp.int32)
    # rhs [G, K, N] read as stored: ragged_dot's forward is the grouped dgrad GEMM
    assert _calls(cuda_text(lambda x, r: jc.ragged_dot(x, r, sizes), x, rhs)) == [0, 1, 0, 0]
    t, d, f, k = 64, 32, 48, 2
    xs = rand(2, (t, d))
    wg, wu, wd = rand(3, (G, f, d)), rand(4, (G, f, d)), rand(5, (G, d, f))
    ids = jax.random.randint(jax.random.key(6), (t, k), 0, G, jnp.int32)
    ew = jax.nn.softmax(rand(7, (t, k), F32), axis=-1)
    # the forward: the gated one (gate and up rows interleaved, SwiGLU in its epilogue) and the
    # down grouped GEMM
    assert _calls(cuda_text(lambda *a: jc.moe_mlp(*a), xs, wg, wu, wd, ids, ew)) == [1, 0, 0, 1]
    # a training step: dh and dx (one dgrad each), and the two weight gradients
    loss = lambda *a: jnp.sum(jc.moe_mlp(*a).astype(F32) ** 2)
    assert _calls(cuda_text(jax.grad(loss, argnums=(0, 1, 2, 3, 5)), xs, wg, wu, wd, ids, ew)) == [1, 2, 2, 1]


def test_wide_experts_get_one_weight_gradient_per_weight():
    """From d_ff = WIDE_D_OUT up, dW_gate and dW_up are two grouped wgrads, each straight
    into its [G, d_ff, d] FP32 buffer; narrower, one wgrad over the 2 d_ff rows."""
    t, d, k = 64, 32, 2
    xs = rand(2, (t, d))
    ids = jax.random.randint(jax.random.key(6), (t, k), 0, G, jnp.int32)
    ew = jax.nn.softmax(rand(7, (t, k), F32), axis=-1)
    loss = lambda *a: jnp.sum(jc.moe_mlp(*a).astype(F32) ** 2)
    for f, wgrads in ((WIDE_D_OUT, 3), (WIDE_D_OUT - 16, 2)):
        wg, wu, wd = rand(3, (G, f, d), F32), rand(4, (G, f, d), F32), rand(5, (G, d, f), F32)
        text = cuda_text(jax.grad(loss, argnums=(0, 1, 2, 3, 5)), xs, wg, wu, wd, ids, ew)
        assert _calls(text) == [1, 2, wgrads, 1], f
        shapes = [line.split("->")[-1] for line in custom_call_lines(text, contract.GROUPED_WGRAD_TARGET)]
        gate_up = f"tensor<{G}x{f}x{d}xf32>" if wgrads == 3 else f"tensor<{G}x{2 * f}x{d}xf32>"
        assert sum(gate_up in s for s in shapes) == wgrads - 1, shapes


def _gated_forward_calls(text):
    return [len(custom_call_lines(text, t)) for t in (contract.GROUPED_FWD_GATED_TARGET, contract.GROUPED_FWD_TARGET)]


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_the_gated_projection_lowers_to_one_gated_kernel(activation):
    """d_ff a multiple of GATE_BLOCK: the forward is ONE call of the gated kernel, with its
    activation's code, and no XLA activation pass reads the pre-activation back; the
    backward is the plain roles' (dgrad and the wgrads)."""
    f = 48
    x, wg, wu = rand(0, (M, K)), rand(1, (G, f, K), F32), rand(2, (G, f, K), F32)
    sizes = jnp.asarray(SIZES["ragged"], jnp.int32)
    fwd = lambda x, wg, wu: jc.grouped_gated_projection(x, wg, wu, sizes, activation=activation)
    text = cuda_text(fwd, x, wg, wu)
    assert _gated_forward_calls(text) == [1, 0], text
    (call,) = custom_call_lines(text, contract.GROUPED_FWD_GATED_TARGET)
    assert f"activation = {contract.ACTIVATION_CODES[activation]} : i64" in call, call
    assert f"tensor<{G}x{2 * f}x{K}xbf16>" in call and "tile_n = 256 : i64" in call, call
    assert "stablehlo.exponential" not in text  # no XLA pass of the activation (its sigmoid)
    loss = lambda x, wg, wu: jnp.sum(fwd(x, wg, wu).astype(F32) ** 2)
    grad = cuda_text(jax.grad(loss, argnums=(0, 1, 2)), x, wg, wu)
    assert _gated_forward_calls(grad) == [1, 0] and _calls(grad)[1:3] == [1, 1], grad


def test_the_gated_kernel_only_where_the_interleave_is_its_block():
    """d_ff not a multiple of GATE_BLOCK (rows interleaved one by one) and vmap keep the
    plain grouped forward and an XLA pass of the activation."""
    x, sizes = rand(0, (M, K)), jnp.asarray(SIZES["ragged"], jnp.int32)
    wg, wu = rand(1, (G, 40, K)), rand(2, (G, 40, K))
    text = cuda_text(lambda x, wg, wu: jc.grouped_gated_projection(x, wg, wu, sizes), x, wg, wu)
    assert _gated_forward_calls(text) == [0, 1] and "stablehlo.exponential" in text
    xs, wg, wu = rand(3, (2, M, K)), rand(4, (G, 48, K)), rand(5, (G, 48, K))
    fn = jax.vmap(lambda x: jc.grouped_gated_projection(x, wg, wu, sizes))
    assert _gated_forward_calls(cuda_text(fn, xs)) == [0, 0]  # vmapped: XLA's ragged dot


def test_grad_of_grad_lowers_through_the_unfused_forward():
    """Reverse over reverse differentiates the fused forward through its unfused form, so
    it lowers (the plain grouped forward joins the gated kernel)."""
    f = 48
    x, wg, wu = rand(0, (M, K)), rand(1, (G, f, K), F32), rand(2, (G, f, K), F32)
    sizes = jnp.asarray(SIZES["ragged"], jnp.int32)

    def inner(x, wg, wu):
        loss = lambda x: jnp.sum(jc.grouped_gated_projection(x, wg, wu, sizes).astype(F32) ** 2)
        return jnp.sum(jax.grad(loss)(x).astype(F32) ** 2)

    text = cuda_text(jax.grad(inner, argnums=(1, 2)), x, wg, wu)
    gated, plain = _gated_forward_calls(text)
    assert gated == 1 and plain >= 1, (gated, plain)
