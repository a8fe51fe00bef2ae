"""Ahead-of-time build of the native library: `python -m jax_cake.build`.

Runs on a CPU machine (no GPU, no driver needed):
  1. compiles every kernel variant of jax_cake/planner/variants.py and
     router_variants.py with CuTe DSL for the target arch (CUTE_DSL_ARCH is set before
     cutlass is imported), with dynamic M/N/K/L, and exports each one to C (`<name>.h` +
     `<name>.o`) under build/obj/;
  2. generates build/obj/jax_cake_variants.inc and jax_cake_router_variants.inc (the
     variant tables for the handlers, jax_cake/module_table.py) and jax_cake_codes.h (the
     FFI codes and names of jax_cake/contract.py, which ffi/*.cc include);
  3. compiles ffi/splitk_reduce.cu (nvcc) and ffi/*.cc (g++) against the XLA FFI
     headers of the oldest supported jaxlib (--ffi_headers_jaxlib), because a handler
     built with newer headers fails on an older runtime while older headers work on
     newer ones;
  4. links build/native/libjax_cake_ffi.so with the static CuTe DSL runtime from the
     installed nvidia-cutlass-dsl-libs wheel and the static CUDA runtime.
The library path is printed as the last line of output.

The compiled objects and the static archive are under NVIDIA's licence: build them on
the user's machine from the user's installed wheel; do not commit or ship them.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time

from absl import app, flags

from jax_cake import contract, module_table
from jax_cake.contract import HANDLER_SYMBOLS, LIBRARY_NAME

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
FFI_DIR = REPO_ROOT / "ffi"

FLAGS = flags.FLAGS
flags.DEFINE_list(
    "arch", list(contract.KERNEL_ARCHS), "GPU architectures to build for (only sm_90a kernels exist so far)."
)
flags.DEFINE_string("out_dir", str(REPO_ROOT / "build" / "native"), "Where libjax_cake_ffi.so is written.")
flags.DEFINE_string("obj_dir", None, "Where exported kernel objects go (default: <out_dir>/../obj).")
flags.DEFINE_bool("compile_only", False, "Compile and export the kernels only; skip the C++ build and link.")
flags.DEFINE_string(
    "ffi_headers_jaxlib",
    contract.FFI_HEADERS_JAXLIB,
    "Build the handlers against the XLA FFI headers of this jaxlib version (the oldest supported), "
    "fetched once with pip into build/ffi_headers/ when the installed jaxlib is another version. "
    "'installed' uses the installed jaxlib's headers (the library then needs that jaxlib or newer).",
)
flags.DEFINE_string(
    "cuda_home", None, "CUDA toolkit root (default: $CUDA_HOME, else nvcc's parent, else /usr/local/cuda)."
)


def _log(msg: str) -> None:
    print(f"[jax_cake.build] {msg}", flush=True)


def _run(cmd: list[str]) -> None:
    _log(" ".join(cmd))
    subprocess.run(cmd, check=True)


def cuda_home(explicit: str | None = None) -> pathlib.Path:
    """The CUDA toolkit root used for nvcc, headers and libcudart_static."""
    for cand in (explicit, os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if cand:
            return pathlib.Path(cand)
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = pathlib.Path(nvcc).resolve()
        if (real.parent.parent / "include" / "cuda_runtime.h").exists():
            return real.parent.parent
    return pathlib.Path("/usr/local/cuda")


def cutlass_runtime_lib_dir() -> pathlib.Path:
    """Folder holding libcuda_dialect_runtime_static.a from the installed wheel."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("nvidia-cutlass-dsl is not installed: pip install 'nvidia-cutlass-dsl[cu13]==4.8.1'")
    base = pathlib.Path(list(spec.submodule_search_locations)[0])
    for flavour in ("cu13", "cu12"):
        lib = base / flavour / "lib"
        if (lib / "libcuda_dialect_runtime_static.a").exists():
            return lib
    raise RuntimeError(f"libcuda_dialect_runtime_static.a not found under {base}")


