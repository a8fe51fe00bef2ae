"""Test set-up: 8 fake CPU devices for the shard_map tests, the `gpu` marker, and on
sys.path the repository root (the tests of the benchmark and the tuners import
`benchmarks`, which lies beside the package and is not installed) and tests/gpu (the GPU
tests' gpu_helpers and kernel_cases, which CPU tests here import too: set here, as this
file is loaded before any test module, whichever files a run collects).

XLA_FLAGS must be set before jax starts its backends, so it is set here, at import.
GPU tests (`@pytest.mark.gpu`) run with `pytest -m gpu` on a machine with an NVIDIA GPU
and the built library (`pytest -m "gpu and not full"`: the quick tier, tests/gpu/conftest.py),
and are skipped elsewhere.
"""

import os
import pathlib
import sys

_REPO = str(pathlib.Path(__file__).resolve().parents[1])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
_GPU_TESTS = str(pathlib.Path(__file__).resolve().parent / "gpu")
if _GPU_TESTS not in sys.path:
    sys.path.append(_GPU_TESTS)

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import dataclasses  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run `pytest -m gpu` on the GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def kernel_rules_only():
    """The planner's kernel rules without the shipped sm_90a table's measured rows (its xla
    rows send some points to XLA's dot): for tests of what the kernels' rules pick."""
    from jax_cake.planner import tables

    with tables.use_table(tables.parse({"arch": "sm_90a", "source": "no rows", "sm_ranges": []})):
        yield


def _link_toolchain_missing() -> str | None:
    """Why the built kernels cannot be linked into the library here (None: they can): the
    link needs g++, nm and a CUDA toolkit."""
    if shutil.which("g++") is None or shutil.which("nm") is None:
        return "g++/nm not found"
    if (
        shutil.which("nvcc") is None
        and not pathlib.Path("/usr/local/cuda/bin/nvcc").exists()
        and not os.environ.get("CUDA_HOME")
    ):
        return "CUDA toolkit (nvcc) not found"
    return None


@dataclasses.dataclass(frozen=True)
class AotBuild:
    process: subprocess.CompletedProcess  # its stdout and stderr captured
    out_dir: pathlib.Path  # the library's folder, named as a cache folder is
    not_linked: str | None  # None where the library was linked, else why not (--compile_only)

    @property
    def obj_dir(self) -> pathlib.Path:
        """The kernels' objects and headers (native._build_command's layout)."""
        return self.out_dir / "obj"


@pytest.fixture(scope="session")
def aot_build(tmp_path_factory) -> AotBuild:
    """ONE AOT build for the build tests (each compile of every kernel variant takes a
    minute or more on 2 cores): the command a first use runs into the user cache
    (native._build_command), the full library where the toolchain is here, else the
    kernels alone (--compile_only); CUTE_DSL_ARCH unset (the build sets it itself)."""
    from jax_cake import native

    if not native._dsl_available():
        pytest.skip("nvidia-cutlass-dsl not installed")
    missing = _link_toolchain_missing()
    out_dir = tmp_path_factory.mktemp("aot") / native.cache_key()
    cmd, env = native._build_command(out_dir, () if missing is None else ("--compile_only",))
    env.pop("CUTE_DSL_ARCH", None)
    process = subprocess.run(cmd, cwd=_REPO, env=env, capture_output=True, text=True, timeout=900)
    return AotBuild(process, out_dir, missing)
