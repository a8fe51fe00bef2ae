"""The residual add in the forward kernel (jax_cake_fwd_residual) on the GPU.

The residual r is an input aliased to the result, so instead of NaN-poisoned output memory
it starts from random non-zero bf16 values the size of x w^T (a tile the kernel did not
add, or added twice, is then off by a whole product):
  - every reduce-add fwd tile (kernel_cases.RESIDUAL_CASES: one row, K under one tile,
    ragged edges, batches, both rasters, 8192 x 14336 -> 4096) against float64 r + x w^T:
    each element within one bf16 step of the product (the tile's rounding to bf16), half a
    step of the result (the add's rounding) and the FP32 accumulation's error bound
    2 K 2^-24 sum_k |x_k w_k| (any summation order, each add rounded or truncated). That
    last term matters where r + x w^T and x w^T are both small: at 8192 x 14336 -> 4096
    (K = 14336, sum_k |x_k w_k| ~ 9e3) the FP32 sum of a product near 0.03 is off by
    ~1e-3, 6.6 times the two bf16 roundings there, for the fused call and the plain
    forward alike (H200, 2026-12-02);
  - bit for bit r + the plain forward of the same tile then XLA's add (the TMA unit adds
    the bf16 tile to r with one round to nearest, as XLA's bf16 add does);
  - the public op: values and gradients at 8192 x 14336 -> 4096 and ragged shapes, bitwise
    the same over 20 runs, and the compiled module of a jit with r donated holds the fused
    call and no copy of r, no add and no plain forward.
"""

import re

import gpu_helpers as h
import jax
import jax.numpy as jnp
import kernel_cases as cases
import numpy as np
import pytest

import jax_cake
from jax_cake import contract, primitives, reference
from jax_cake.planner.residual import plan_residual

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_library")]

# (B, T, d_in, d_out) through the public op: the down projection, ragged and batched shapes.
API_CASES = [(1, 8192, 14336, 4096), (1, 1000, 512, 264), (1, 37, 136, 64), (3, 129, 264, 72)]


def _residual_for(case_key, shape, d_in):
    """Random non-zero bf16 r, as large as x w^T (|x w^T| ~ sqrt(d_in) for unit normals)."""
    r = h.rand(h.seed_of("r", *case_key), shape, h.BF16, scale=float(np.sqrt(d_in)))
    assert not bool(jnp.any(r == 0))
    return r


@jax.jit
def _exact64(r, x, w):
    """(r + x w^T, x w^T, the FP32 accumulation's error bound) in float64."""
    x64, w64 = x.astype(h.F64), w.astype(h.F64)
    p = jnp.einsum(h.FWD, x64, w64, precision=jax.lax.Precision.HIGHEST)
    magnitude = jnp.einsum(h.FWD, jnp.abs(x64), jnp.abs(w64), precision=jax.lax.Precision.HIGHEST)
    return r.astype(h.F64) + p, p, 2.0 * x.shape[-1] * 2.0**-24 * magnitude


def _bf16_step(v):
    """The spacing of bf16 numbers at |v| (one rounding step)."""
    e = jnp.floor(jnp.log2(jnp.maximum(jnp.abs(v), 2.0**-126)))
    return jnp.exp2(e - 7)


@jax.jit
def _worst_excess(y, exact, product, accumulation):
    """max over elements of |y - exact| / (half a bf16 step of the result + one of the
    product + the FP32 accumulation's bound): <= 1 where y is within them."""
    y = y.astype(h.F64)
    bound = 0.5 * _bf16_step(jnp.maximum(jnp.abs(exact), jnp.abs(y))) + _bf16_step(product) + accumulation
    return jnp.max(jnp.abs(y - exact) / bound), jnp.sum(~jnp.isfinite(y))


def assert_within_bf16_rounding(y, r, x, w, what):
    with jax.enable_x64(True):
        exact, product, accumulation = _exact64(r, x, w)
        excess, bad = _worst_excess(y, exact, product, accumulation)
        excess, bad = float(excess), int(bad)
    assert bad == 0 and excess <= 1.0, f"{what}: |y - (r + x w^T)| reaches {excess:.2f} of the bound, nonfinite={bad}"
    h.assert_close(y, exact, h.BF16_TOL, what)


