"""The two sides of the FFI boundary use one definition of its codes and names.

jax_cake/contract.py defines them; the build generates jax_cake_codes.h from it for the
C++ handlers. These checks fail where ffi/*.cc spells a code or a name itself, or uses
one the generated header does not define. CPU only (g++ for the compile check).
"""

import pathlib
import re
import shutil
import subprocess

import pytest

from jax_cake import contract

FFI = pathlib.Path(__file__).resolve().parent.parent / "ffi"
SOURCES = sorted(FFI.glob("*.cc")) + sorted(FFI.glob("*.h"))


def _code(path: pathlib.Path) -> str:
    """The source without its comments and string literals."""
    text = re.sub(r"//[^\n]*", "", path.read_text())
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r'"(\\.|[^"\\])*"', '""', text)


def _header_constants() -> dict[str, int]:
    return {
        name: int(value)
        for name, value in re.findall(r"constexpr int64_t (k\w+) = (\d+);", contract.header_text())
    }


def test_header_holds_the_python_codes():
    constants = _header_constants()
    for prefix, table in (
        ("Reduction", contract.REDUCTIONS),
        ("Schedule", contract.SCHEDULES),
        ("Raster", contract.RASTERS),
    ):
        for name, code in table.items():
            cname = "k" + prefix + "".join(p.capitalize() for p in name.split("_"))
            assert constants[cname] == code, cname
        # The handlers range-check with kNum<Prefix>s: the codes must be 0 .. n-1.
        assert sorted(table.values()) == list(range(len(table))), prefix
        assert constants[f"kNum{prefix}s"] == len(table)
    text = contract.header_text()
    for target in contract.TARGETS:
        assert f'{contract.target_constant(target)}[] = "{target}";' in text
        assert f"#define {contract.handler_macro(target)} {contract.handler_symbol(target)}" in text


def test_header_compiles(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    header = contract.write_header(tmp_path)
    checks = "".join(
        f"static_assert(jax_cake::{name} == {value});\n" for name, value in _header_constants().items()
    )
    tu = tmp_path / "check.cc"
    tu.write_text(f'#include "{header.name}"\n{checks}')
    subprocess.run(["g++", "-std=c++17", "-fsyntax-only", f"-I{tmp_path}", str(tu)], check=True)


def test_write_header_keeps_an_unchanged_file(tmp_path):
    path = contract.write_header(tmp_path)
    mtime = path.stat().st_mtime_ns
    assert contract.write_header(tmp_path) == path and path.stat().st_mtime_ns == mtime
    assert path.read_text() == contract.header_text()


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_no_bare_codes_in_comparisons(source):
    """reduction / schedule / raster are compared with the generated constants only (a
    sign check `< 0` is no code)."""
    attrs = r"(reduction|schedule|sched|raster)"
    pattern = re.compile(rf"\b{attrs}\s*(==|!=|<=|>=|>|<(?!\s*0\b))\s*\d|\b\d+\s*(==|!=|<=|>=|<|>)\s*{attrs}\b")
    bad = [m.group(0) for m in pattern.finditer(_code(source))]
    assert not bad, f"{source.name}: bare codes {bad}; use the kReduction*/kSchedule*/kRaster* constants"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_generated_names_used_by_the_sources_exist(source):
    code = _code(source)
    text = contract.header_text()
    generated = (
        r"\bk(?:Reduction|Schedule|Raster)\w*",
        r"\bkNum(?:Reductions|Schedules|Rasters)\b",
        r"\bk\w+Target\b",
        r"\bJAX_CAKE_\w+_HANDLER\b",
    )
    used = set(re.findall("|".join(generated), code))
    missing = sorted(name for name in used if not re.search(rf"\b{name}\b", text))
    assert not missing, f"{source.name} uses {missing}, which jax_cake_codes.h does not define"


def test_handlers_are_the_contract_targets():
    """Every handler symbol is defined through the generated macro of a contract target."""
    code = "".join(_code(p) for p in SOURCES)
    defined = re.findall(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\(\s*(\w+)", code)
    assert sorted(defined) == sorted(contract.handler_macro(t) for t in contract.TARGETS)
    for loader in contract.MODULE_LOADERS:
        assert re.search(rf'extern "C"[^;{{]*\b{loader}\(', "".join(p.read_text() for p in SOURCES)), loader


def test_dense_attributes_are_the_plans():
    """The attribute names the dense handlers decode are the ones Plan.ffi_attributes sends,
    plus the gated handlers' own `activation` (primitives.gemm sends it); the router's are
    five of the plan's (the tile and the K split: docs/ffi_contract.md)."""
    from jax_cake.planner import plan as make_plan

    member = r'StructMember<int64_t>\("(\w+)"\)'
    dense = re.findall(member, (FFI / "jax_cake_ffi.cc").read_text())
    plan = make_plan("fwd", tokens=8, d_in=8, d_out=8)
    assert sorted(set(dense)) == sorted([*plan.ffi_attributes(), "activation"])
    router = re.findall(member, (FFI / "router_ffi.cc").read_text())
    assert sorted(router) == ["reduction", "splits", "tile_k", "tile_m", "tile_n"]
    assert set(router) <= set(plan.ffi_attributes())


def test_raster_codes_name_the_walks():
    assert [contract.raster_code(r) for r in ("m", "n", "m2", "m8", f"m{contract.RASTER_BAND_MAX}")] == [
        contract.RASTER_M,
        contract.RASTER_N,
        2,
        8,
        contract.RASTER_BAND_MAX,
    ]
    for bad in ("", "m1", "m0", "m08", "n4", "b8", f"m{contract.RASTER_BAND_MAX + 1}", "M8"):
        with pytest.raises(ValueError, match="raster"):
            contract.raster_code(bad)
    assert contract.describe_raster("n") == "tiles walk along N first"
    assert contract.describe_raster("m8") == "tiles walk in bands of 8 cluster rows, M first within a band"
