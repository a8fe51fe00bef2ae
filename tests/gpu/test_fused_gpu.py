"""fused_projections on the GPU kernels: four skinny heads (4096 -> 48, 64, 48, 64 at
T = 16231, FP32 masters) in one compiled gradient step.

Checks, on the optimized HLO of the compiled step: exactly three jax_cake custom calls
(fwd, dgrad, wgrad) and no concatenate fed by the forward's output (the y_i are slices
of it, never stacked again; a deliberately stacking step is the control that the check
sees one; tests/test_gpu_machinery.py checks the analysis at a tiny size on CPU).
Values: y_i, dx and every dw_i against separate dense_projection calls and float64 (see
tests/test_fused.py for why these are tolerances and not bitwise: the fused GEMMs have
other shapes, so other tiles and K splits).

    pytest -m gpu tests/gpu/test_fused_gpu.py -s
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cake as jc

from helpers import f64, rel_err

BF, F32 = jnp.bfloat16, jnp.float32
T, D_IN, HEADS = 16231, 4096, (48, 64, 48, 64)


def _inputs(t=T, d_in=D_IN, heads=HEADS):
    keys = jax.random.split(jax.random.key(0), 2 * len(heads) + 1)
    x = jax.random.normal(keys[0], (t, d_in), F32).astype(BF)
    ws = tuple(0.02 * jax.random.normal(k, (d, d_in), F32) for k, d in zip(keys[1:], heads))
    cs = tuple(jax.random.normal(k, (t, d), F32) for k, d in zip(keys[1 + len(heads) :], heads))
    return x, ws, cs


def _linear_loss(ys, cs):
    """sum_i <y_i, c_i>: dy_i = c_i does not depend on y, so anything built from the
    forward's output in the step is built from the y_i themselves."""
    return sum(jnp.sum(y.astype(F32) * c) for y, c in zip(ys, cs))


def _fused_step(x, ws, cs):
    return jax.value_and_grad(lambda x, ws: _linear_loss(jc.fused_projections(x, ws), cs), argnums=(0, 1))(x, ws)


def _separate_step(x, ws, cs):
    loss = lambda x, ws: _linear_loss([jc.dense_projection(x, w) for w in ws], cs)
    return jax.value_and_grad(loss, argnums=(0, 1))(x, ws)


def _stacking_step(x, ws, cs):
    """The control: the outputs stacked again after the forward (y_1 before y_0, so XLA
    cannot fold the slices back into the forward's output)."""

    def loss(x, ws):
        ys = jc.fused_projections(x, ws)
        stacked = jnp.concatenate([ys[1], ys[0], *ys[2:]], axis=-1).astype(F32)
        return _linear_loss(ys, cs) + jnp.sum(jnp.sin(stacked))

    return jax.value_and_grad(loss, argnums=(0, 1))(x, ws)