def _fused_call(case):
    attrs = h.ffi_attrs(case.tile, raster=case.raster, cluster=case.cluster)
    b, t, _, d_out = case.shape

    def run(x, w, r):
        out = jax.ShapeDtypeStruct((b, t, d_out), h.BF16)
        call = jax.ffi.ffi_call(contract.FWD_RESIDUAL_TARGET, out, input_output_aliases={2: 0})
        return call(x, w, r, **attrs)

    return jax.jit(run, donate_argnums=2)


def _case_inputs(case):
    b, t, d_in, d_out = case.shape
    x, w, _ = h.gemm_inputs(*case.shape)
    return x, w, _residual_for(("kernel",) + case.shape, (b, t, d_out), d_in)


@pytest.mark.parametrize("case", cases.params(cases.RESIDUAL_CASES))
def test_fused_call_against_float64(case):
    x, w, r = _case_inputs(case)
    fn = _fused_call(case)
    text = fn.lower(x, w, r).compile().as_text()
    assert "jax_cake_fwd_residual" in text
    y = fn(x, w, jnp.copy(r))
    assert y.dtype == h.BF16 and y.shape == r.shape
    assert_within_bf16_rounding(y, r, x, w, f"{case.id} ({case.variant().name})")


@pytest.mark.parametrize("case", cases.params(cases.RESIDUAL_CASES[-3:] + cases.RESIDUAL_CASES[4:6]))
def test_fused_call_is_r_plus_the_plain_forward_bit_for_bit(case):
    """The same tile's plain forward, then XLA's bf16 add: the kernel's K loop and its
    rounding of the tile are the same, and the TMA add rounds once to nearest."""
    x, w, r = _case_inputs(case)
    fused = _fused_call(case)(x, w, jnp.copy(r))
    plain = h.call(contract.FWD_TARGET, x, w, tile=case.tile, raster=case.raster, cluster=case.cluster)
    separate = jax.jit(reference.add_into)(r, plain)
    if not h.same_bits(fused, separate):
        diff = np.abs(np.asarray(fused, np.float32) - np.asarray(separate, np.float32))
        raise AssertionError(f"{case.id}: {int(np.sum(diff > 0))} elements differ from r + fwd (max {diff.max()})")


# --- the public op ------------------------------------------------------------------------


def _api_inputs(b, t, d_in, d_out):
    key = ("api", b, t, d_in, d_out)
    x = h.rand(h.seed_of("x", *key), (b, t, d_in))
    w = h.rand(h.seed_of("w", *key), (b, d_out, d_in), h.F32, scale=0.02)
    r = h.rand(h.seed_of("r", *key), (b, t, d_out), h.BF16, scale=float(0.02 * np.sqrt(d_in)))
    dy = h.rand(h.seed_of("dy", *key), (b, t, d_out))
    return x, w, r, dy


def _project(b):
    if b == 1:
        return lambda x, w, r: jax_cake.dense_projection(x[0], w[0], residual=r[0])[None]
    return lambda x, w, r: jax_cake.batched_projection(x, w, residual=r)


def _plain(b):
    if b == 1:
        return lambda x, w, r: reference.add_into(r, jax_cake.dense_projection(x[0], w[0])[None])
    return lambda x, w, r: reference.add_into(r, jax_cake.batched_projection(x, w))


def _plan(b, t, d_in, d_out):
    p = plan_residual(tokens=t, d_in=d_in, d_out=d_out, batch=b)
    assert p.op == "fwd_residual" and p.uses_kernel, jax_cake.explain(p)
    return p


