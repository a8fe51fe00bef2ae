"""The AOT build runs on a CPU machine and produces a library exporting the handlers.

Slow: every kernel variant is compiled with CuTe DSL, once per test session
(conftest.aot_build, a minute or more on 2 cores), so a kernel that stops compiling turns
CI red. The kernel export needs only nvidia-cutlass-dsl; the full library build also needs
g++ and a CUDA toolkit (nvcc, cuda_runtime.h, libcudart_static.a), and its test is skipped
when those are absent.
"""

import subprocess
import sys

import kernel_resources
import pytest
from helpers import REPO

HANDLERS = ("JaxCakeFwd", "JaxCakeDgrad", "JaxCakeWgrad")
# Stack bytes (spilled registers) of the kernels that have any, as compiled by
# nvidia-cutlass-dsl 4.8.1 for sm_90a (tests/kernel_resources.py, 2026-12-05): one of
# each gated c1x1 tile's (silu, gelu); every other kernel has none. A kernel change that
# spills more turns the export test red.
STACK_BYTES = {
    "jax_cake_fwd_128x192x64_c1x1_bf16_gated_silu_pp": 8,
    "jax_cake_fwd_128x192x64_c1x1_bf16_gated_gelu_pp": 8,
}


@pytest.mark.build
def test_run_time_imports_neither_cutlass_nor_the_kernel_modules():
    """The public ops (planning included) run without cutlass: the variant lists they read
    are plain data in jax_cake/planner, and jax_cake/kernels is the build's alone."""
    code = (
        "import sys, jax, jax.numpy as jnp, jax_cake\n"
        "import jax_cake.planner.variants as v, jax_cake.planner.router_variants as rv\n"
        "assert v.VARIANTS and rv.VARIANTS and len({x.name for x in v.VARIANTS}) == len(v.VARIANTS)\n"
        "x = jnp.ones((16, 64), jnp.bfloat16); w = jnp.ones((32, 64), jnp.float32)\n"
        "jax.grad(lambda w: jax_cake.dense_projection(x, w).astype(jnp.float32).sum())(w)\n"
        "jax.grad(lambda w: jax_cake.router_logits(x.astype(jnp.float32), w).sum())(w)\n"
        "bad = [m for m in sys.modules if m.startswith(('cutlass', 'jax_cake.kernels'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@pytest.mark.build
def test_kernels_compile_and_export(aot_build):
    """The CuTe DSL part (needs only the cutlass wheel; the session's one build,
    conftest.aot_build): every variant compiles for sm_90a and exports a header and an
    object, so a kernel that stops compiling fails here even where no CUDA toolkit is
    installed; and no kernel spills registers beyond STACK_BYTES."""
    proc, obj = aot_build.process, aot_build.obj_dir
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    from jax_cake.planner.variants import VARIANTS

    for v in VARIANTS:
        assert (obj / f"{v.name}.h").is_file() and (obj / f"{v.name}.o").stat().st_size > 0, v.name
    assert (obj / "jax_cake_variants.inc").is_file()
    stacks = {name: r.stack_bytes for name, r in kernel_resources.read_objects(obj).items()}
    over = {name: (got, STACK_BYTES.get(name, 0)) for name, got in stacks.items() if got > STACK_BYTES.get(name, 0)}
    assert not over, f"kernels spilling more than before (stack bytes, budget): {over}"
    assert set(STACK_BYTES) <= set(stacks), "a budget names a kernel that is no longer compiled"


@pytest.mark.build
def test_aot_build_exports_handlers(aot_build):
    if aot_build.not_linked is not None:
        pytest.skip(aot_build.not_linked)
    proc = aot_build.process
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lib = aot_build.out_dir / "libjax_cake_ffi.so"
    assert proc.stdout.strip().splitlines()[-1] == str(lib)
    assert lib.is_file()
    syms = subprocess.run(["nm", "-D", "--defined-only", str(lib)], check=True, capture_output=True, text=True).stdout
    exported = {line.split()[-1] for line in syms.splitlines() if line.strip()}
    for name in HANDLERS + ("jax_cake_load_modules", "jax_cake_num_variants", "jax_cake_variant_name"):
        assert name in exported, name
    # Only libc/libstdc++ at run time: no libcuda link, no cutlass runtime .so.
    ldd = subprocess.run(["ldd", str(lib)], capture_output=True, text=True).stdout
    assert "cute_dsl_runtime" not in ldd and "libcudart.so" not in ldd, ldd
    # Every variant is in the library's table, in variants.py order.
    code = (
        "import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
        "lib.jax_cake_variant_name.restype = ctypes.c_char_p; "
        "print(','.join(lib.jax_cake_variant_name(i).decode() for i in range(lib.jax_cake_num_variants())))"
    )
    names = subprocess.run(
        [sys.executable, "-c", code, str(lib)], check=True, capture_output=True, text=True
    ).stdout.strip()
    from jax_cake.planner.variants import VARIANTS

    assert names.split(",") == [v.name for v in VARIANTS]
