"""Registers and stack of every exported kernel, read from the build's objects on any machine
(test_build.py keeps every kernel's stack within its budget with it).

    python -m jax_cake.build --compile_only --obj_dir=/tmp/obj
    python tests/kernel_resources.py /tmp/obj            # one line per kernel: registers, stack bytes

Each exported object (`<variant>.o`, jax_cake.build) embeds the kernel's device code: a
cubin for sm_90a, the SASS the DSL's ptxas wrote. The cubin's `.nv.info` section holds,
per function, its register count (EIATTR_REGCOUNT) and the stack it needs with its callees
(EIATTR_MIN_STACK_SIZE). Registers that do not fit are spilled to that stack, so a kernel
with 0 bytes of stack does not spill. The register count is the launch's (the most 384
threads may each hold: 168), before the kernel's setmaxnreg moves registers from the
producer warpgroup to the consumers; a consumer that needs more than it gets spills, and
its stack shows it.

Pure Python: no CUDA toolkit. Checked against `cuobjdump --dump-resource-usage` of CUDA
13.5 on the extracted cubins: the same REG and STACK for every kernel of two builds of
2026-12-05 (46 and 49 objects, nvidia-cutlass-dsl 4.8.1). A second argument names a folder
to write the cubins to, for cuobjdump or nvdisasm (SASS: `nvdisasm -c FILE.cubin`).
"""

from __future__ import annotations

import dataclasses
import pathlib
import struct
import sys

_ELF_MAGIC = b"\x7fELF\x02\x01\x01"  # 64-bit, little endian, version 1
_EM_CUDA = 190  # e_machine of NVIDIA device code
# .nv.info record formats (one byte each, then the attribute byte): no value, one byte,
# two bytes, or a two-byte size and that many bytes.
_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL, _EIFMT_SVAL = 1, 2, 3, 4
_EIATTR_REGCOUNT = 0x2F  # (function symbol, registers)
_EIATTR_MIN_STACK_SIZE = 0x12  # (function symbol, bytes of stack with its callees)


@dataclasses.dataclass(frozen=True)
class KernelResources:
    registers: int
    stack_bytes: int


def device_code(obj: bytes) -> bytes:
    """The first NVIDIA device ELF (cubin) embedded in a host object's bytes."""
    at = obj.find(_ELF_MAGIC, 1)
    while at != -1:
        if struct.unpack_from("<H", obj, at + 18)[0] == _EM_CUDA:
            phoff, shoff = struct.unpack_from("<QQ", obj, at + 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", obj, at + 0x36)
            size = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
            return obj[at : at + size]
        at = obj.find(_ELF_MAGIC, at + 1)
    raise ValueError("no NVIDIA device code (an ELF with e_machine 190) in the object")


def _sections(elf: bytes) -> dict[str, bytes]:
    """Section name -> contents of a 64-bit little-endian ELF."""
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    sections = {}
    for name, _type, _flags, _addr, offset, size in headers:
        end = elf.index(b"\0", names_at + name)
        sections[elf[names_at + name : end].decode()] = elf[offset : offset + size]
    return sections


def _info_records(info: bytes) -> list[tuple[int, bytes]]:
    """(attribute, value bytes) of each record of an .nv.info section."""
    records, at = [], 0
    while at + 2 <= len(info):
        fmt, attribute = info[at], info[at + 1]
        at += 2
        if fmt == _EIFMT_NVAL:
            size = 0
        elif fmt == _EIFMT_BVAL:
            size = 1
        elif fmt == _EIFMT_HVAL:
            size = 2
        elif fmt == _EIFMT_SVAL:
            (size,) = struct.unpack_from("<H", info, at)
            at += 2
        else:
            raise ValueError(f".nv.info: unknown record format {fmt} at byte {at - 2}")
        records.append((attribute, info[at : at + size]))
        at += size
    return records


def kernel_resources(cubin: bytes) -> KernelResources:
    """Registers and stack bytes of the cubin's one kernel (the one function with a
    register count in .nv.info)."""
    per_symbol: dict[int, dict[int, int]] = {}
    for attribute, value in _info_records(_sections(cubin)[".nv.info"]):
        if attribute in (_EIATTR_REGCOUNT, _EIATTR_MIN_STACK_SIZE):
            symbol, amount = struct.unpack("<II", value)
            per_symbol.setdefault(attribute, {})[symbol] = amount
    registers = per_symbol.get(_EIATTR_REGCOUNT, {})
    if len(registers) != 1:
        raise ValueError(f"expected one kernel with a register count, found {len(registers)}")
    ((symbol, count),) = registers.items()
    return KernelResources(count, per_symbol.get(_EIATTR_MIN_STACK_SIZE, {}).get(symbol, 0))


def read_objects(
    obj_dir: pathlib.Path, names=None, cubin_dir: pathlib.Path | None = None
) -> dict[str, KernelResources]:
    """{variant name: its kernel's resources} from obj_dir/<name>.o, for `names` (None:
    every GEMM and router variant the build exports), optionally writing each cubin to
    cubin_dir/<name>.cubin."""
    if names is None:
        from jax_cake.planner import router_variants, variants

        names = [v.name for v in (*variants.VARIANTS, *router_variants.VARIANTS)]
    if cubin_dir is not None:
        cubin_dir.mkdir(parents=True, exist_ok=True)
    found = {}
    for name in names:
        cubin = device_code((obj_dir / f"{name}.o").read_bytes())
        if cubin_dir is not None:
            (cubin_dir / f"{name}.cubin").write_bytes(cubin)
        found[name] = kernel_resources(cubin)
    return found


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python tests/kernel_resources.py OBJ_DIR [CUBIN_DIR]")
    cubins = pathlib.Path(sys.argv[2]) if len(sys.argv) == 3 else None
    found = read_objects(pathlib.Path(sys.argv[1]), cubin_dir=cubins)
    for name, r in found.items():
        print(f"{name} {r.registers} registers, {r.stack_bytes} stack bytes")
    print(f"{len(found)} kernels, {sum(r.stack_bytes > 0 for r in found.values())} with stack (spilled registers)")