# --- optimized-HLO analysis -----------------------------------------------------------------

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")  # unindented, ends with "{"
_INSTR = re.compile(r"^\s+(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"(?:^|[\s}\]])([a-z][a-z0-9\-]*)\(")
# Ops whose result is their called computation's root (the others call a reducer or comparator).
_RESULT_FROM_BODY = ("fusion", "call", "while", "conditional", "async-start", "async-done")


def _computations(text: str) -> tuple[dict, str]:
    """{computation: [(name, opcode, referenced names, line, is_root)]} and the entry's name."""
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        head = _HEADER.match(line)
        if head:
            current = head.group(2)
            comps[current] = []
            entry = current if head.group(1) else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if current is None or not m:
            continue
        op = _OPCODE.search(m.group(3))
        refs = re.findall(r"%([\w.\-]+)", m.group(3))
        comps[current].append((m.group(2), op.group(1) if op else "", refs, line, bool(m.group(1))))
    return comps, entry


def jax_cake_calls(text: str) -> list[str]:
    return re.findall(r'custom_call_target="(jax_cake_\w+)"', text)


def concatenates_fed_by(text: str, is_source) -> list[str]:
    """The concatenate instructions, at top level or inside fusions and other called
    computations (command buffers), whose inputs depend on the result of an instruction
    for which is_source(opcode, line) holds. Taint is tracked per tuple element."""
    comps, entry = _computations(text)
    found, memo = {}, {}

    def walk(comp: str, tainted_params: frozenset):
        """Taint of comp's root: None, True (all of it) or the tainted tuple indices."""
        key = (comp, tainted_params)
        if key in memo:
            return memo[key]
        memo[key] = None  # guards recursion
        taint, root = {}, None
        for name, op, refs, line, is_root in comps.get(comp, []):
            operands = [r for r in refs if r not in comps]
            called = [r for r in refs if r in comps]
            hits = frozenset(i for i, r in enumerate(operands) if taint.get(r))
            t = None
            if op == "parameter":
                t = True if int(re.search(r"parameter\((\d+)\)", line).group(1)) in tainted_params else None
            elif is_source(op, line):
                t = True
            elif op == "get-tuple-element":
                src, k = taint.get(operands[0]), int(re.search(r"index=(\d+)", line).group(1))
                t = True if src is True or (src and k in src) else None
            elif op == "tuple":
                t = hits or None
            else:
                bodies = [walk(c, hits) for c in called]
                if op in _RESULT_FROM_BODY and called:
                    t = next((b for b in bodies if b), None)
                else:
                    t = True if hits else None
                if t and op == "concatenate":
                    found.setdefault(line.strip(), None)
            if t:
                taint[name] = t
            if is_root:
                root = t
        memo[key] = root
        return root

    walk(entry, frozenset())
    return list(found)


def fed_by_custom_call(target: str):
    return lambda op, line: op == "custom-call" and f'custom_call_target="{target}"' in line


def _hlo(step, *args) -> str:
    return jax.jit(step).lower(*args).compile().as_text()


# --- tests -----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_fused_skinny_heads_step_is_three_custom_calls_and_never_restacks_the_outputs():
    d_out = sum(HEADS)
    for op in ("fwd", "dgrad", "wgrad"):  # the premise: the planner sends each summed GEMM to a kernel
        plan = jc.plan(op, tokens=T, d_in=D_IN, d_out=d_out, out_dtype=F32 if op == "wgrad" else BF)
        assert plan.uses_kernel, f"{op} of T={T} {D_IN}->{d_out} plans XLA, not a kernel: {jc.explain(plan)}"
    x, ws, cs = _inputs()
    text = _hlo(_fused_step, x, ws, cs)
    calls = jax_cake_calls(text)
    restacked = concatenates_fed_by(text, fed_by_custom_call("jax_cake_fwd"))
    print(f"\nfused step custom calls: {calls}\nconcatenates fed by the fwd output: {restacked or 'none'}")
    assert sorted(c.split("_")[2] for c in calls) == ["dgrad", "fwd", "wgrad"], calls
    assert "__cublas" not in text and "__triton_gemm" not in text  # no XLA GEMM left
    assert restacked == [], restacked

    separate = jax_cake_calls(_hlo(_separate_step, x, ws, cs))
    assert len(separate) == 3 * len(HEADS), separate  # what fusing saves: 12 launches -> 3

    control = concatenates_fed_by(_hlo(_stacking_step, x, ws, cs), fed_by_custom_call("jax_cake_fwd"))
    assert control, "the check found no concatenate in a step that stacks the outputs"


@pytest.mark.gpu
def test_fused_values_match_separate_calls_and_float64():
    x, ws, cs = _inputs()
    fwd = jax.jit(lambda x, ws: jc.fused_projections(x, ws))
    ys = fwd(x, ws)
    ys_sep = [jax.jit(jc.dense_projection)(x, w) for w in ws]
    loss, (dx, dws) = jax.jit(_fused_step)(x, ws, cs)
    loss_sep, (dx_sep, dws_sep) = jax.jit(_separate_step)(x, ws, cs)

    x64 = f64(x)
    w64 = [f64(w.astype(BF)) for w in ws]
    # The op's cotangents are y's dtype: bf16(c_i) is what the GEMMs multiply.
    c64 = [f64(c.astype(BF)) for c in cs]
    for y, y_sep, w in zip(ys, ys_sep, w64):
        assert y.dtype == BF
        assert rel_err(y.astype(F32), y_sep.astype(F32)) < 4e-3  # a few bf16 roundings flipped at most
        assert rel_err(y.astype(F32), x64 @ w.T) < 1e-2
    assert abs(float(loss) - float(loss_sep)) <= 1e-2 * abs(float(loss_sep)) + 1e-3

    # dx: one FP32 sum over K = 224 (rounded once) vs four bf16 partials added in bf16.
    dx64 = sum(c @ w for c, w in zip(c64, w64))
    err, err_sep = rel_err(dx.astype(F32), dx64), rel_err(dx_sep.astype(F32), dx64)
    print(f"\ndx rel err vs float64: fused {err:.3e}, separate {err_sep:.3e}")
    assert dx.dtype == BF and err < 1e-2 and err <= 1.05 * err_sep
    for dw, dw_sep, c in zip(dws, dws_sep, c64):
        assert dw.dtype == F32  # FP32 masters: FP32 gradients straight from the accumulator
        assert rel_err(dw, dw_sep) < 1e-6  # same sums, other K splits
        assert rel_err(dw, c.T @ x64) < 1e-5


@pytest.mark.gpu
def test_fused_deterministic_step_is_bitwise_repeatable():
    x, ws, cs = _inputs()
    step = jax.jit(_fused_step)
    first = [np.asarray(a) for a in jax.tree.leaves(step(x, ws, cs))]
    for _ in range(3):
        for a, b in zip(first, jax.tree.leaves(step(x, ws, cs))):
            np.testing.assert_array_equal(a, np.asarray(b))
