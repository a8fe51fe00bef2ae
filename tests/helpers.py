"""Shared test utilities: random inputs, float64 references, the faked H200."""

import contextlib
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

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


def rand(key: int, shape, dtype):
    """Fresh normal random values (never zeros), rounded to dtype."""
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


def f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32), dtype=np.float64)


def assert_raises_naming(error, prefix: str, words, call) -> None:
    """call() raises `error`, its message starting with `prefix` and holding every word."""
    with pytest.raises(error) as e:
        call()
    msg = str(e.value)
    assert msg.startswith(prefix), msg
    for word in words:
        assert word in msg, msg


def rel_err(out, ref) -> float:
    out, ref = f64(out), np.asarray(ref, np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.all(np.isfinite(out)), "non-finite values in the output"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


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