def ffi_include_dir(version: str, cache: pathlib.Path) -> pathlib.Path:
    """The include folder holding xla/ffi/api/ of jaxlib `version`.

    The installed jaxlib's when it is that version (or `version` is "installed"), else
    extracted from that jaxlib's wheel, downloaded once with pip into `cache`. Without
    network the installed headers are used, with a warning naming the consequence.
    """
    import jax.ffi
    import jaxlib

    installed = pathlib.Path(jax.ffi.include_dir())
    if version in ("installed", jaxlib.__version__):
        return installed
    target = cache / f"jaxlib-{version}"
    if (target / "xla" / "ffi" / "api" / "ffi.h").exists():
        return target
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.11",
            "--platform",
            "manylinux2014_x86_64",
            "--platform",
            "manylinux_2_27_x86_64",
            "--platform",
            "manylinux_2_28_x86_64",
            "-d",
            tmp,
            f"jaxlib=={version}",
        ]
        if subprocess.run(cmd).returncode != 0:
            _log(
                f"warning: could not fetch jaxlib {version}'s FFI headers; building against the installed jaxlib "
                f"{jaxlib.__version__}'s, so the library needs jaxlib >= {jaxlib.__version__}"
            )
            return installed
        (wheel,) = pathlib.Path(tmp).glob("jaxlib-*.whl")
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith("jaxlib/include/"):
                    dest = target / name[len("jaxlib/include/") :]
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(z.read(name))
    _log(f"FFI headers of jaxlib {version} in {target}")
    return target


# ------------------------------------------------------------------ kernel export
def export_kernels(arch: str, obj_dir: pathlib.Path) -> list:
    """Compiles and exports every variant; returns the variants in table order."""
    os.environ["CUTE_DSL_ARCH"] = arch  # must precede the first cutlass import
    if "cutlass" in sys.modules and os.environ.get("_JAX_CAKE_ARCH_SET") != arch:
        _log("warning: cutlass was imported before the build set CUTE_DSL_ARCH")
    os.environ["_JAX_CAKE_ARCH_SET"] = arch
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor
    from cutlass.runtime import make_fake_stream

    from jax_cake.kernels.gemm_sm90 import GemmSm90
    from jax_cake.planner.variants import VARIANTS

    dtypes = {"bfloat16": cutlass.BFloat16, "float32": cutlass.Float32}

    def operand(dtype, unit_stride_mode: int):
        # Extents are fully dynamic; the two non-unit strides are multiples of 8
        # elements (16-byte TMA strides: d_in, d_out multiples of 8, see the contract).
        shape = tuple(cute.sym_int64() for _ in range(3))
        stride = [cute.sym_int64(divisibility=8) for _ in range(3)]
        stride[unit_stride_mode] = 1
        return make_fake_tensor(dtype, shape, tuple(stride), assumed_align=16)

    obj_dir.mkdir(parents=True, exist_ok=True)
    for v in VARIANTS:
        t0 = time.time()
        a = operand(cutlass.BFloat16, 1 if v.a_major == "k" else 0)
        b = operand(cutlass.BFloat16, 1 if v.b_major == "k" else 0)
        c = operand(dtypes[v.out_dtype], 1)
        # The variant's second tensor: the gated epilogue's h, the gradient epilogue's
        # pre-activation or the up half of a gate_up_halves dgrad's A (bf16, row-major
        # like C and A), else the split-tail workspace (flags, partial tiles), unused by
        # the other variants. The table tensor: a grouped variant's int32 table, unused by
        # the others.
        bf16_aux = v.activation or v.gate_grad or v.store == "gate_up_halves"
        aux = operand(cutlass.BFloat16, 1) if bf16_aux else operand(cutlass.Float32, 0)
        table = operand(cutlass.Int32, 0)
        compiled = cute.compile(
            GemmSm90(v), a, b, c, aux, table, cutlass.Int32(1), cutlass.Int32(0), cutlass.Int32(132),
            make_fake_stream(),
        )
        compiled.export_to_c(str(obj_dir), v.name, v.name)
        _log(f"exported {v.name} ({time.time() - t0:.1f} s)")
    return list(VARIANTS)


