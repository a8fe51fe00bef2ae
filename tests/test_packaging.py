"""What `pip install .` puts in site-packages: the jax_cake package and its plan tables,
nothing else (no benchmark, no tuner, no built native library from the repository's build
folder: the library links NVIDIA's CuTe DSL runtime and is built per machine)."""

import pathlib
import subprocess
import sys
import zipfile

from helpers import REPO

from jax_cake import build


def test_the_wheel_holds_the_package_only(tmp_path):
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    tree = tmp_path / "repo"
    for name in filter(None, tracked.decode().split("\0")):
        dest = tree / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes((REPO / name).read_bytes())
    # A library built where `python -m jax_cake.build` writes it, as on a developer's machine.
    out_dir = tree / pathlib.Path(build.FLAGS["out_dir"].default).relative_to(build.REPO_ROOT)
    out_dir.mkdir(parents=True)
    (out_dir / "libjax_cake_ffi.so").write_bytes(b"not a library")
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(tree)],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("jax_cake-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    outside = [n for n in names if not n.startswith(("jax_cake/", "jax_cake-"))]
    assert outside == [], outside
    assert "jax_cake/planner/tables/sm_90a.json" in names
    assert not [n for n in names if n.endswith(".so") or "benchmarks" in n], names
