"""Shared test utilities (the CPU tests' and, through tests/gpu/gpu_helpers.py, the GPU
tests'): random inputs, float64 conversion and relative error, the faked H200.

Importing this module starts no backend."""

import contextlib
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from jax_cake import contract

REPO = pathlib.Path(__file__).resolve().parents[1]


def child_env(drop=(), **overrides) -> dict:
    """The environment of a child Python process that runs a script of this checkout: the
    checkout first on PYTHONPATH (a script run by path does not see the repository, and
    jax_cake need not be installed), `overrides` set and the variables in `drop` removed."""
    env = dict(os.environ, **overrides)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for name in drop:
        env.pop(name, None)
    return env


BF16 = jnp.bfloat16


def rand(seed: int, shape, dtype=BF16, scale: float = 1.0):
    """Normal values from jax.random.key(seed) (never all zeros), times `scale`, rounded to
    dtype once (after the scaling)."""
    v = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
    if scale != 1.0:
        v = v * scale
    return v.astype(dtype)


def f64(a) -> np.ndarray:
    """`a` (a jax or numpy array of any dtype, bf16 included; a device array is copied to
    the host) as a float64 numpy array: every bf16 and fp32 value exactly."""
    return np.asarray(a).astype(np.float64)


def assert_raises_naming(error, prefix: str, words, call) -> None:
    """call() raises `error`, its message starting with `prefix` and holding every word."""
    with pytest.raises(error) as e:
        call()
    msg = str(e.value)
    assert msg.startswith(prefix), msg
    for word in words:
        assert word in msg, msg


def _rel_err_terms(xp, out, ref):
    """||out - ref|| / ||ref|| with out's NaN/Inf counted as 0, and how many there are
    (xp: numpy, or jax.numpy inside jit; out and ref already float64)."""
    finite = xp.isfinite(out)
    diff = xp.where(finite, out, 0.0) - ref
    err = xp.linalg.norm(diff.ravel()) / xp.maximum(xp.linalg.norm(ref.ravel()), 1e-30)
    return err, xp.sum(~finite)


@jax.jit
def _rel_err_jit(out, ref):
    return _rel_err_terms(jnp, out.astype(jnp.float64), ref.astype(jnp.float64))


def _rel_err_on_device(out, ref) -> tuple[float, int]:
    """rel_err_nonfinite computed by XLA on out's device (float64 enabled for the call)."""
    with jax.enable_x64(True):
        err, nonfinite = _rel_err_jit(out, ref)
        return float(err), int(nonfinite)


def _on_accelerator(a) -> bool:
    return isinstance(a, jax.Array) and any(d.platform != "cpu" for d in a.devices())


def rel_err_nonfinite(out, ref) -> tuple[float, int]:
    """(||out - ref|| / ||ref||, number of NaN/Inf in out), in float64, the non-finite
    elements of out counted as 0 in the norm (an unwritten NaN-poisoned element shows in the
    count, not as a NaN error). Raises AssertionError if the shapes differ.

    An accelerator array is measured on its device (no float64 copy of a large output on the
    host); anything else in numpy."""
    if tuple(np.shape(out)) != tuple(np.shape(ref)):
        raise AssertionError(f"shape {tuple(np.shape(out))} != reference {tuple(np.shape(ref))}")
    if _on_accelerator(out):
        return _rel_err_on_device(out, ref)
    err, nonfinite = _rel_err_terms(np, f64(out), f64(ref))
    return float(err), int(nonfinite)


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (rel_err_nonfinite), asserting out holds no NaN/Inf."""
    err, nonfinite = rel_err_nonfinite(out, ref)
    assert nonfinite == 0, f"{nonfinite} non-finite values in the output"
    return err


def assert_same_values(out, want) -> None:
    """out == want bitwise, except that float32 arrays may differ in the order their FP32
    products were summed: within 1e-6 relative (||out - want|| / ||want||). XLA's CPU dot
    picks its summation order by the operands' shapes (seen with jax 0.12.1: a vmapped,
    sharded or reshaped dot and the plain call's dot differ in the last bits of 1-30 % of an
    FP32 result's elements); a bf16 result is that sum rounded once and compared bitwise."""
    assert out.dtype == want.dtype and out.shape == want.shape, (out.dtype, out.shape, want.dtype, want.shape)
    if out.dtype == jnp.float32:
        assert rel_err(out, want) < 1e-6, rel_err(out, want)
    else:
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


H200 = AbstractDevice("NVIDIA H200", 132, "cuda")


@contextlib.contextmanager
def faked_device(device=H200):
    """Plans inside the block target `device` (abstract mesh of one device)."""
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device)):
        yield


def cuda_text(fn, *args) -> str:
    """jit(fn) over args lowered for CUDA on the faked H200 (StableHLO text)."""
    with faked_device():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def custom_call_lines(text: str, target: str) -> list[str]:
    """The lines of a lowered text that call `target` (a whole target name)."""
    return [line for line in text.splitlines() if f"stablehlo.custom_call @{target}(" in line]


def grouped_gemms(text: str) -> int:
    """The grouped GEMMs of a CUDA lowering, on either path: XLA's ragged dots and the
    grouped kernels' calls (the gated forward's included)."""
    targets = (
        contract.GROUPED_FWD_TARGET,
        contract.GROUPED_FWD_GATED_TARGET,
        contract.GROUPED_DGRAD_TARGET,
        contract.GROUPED_WGRAD_TARGET,
    )
    dots = sum('"chlo.ragged_dot"(' in line for line in text.splitlines())
    return dots + sum(len(custom_call_lines(text, t)) for t in targets)


def effective_group_sizes(sizes, m: int) -> list[int]:
    """The group sizes a grouped GEMM uses for the rows [0, m): negative sizes count as 0,
    the groups are cut where their running sum reaches m."""
    out, total = [], 0
    for s in sizes:
        take = min(max(int(s), 0), m - total)
        out.append(take)
        total += take
    return out


def grouped_reference64(x, w, sizes, dy):
    """float64 y, dx, dw (numpy) of the grouped projection of the bf16 operands x [M, K],
    w [G, N, K] (rounded to bf16), dy [M, N] with these group sizes; rows past the groups 0."""
    x64, w64, dy64 = f64(x), f64(jnp.asarray(w).astype(jnp.bfloat16)), f64(dy)
    y = np.zeros((x64.shape[0], w64.shape[1]))
    dx = np.zeros_like(x64)
    dw = np.zeros(w64.shape)
    start = 0
    for g, s in enumerate(effective_group_sizes(sizes, x64.shape[0])):
        rows = slice(start, start + s)
        y[rows] = x64[rows] @ w64[g].T
        dx[rows] = dy64[rows] @ w64[g]
        dw[g] = dy64[rows].T @ x64[rows]
        start += s
    return y, dx, dw