# ------------------------------------------------------------------ native build
def build_library(
    variants: list,
    router: list,
    arch: str,
    obj_dir: pathlib.Path,
    out_dir: pathlib.Path,
    cuda: pathlib.Path,
    ffi_include: pathlib.Path,
) -> pathlib.Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    nvcc = cuda / "bin" / "nvcc"
    if not nvcc.exists():
        nvcc = pathlib.Path(shutil.which("nvcc") or "nvcc")
    gencode = f"-gencode=arch=compute_{arch[3:]},code=sm_{arch[3:]}"
    reduce_obj = obj_dir / "splitk_reduce.o"
    _run(
        [
            str(nvcc),
            "-c",
            str(FFI_DIR / "splitk_reduce.cu"),
            "-o",
            str(reduce_obj),
            "-O3",
            "-std=c++17",
            gencode,
            "-Xcompiler",
            "-fPIC",
            "--cudart",
            "static",
        ]
    )
    ffi_objs = []
    for source in ("jax_cake_ffi.cc", "router_ffi.cc"):
        ffi_objs.append(obj_dir / source.replace(".cc", ".o"))
        _run(
            [
                "g++",
                "-c",
                str(FFI_DIR / source),
                "-o",
                str(ffi_objs[-1]),
                "-O2",
                "-std=c++17",
                "-fPIC",
                f"-I{ffi_include}",
                f"-I{cuda / 'include'}",
                f"-I{obj_dir}",
            ]
        )
    lib = out_dir / LIBRARY_NAME
    tmp = out_dir / (LIBRARY_NAME + ".tmp")
    cudart_dirs = [
        d
        for d in (cuda / "lib64", cuda / "lib", cuda / "targets" / "x86_64-linux" / "lib")
        if (d / "libcudart_static.a").exists()
    ]
    if not cudart_dirs:
        raise RuntimeError(f"libcudart_static.a not found under {cuda}")
    cmd = ["g++", "-shared", "-fPIC", "-o", str(tmp), *map(str, ffi_objs), str(reduce_obj)]
    cmd += [str(obj_dir / f"{v.name}.o") for v in variants]
    cmd += [str(e["object"]) for e in router]
    cmd += [
        f"-L{cutlass_runtime_lib_dir()}",
        "-lcuda_dialect_runtime_static",
        f"-L{cudart_dirs[0]}",
        "-lcudart_static",
        "-ldl",
        "-lpthread",
        "-lrt",
        "-Wl,--no-undefined",
        "-Wl,--exclude-libs,ALL",
    ]
    _run(cmd)
    tmp.replace(lib)  # atomic: a running process never sees a half-written library
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], check=True, capture_output=True, text=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
    missing = [s for s in HANDLER_SYMBOLS if s not in exported]
    if missing:
        raise RuntimeError(f"{lib} does not export {missing}")
    return lib


def main(argv):
    del argv
    t0 = time.time()
    archs = FLAGS.arch
    if archs != list(contract.KERNEL_ARCHS):
        raise app.UsageError(f"only --arch=sm_90a has kernels so far, got {archs}")
    arch = archs[0]
    out_dir = pathlib.Path(FLAGS.out_dir).resolve()
    obj_dir = pathlib.Path(FLAGS.obj_dir).resolve() if FLAGS.obj_dir else out_dir.parent / "obj"
    contract.write_header(obj_dir)  # jax_cake_codes.h: the codes and names ffi/*.cc use
    variants = export_kernels(arch, obj_dir)
    module_table.write_variant_table(variants, obj_dir)
    from jax_cake.kernels.router_bf16x3_sm90 import export_router_kernels  # after CUTE_DSL_ARCH is set
    from jax_cake.planner.router_variants import VARIANTS as ROUTER_VARIANTS

    router = export_router_kernels(obj_dir, log=_log)
    module_table.write_router_variant_table(list(ROUTER_VARIANTS), obj_dir)
    if FLAGS.compile_only:
        _log(f"kernels exported to {obj_dir} in {time.time() - t0:.1f} s (--compile_only: no link)")
        print(obj_dir)
        return
    ffi_include = ffi_include_dir(FLAGS.ffi_headers_jaxlib, out_dir.parent / "ffi_headers")
    lib = build_library(variants, router, arch, obj_dir, out_dir, cuda_home(FLAGS.cuda_home), ffi_include)
    _log(f"built {len(variants)} GEMM and {len(router)} router variants in {time.time() - t0:.1f} s")
    print(lib)


if __name__ == "__main__":
    app.run(main)
