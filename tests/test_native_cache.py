"""Build on first use: where native.py looks for the library, the per-user cache it
builds into when none is found, and that a cached build is reused. CPU only; the real
build (compile-only here) is the one test marked `build`."""

import pytest

import jax_cake
from jax_cake import contract, native


@pytest.fixture
def no_library(monkeypatch, tmp_path):
    """No $JAX_CAKE_LIBRARY, no repo or package build: only the cache under tmp_path."""
    monkeypatch.delenv("JAX_CAKE_LIBRARY", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_REPO_ROOT", tmp_path / "repo")
    monkeypatch.setattr(native, "_PACKAGE_DIR", tmp_path / "package")
    monkeypatch.setattr(native, "_lib", None)
    return tmp_path


def test_cache_key_names_version_arch_ffi_headers_and_the_build_inputs(monkeypatch, tmp_path):
    key = native.cache_key()
    prefix = f"{jax_cake.__version__}-{contract.KERNEL_ARCHS[0]}-jaxlib{contract.FFI_HEADERS_JAXLIB}-"
    assert key.startswith(prefix) and len(key) == len(prefix) + 12 and "/" not in key
    assert native.cache_key() == key  # stable
    # A changed kernel source (same version) gets another folder, not the stale library.
    kernels = tmp_path / "jax_cake" / "kernels"
    kernels.mkdir(parents=True)
    (kernels / "gemm_sm90.py").write_text("one")
    monkeypatch.setattr(native, "_PACKAGE_DIR", tmp_path / "jax_cake")
    monkeypatch.setattr(native, "_REPO_ROOT", tmp_path)
    before = native.cache_key()
    (kernels / "gemm_sm90.py").write_text("two")
    assert native.cache_key() != before


def test_cache_dir_resolution(monkeypatch, tmp_path):
    key = native.cache_key()
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "override"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native.cache_dir() == tmp_path / "override" / key  # the override wins
    monkeypatch.delenv(native.CACHE_ENV)
    assert native.cache_dir() == tmp_path / "xdg" / "jax_cake" / key
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert native.cache_dir() == tmp_path / "home" / ".cache" / "jax_cake" / key


def test_library_path_finds_the_cached_build(no_library):
    assert native.library_path() is None
    lib = native.cache_dir() / contract.LIBRARY_NAME
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    assert native.library_path() == lib
    # A repo build comes first.
    repo_lib = no_library / "repo" / "build" / "native" / contract.LIBRARY_NAME
    repo_lib.parent.mkdir(parents=True)
    repo_lib.write_bytes(b"")
    assert native.library_path() == repo_lib


def test_first_use_builds_once_into_the_cache_and_reuses_it(no_library, monkeypatch, capsys):
    builds, opened = [], []

    def fake_build(out_dir):
        builds.append(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / contract.LIBRARY_NAME).write_bytes(b"")

    monkeypatch.setattr(native, "_dsl_available", lambda: True)
    monkeypatch.setattr(native, "_build_library", fake_build)
    monkeypatch.setattr(native, "_open", lambda path: opened.append(path) or object())
    native._load()
    assert builds == [native.cache_dir()]
    assert opened == [native.cache_dir() / contract.LIBRARY_NAME]
    err = capsys.readouterr().err
    assert err.count("jax_cake: building the GPU library (about a minute, once) into") == 1
    assert str(native.cache_dir()) in err
    # A new process (no loaded library) finds the cached build and does not rebuild.
    monkeypatch.setattr(native, "_lib", None)
    native._load()
    assert len(builds) == 1 and opened[-1] == native.cache_dir() / contract.LIBRARY_NAME
    assert "building" not in capsys.readouterr().err


def test_without_the_dsl_the_error_says_what_to_install(no_library, monkeypatch):
    monkeypatch.setattr(native, "_dsl_available", lambda: False)
    monkeypatch.setattr(native, "_build_library", lambda out_dir: pytest.fail("must not build"))
    with pytest.raises(RuntimeError) as e:
        native._load()
    assert "pip install 'jax_cake[build]'" in str(e.value) and "python -m jax_cake.build" in str(e.value)


def test_an_explicit_library_path_is_never_built(no_library, monkeypatch):
    monkeypatch.setenv("JAX_CAKE_LIBRARY", str(no_library / "missing.so"))
    monkeypatch.setattr(native, "_dsl_available", lambda: True)
    monkeypatch.setattr(native, "_build_library", lambda out_dir: pytest.fail("must not build"))
    with pytest.raises(RuntimeError, match="missing.so"):
        native._load()


@pytest.mark.build
def test_the_cache_builder_runs_the_real_build(aot_build):
    """The builder's command itself (native._build_command: what a first use runs into the
    user cache; the session's one build, conftest.aot_build): `python -m jax_cake.build`
    into a cache folder exports every kernel and the generated header there."""
    proc, out = aot_build.process, aot_build.out_dir
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    from jax_cake.planner.variants import VARIANTS

    assert all((out / "obj" / f"{v.name}.o").is_file() for v in VARIANTS)
    assert (out / "obj" / contract.HEADER_NAME).read_text() == contract.header_text()
