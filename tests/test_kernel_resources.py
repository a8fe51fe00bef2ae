"""tests/kernel_resources.py on synthetic objects: the device ELF found inside a host
object, its .nv.info records read, the kernel's registers and stack. (The real kernels'
resources are checked where CI compiles them: test_build.test_kernels_compile_and_export.)"""

import struct

import kernel_resources as kr
import pytest


def _nv_info(records) -> bytes:
    """.nv.info bytes of (format, attribute, value) records (value: bytes)."""
    out = b""
    for fmt, attribute, value in records:
        out += bytes([fmt, attribute])
        if fmt == 4:
            out += struct.pack("<H", len(value))
        out += value
    return out


def _cubin(info: bytes, machine: int = 190) -> bytes:
    """A minimal 64-bit ELF: a 64-byte header, the section names, .nv.info, then the
    section headers (null, .shstrtab, .nv.info) and one program header after them."""
    names = b"\0.shstrtab\0.nv.info\0"
    names_at, info_at = 64, 64 + len(names)
    shoff = info_at + len(info)
    phoff = shoff + 3 * 64
    header = _elf_header(machine, phoff, shoff)
    sections = b"\0" * 64
    sections += struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, names_at, len(names), 0, 0, 1, 0)
    sections += struct.pack("<IIQQQQIIQQ", 11, 0x70000000, 0, 0, info_at, len(info), 0, 0, 4, 0)
    return header + names + info + sections + b"\1" * 56


def _elf_header(machine: int, phoff: int, shoff: int) -> bytes:
    ident = b"\x7fELF\x02\x01\x01" + b"\0" * 9
    # type, machine, version, entry, phoff, shoff, flags, ehsize, phentsize, phnum,
    # shentsize, shnum, shstrndx
    return ident + struct.pack("<HHIQQQIHHHHHH", 2, machine, 1, 0, phoff, shoff, 0, 64, 56, 1, 64, 3, 1)


def _records(kernel_symbol=7, registers=168, stack=40):
    return [
        (4, 0x2F, struct.pack("<II", kernel_symbol, registers)),  # EIATTR_REGCOUNT
        (4, 0x11, struct.pack("<II", 4, 16)),  # EIATTR_FRAME_SIZE of a device function
        (4, 0x12, struct.pack("<II", 4, 16)),  # its stack
        (4, 0x12, struct.pack("<II", kernel_symbol, stack)),  # EIATTR_MIN_STACK_SIZE
        (3, 0x36, struct.pack("<H", 5)),  # a two-byte record
        (1, 0x01, b""),  # a record without a value
    ]


def test_the_device_elf_is_found_inside_a_host_object_and_read():
    cubin = _cubin(_nv_info(_records()))
    host = _elf_header(62, 0, 0) + b"\0" * 100
    other = _cubin(_nv_info(_records()), machine=62)  # an embedded ELF that is not device code
    obj = host + other + b"padding" + cubin + b"\0" * 32
    assert kr.device_code(obj) == cubin
    assert kr.kernel_resources(cubin) == kr.KernelResources(registers=168, stack_bytes=40)
    no_stack = [r for r in _records(stack=0) if not (r[1] == 0x12 and r[2][:4] == struct.pack("<I", 7))]
    assert kr.kernel_resources(_cubin(_nv_info(no_stack))) == kr.KernelResources(168, 0)


def test_read_objects_writes_the_cubins(tmp_path):
    cubin = _cubin(_nv_info(_records(registers=232, stack=0)))
    (tmp_path / "k.o").write_bytes(_elf_header(62, 0, 0) + cubin)
    out = tmp_path / "cubins" / "sm_90a"  # made as needed
    assert kr.read_objects(tmp_path, ["k"], out) == {"k": kr.KernelResources(232, 0)}
    assert (out / "k.cubin").read_bytes() == cubin


def test_malformed_inputs_are_refused():
    with pytest.raises(ValueError, match="no NVIDIA device code"):
        kr.device_code(_elf_header(62, 0, 0) + _cubin(b"", machine=62))
    two = _records() + [(4, 0x2F, struct.pack("<II", 9, 100))]
    with pytest.raises(ValueError, match="one kernel"):
        kr.kernel_resources(_cubin(_nv_info(two)))
    with pytest.raises(ValueError, match="record format 9"):
        kr.kernel_resources(_cubin(bytes([9, 0x2F])))
