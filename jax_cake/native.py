"""Loading the native library (libjax_cake_ffi.so) and registering its FFI targets.

Import is always safe: nothing is loaded until `ensure_registered()` is called, and a
CPU-only machine without the library imports this module without error.

Where the library is looked for, first hit wins:
  1. $JAX_CAKE_LIBRARY (a path to the .so);
  2. <repo>/build/native/libjax_cake_ffi.so (what `python -m jax_cake.build` writes);
  3. libjax_cake_ffi.so next to this package (an installed copy);
  4. the per-user cache, `cache_dir()`: $JAX_CAKE_CACHE_DIR/<key>, else
     $XDG_CACHE_HOME/jax_cake/<key>, else ~/.cache/jax_cake/<key>, where <key> is
     `cache_key()` (jax_cake's version, the kernels' GPU architecture, the jaxlib
     version whose FFI headers the handlers are built against, and a digest of the
     build's inputs, so an edited kernel or handler never loads a stale build).

Build on first use: where none is found and the CuTe DSL is installed
(`pip install 'jax_cake[build]'`), the first op that needs the library builds it into
the cache (about a minute, once; one progress line on stderr) and every later process
reuses it. Without the DSL the error says what to install.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import os
import pathlib
import subprocess
import sys
import threading

from jax_cake import contract
from jax_cake.contract import LIBRARY_NAME, MODULE_LOADERS, TARGETS, handler_symbol

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
_REPO_ROOT = _PACKAGE_DIR.parent

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_registered = False


# Overrides the cache root (the library then lives in $JAX_CAKE_CACHE_DIR/<cache_key()>).
CACHE_ENV = "JAX_CAKE_CACHE_DIR"


def _build_inputs_digest() -> str:
    """12 hex digits of a hash over the build's inputs (the kernels, the variant tables, the
    FFI names and the C++ sources): a checkout whose kernels change without a version bump
    gets a new cache folder instead of a stale library."""
    roots = [_PACKAGE_DIR / "kernels", _REPO_ROOT / "ffi"]
    files = [_PACKAGE_DIR / name for name in ("build.py", "contract.py", "module_table.py")]
    files += [_PACKAGE_DIR / "planner" / name for name in ("variants.py", "router_variants.py")]
    files += sorted(
        f for root in roots if root.is_dir() for f in root.rglob("*") if f.suffix in (".py", ".cc", ".cu", ".h")
    )
    digest = hashlib.sha256()
    for f in files:
        if f.is_file():
            digest.update(f.relative_to(_REPO_ROOT).as_posix().encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:12]


def cache_key() -> str:
    """What a cached build depends on: "<jax_cake version>-<GPU arch>-jaxlib<FFI headers
    version>-<digest of the build inputs>"."""
    from jax_cake.version import __version__

    return f"{__version__}-{contract.KERNEL_ARCHS[0]}-jaxlib{contract.FFI_HEADERS_JAXLIB}-{_build_inputs_digest()}"


def cache_dir() -> pathlib.Path:
    """The folder of this user's cached build for `cache_key()` (see the module docstring)."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return pathlib.Path(root).expanduser() / cache_key()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
    return base / "jax_cake" / cache_key()


def library_path() -> pathlib.Path | None:
    """Path of the native library that would be loaded, or None if there is none."""
    env = os.environ.get("JAX_CAKE_LIBRARY")
    if env:
        p = pathlib.Path(env)
        return p if p.is_file() else None
    for cand in (_REPO_ROOT / "build" / "native" / LIBRARY_NAME, _PACKAGE_DIR / LIBRARY_NAME, cache_dir() / LIBRARY_NAME):
        if cand.is_file():
            return cand
    return None


def _dsl_available() -> bool:
    """Whether the CuTe DSL (the `cutlass` package of nvidia-cutlass-dsl) can be imported."""
    return importlib.util.find_spec("cutlass") is not None


@contextlib.contextmanager
def _file_lock(path: pathlib.Path):
    """An exclusive lock across processes (two first uses build once)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_command(out_dir: pathlib.Path, extra_args: tuple[str, ...] = ()) -> tuple[list[str], dict[str, str]]:
    """(command, environment) of `python -m jax_cake.build` into `out_dir`, its objects in
    out_dir / "obj" (a fresh process: the build sets CUTE_DSL_ARCH before cutlass is
    imported), this package first on its path."""
    cmd = [sys.executable, "-m", "jax_cake.build", f"--out_dir={out_dir}", f"--obj_dir={out_dir / 'obj'}", *extra_args]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_DIR.parent), env.get("PYTHONPATH")]))
    return cmd, env


def _build_library(out_dir: pathlib.Path, extra_args: tuple[str, ...] = ()) -> None:
    """Runs _build_command's build into `out_dir`. Its output goes to stderr."""
    cmd, env = _build_command(out_dir, extra_args)
    try:  # the build's log goes to our stderr, where a user sees the progress line too
        log = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        log = None
    proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(
            f"jax_cake: building the GPU library into {out_dir} failed (exit {proc.returncode}); "
            f"the build's output is above. Command: {' '.join(cmd)}"
        )


def _build_into_cache() -> pathlib.Path:
    """Builds the library into `cache_dir()` unless another process already has; returns its path."""
    target = cache_dir()
    lib = target / LIBRARY_NAME
    with _file_lock(target.parent / f"{target.name}.lock"):
        if not lib.is_file():  # another process may have built it while we waited
            print(
                f"jax_cake: building the GPU library (about a minute, once) into {target}", file=sys.stderr, flush=True
            )
            _build_library(target)
            if not lib.is_file():
                raise RuntimeError(f"jax_cake: the build finished but {lib} is missing")
    return lib


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
    if path is None and not os.environ.get("JAX_CAKE_LIBRARY") and _dsl_available():
        path = _build_into_cache()  # first use on this machine
    if path is None:
        where = os.environ.get("JAX_CAKE_LIBRARY") or (
            f"{_REPO_ROOT / 'build' / 'native' / LIBRARY_NAME}, {_PACKAGE_DIR / LIBRARY_NAME} and {cache_dir()}"
        )
        raise RuntimeError(
            f"jax_cake native library not found (looked at {where}). Install the CuTe DSL with "
            "`pip install 'jax_cake[build]'` (the first op then builds the library once into the cache), or "
            "build it with `python -m jax_cake.build` (needs nvidia-cutlass-dsl and a CUDA toolkit), "
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
    `jax_cake.primitives.targets_from(prefix)` then run that build (two builds timed side
    by side in one process). Needs a CUDA GPU; a prefix is registered once."""
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
