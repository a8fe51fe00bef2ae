"""Loading the native library (libjax_cake_ffi.so) and registering its FFI targets.

Import is always safe: nothing is loaded until `ensure_registered()` is called, and a
CPU-only machine without the library imports this module without error.

Where the library is looked for, first hit wins:
  1. $JAX_CAKE_LIBRARY (a path to the .so);
  2. <repo>/build/lib/libjax_cake_ffi.so (what `python -m jax_cake.build` writes);
  3. libjax_cake_ffi.so next to this package (an installed copy).
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import threading

from jax_cake.contract import LIBRARY_NAME, MODULE_LOADERS, TARGETS, handler_symbol

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
_REPO_ROOT = _PACKAGE_DIR.parent

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_registered = False


def library_path() -> pathlib.Path | None:
    """Path of the native library that would be loaded, or None if there is none."""
    env = os.environ.get("JAX_CAKE_LIBRARY")
    if env:
        p = pathlib.Path(env)
        return p if p.is_file() else None
    for cand in (_REPO_ROOT / "build" / "lib" / LIBRARY_NAME, _PACKAGE_DIR / LIBRARY_NAME):
        if cand.is_file():
            return cand
    return None


def _cuda_device_present() -> bool:
    try:
        import jax

        return any(d.platform in ("gpu", "cuda") for d in jax.devices())
    except RuntimeError:
        return False


def _load() -> ctypes.CDLL:
    global _lib
    if _lib is not None:
        return _lib
    path = library_path()
    if path is None:
        where = os.environ.get("JAX_CAKE_LIBRARY") or str(_REPO_ROOT / "build" / "lib" / LIBRARY_NAME)
        raise RuntimeError(
            f"jax_cake native library not found (looked at {where}). Build it with "
            "`python -m jax_cake.build` (needs nvidia-cutlass-dsl and a CUDA toolkit), "
            "or point JAX_CAKE_LIBRARY at a built libjax_cake_ffi.so."
        )
    _lib = _open(path)
    return _lib


def _open(path) -> ctypes.CDLL:
    """dlopen one build of the library (its own copy of every symbol) and declare its C API."""
    lib = ctypes.CDLL(str(path))
    for loader in MODULE_LOADERS:
        getattr(lib, loader).argtypes = [ctypes.c_char_p, ctypes.c_int]
        getattr(lib, loader).restype = ctypes.c_int
    lib.jax_cake_num_variants.argtypes = []
    lib.jax_cake_num_variants.restype = ctypes.c_int
    lib.jax_cake_variant_name.argtypes = [ctypes.c_int]
    lib.jax_cake_variant_name.restype = ctypes.c_char_p
    return lib


def _load_modules(lib: ctypes.CDLL) -> None:
    """Loads the library's kernel modules (needs the CUDA driver up)."""
    err = ctypes.create_string_buffer(1024)
    for loader in MODULE_LOADERS:
        if getattr(lib, loader)(err, len(err)) != 0:
            raise RuntimeError(f"jax_cake: {loader} failed: {err.value.decode(errors='replace')}")


def _register(lib: ctypes.CDLL, prefix: str) -> None:
    """Registers the library's handlers as CUDA FFI targets named `<prefix><target>`."""
    import jax

    for target in TARGETS:
        fn = getattr(lib, handler_symbol(target))
        jax.ffi.register_ffi_target(prefix + target, jax.ffi.pycapsule(fn), platform="CUDA")


def ensure_registered() -> None:
    """Loads the library, loads its kernel modules and registers the CUDA FFI targets.

    Idempotent and thread-safe. Must run after the CUDA backend is up (it calls
    `jax.devices()` first), and before any jitted function using the targets is
    compiled. Raises RuntimeError naming `python -m jax_cake.build` if the library is
    missing, or with the CUDA error if its kernel modules cannot be loaded.
    """
    global _registered
    if _registered:
        return
    with _lock:
        if _registered:
            return
        if library_path() is None and not _cuda_device_present():
            return  # CPU-only machine: the XLA reference path needs no library
        lib = _load()
        # The kernel modules need the CUDA driver initialised; jax does that when the
        # backend starts. Loading here, outside any jitted step, keeps module loading
        # out of CUDA-graph capture.
        if _cuda_device_present():
            _load_modules(lib)
        _register(lib, "")
        _registered = True


_other_builds: dict[str, ctypes.CDLL] = {}


def register_build(path, prefix: str) -> None:
    """Loads another build of the library beside the default one and registers its
    handlers as `<prefix><target>`; custom calls traced under
    `jax_cake.primitives.targets_from(prefix)` then run that build
    (`python -m jax_cake.tools.compare_builds` times builds side by side this way). Needs a
    CUDA GPU; a prefix is registered once."""
    import jax

    if not prefix:
        raise ValueError("register_build: the prefix must not be empty (that is the default library's)")
    if not pathlib.Path(path).is_file():
        raise FileNotFoundError(f"register_build: no library at {path}")
    jax.devices()  # the CUDA backend (and driver) up before the modules load
    with _lock:
        if prefix in _other_builds:
            raise ValueError(f"register_build: prefix {prefix!r} is already registered")
        lib = _open(path)
        _load_modules(lib)
        _register(lib, prefix)
        _other_builds[prefix] = lib  # keep the handle: the handlers live in it


def compiled_variants() -> tuple[str, ...]:
    """Names of the kernel variants compiled into the library (empty if none is found)."""
    if library_path() is None:
        return ()
    lib = _load()
    return tuple(lib.jax_cake_variant_name(i).decode() for i in range(lib.jax_cake_num_variants()))