@pytest.mark.parametrize("case", API_CASES, ids=lambda c: "B{}_T{}_{}to{}".format(*c))
def test_public_op_values_and_gradients(case):
    b = case[0]
    _plan(*case)
    x, w, r, dy = _api_inputs(*case)
    project = _project(b)
    y = jax.jit(project)(x, w, jnp.copy(r))
    assert_within_bf16_rounding(y, r, x, w.astype(h.BF16), f"{case} public op")

    def step(project):
        def f(x, w, r, dy):
            out, vjp = jax.vjp(project, x, w, r)
            return (out,) + vjp(dy)

        return jax.jit(f)

    fused = step(project)(x, w, r, dy)
    unfused = step(_plain(b))(x, w, r, dy)
    # y: within one bf16 rounding of each other (the unfused forward may plan another tile
    # or cluster, so its FP32 sum order can differ); dx, dw: the same GEMMs, bit for bit;
    # the residual's cotangent is dy.
    h.assert_close(fused[0], unfused[0], h.BF16_TOL, f"{case} y")
    for name, got, want in zip(("dx", "dw"), fused[1:3], unfused[1:3]):
        assert h.same_bits(got, want), f"{case} {name} differs from the unfused op's"
    assert h.same_bits(fused[3], dy), f"{case} dr is not dy"


def test_public_op_is_bitwise_repeatable():
    case = API_CASES[0]
    x, w, r, _ = _api_inputs(*case)
    fn = jax.jit(_project(1), donate_argnums=2)
    h.assert_repeatable(lambda: fn(x, w, jnp.copy(r)), h.REPEATS, f"{case}")


@pytest.mark.parametrize("case", API_CASES[:2], ids=lambda c: "B{}_T{}_{}to{}".format(*c))
def test_donated_residual_is_updated_in_place(case):
    """The compiled module of a jit with r donated: the fused call, no plain forward, and no
    copy of r or add over y's shape (in any fusion)."""
    _, t, _, d_out = case
    x, w, r, _ = _api_inputs(*case)
    w2, x2, r2 = w[0].astype(h.BF16), x[0], r[0]
    fn = jax.jit(lambda x, w, r: jax_cake.dense_projection(x, w, residual=r), donate_argnums=2)
    text = fn.lower(x2, w2, r2).compile().as_text()
    assert "jax_cake_fwd_residual" in text
    assert 'custom_call_target="jax_cake_fwd"' not in text
    assert "input_output_alias" in text, "the donated residual is not aliased to the output"
    shape = rf"bf16\[(1,)?{t},{d_out}\]"
    adds = [line for line in text.splitlines() if re.search(r"=\s*" + shape + r"\S*\s+add\(", line)]
    assert adds == [], "separate add over y:\n" + "\n".join(adds)
    copies = [line for line in text.splitlines() if re.search(r"=\s*" + shape + r"\S*\s+copy\(", line)]
    assert copies == [], "the donated residual is copied:\n" + "\n".join(copies)
    y = fn(x2, w2, jnp.copy(r2))
    assert_within_bf16_rounding(y[None], r, x, w2[None], f"{case} donated")


def test_xla_parity_of_the_down_projection():
    """Against XLA's own `r + jnp.dot(x, w.T)` (which its GEMM fuses as beta = 1): each
    element within one bf16 step of the product plus one of the result of XLA's, plus
    the FP32 accumulation bound of each of the two sums."""
    b, t, d_in, d_out = API_CASES[0]
    x, w, r, _ = _api_inputs(b, t, d_in, d_out)
    x2, w2, r2 = x[0], w[0].astype(h.BF16), r[0]
    ours = jax.jit(lambda x, w, r: jax_cake.dense_projection(x, w, residual=r))(x2, w2, r2)
    xla = jax.jit(lambda x, w, r: r + jnp.dot(x, w.T))(x2, w2, r2)
    with jax.enable_x64(True):
        _, product, accumulation = _exact64(r, x, w2[None])
        a, b64 = ours.astype(h.F64)[None], xla.astype(h.F64)[None]
        bound = _bf16_step(jnp.maximum(jnp.abs(a), jnp.abs(b64))) + _bf16_step(product) + 2 * accumulation
        worst = float(jnp.max(jnp.abs(a - b64) / bound))
    assert worst <= 1.0, f"jax_cake vs XLA: the largest gap is {worst:.2f} of the bound"


def test_the_planned_variants_are_in_the_library():
    from jax_cake import native
    from jax_cake.planner import variants

    names = set(native.compiled_variants())
    for case in API_CASES:
        p = _plan(*case)
        v = variants.find_variant("fwd", p.tile, p.cluster, "bfloat16", "add")
        assert v is not None and v.name in names, (case, p.tile)
    assert "add_to" in primitives.fwd.__doc__
