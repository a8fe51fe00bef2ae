"""GPU test set-up: the library registered once per session, and the `slow` cases.

Every test here that touches the GPU is marked `gpu` (skipped without a GPU by
tests/conftest.py). Tiers:
- `pytest -m "gpu and not full" tests`: the quick tier, every compiled program once
  (kernel_cases.params keeps the cheapest case per program, reduction, raster and
  output dtype and marks the others `full`), determinism, CUDA graphs and the public API;
- `pytest -m gpu tests`: the full tier, the quick tier and every `full` case;
- `pytest -m "gpu and slow" tests`: the `slow` cases (the seed grid beyond its first T),
  skipped unless the -m expression names them.

gpu_helpers and kernel_cases are importable by name: tests/conftest.py puts this folder on
sys.path.
"""

import pytest


def pytest_collection_modifyitems(config, items):
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason='slow GPU case: run with -m "gpu and slow"')
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_library():
    """The CUDA backend up and the jax_cake library's FFI targets registered; a GPU
    machine without the built library fails here (build it: python -m jax_cake.build)."""
    import jax

    from jax_cake import native

    device = jax.devices()[0]
    assert device.platform == "gpu", f"the default device is {device.platform}, not a GPU"
    assert native.library_path() is not None, "jax_cake library not found: run python -m jax_cake.build"
    native.ensure_registered()
    return native.library_path()
