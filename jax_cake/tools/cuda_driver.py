"""The few CUDA driver-API calls the measurement tools need, through ctypes.

`jax_cake.tools.tune` (the busy kernel of condition (b)) and `jax_cake.tools.memory_floor` (data-
movement kernels) compile a small CUDA source with nvcc at run time and launch it on
their own stream of the device's primary context, the context JAX uses too. No torch,
no CUDA Python bindings: libcuda.so.1 is all a GPU machine is sure to have. Every call's
return code is checked.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

_ATTR_MAX_SHARED_OPTIN = 97  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
_ATTR_SM_COUNT = 16  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
_ATTR_CC_MAJOR, _ATTR_CC_MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_{MAJOR,MINOR}
_FUNC_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_STREAM_NON_BLOCKING = 1


def compile_cubin(source: str, arch: str) -> bytes:
    """nvcc -cubin for `arch` (e.g. "sm_90a"); raises if nvcc is missing or fails."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc is not on the PATH: it builds the measurement kernels")
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "kernels.cu"), os.path.join(tmp, "kernels.cubin")
        Path(src).write_text(source)
        subprocess.run([nvcc, "-cubin", "-O3", f"-arch={arch}", "-o", cubin, src], check=True)
        return Path(cubin).read_bytes()


class Driver:
    """Device 0's primary context, one module of kernels compiled for it (`source`, CUDA C)
    and one non-blocking stream."""

    def __init__(self, source: str, kernels: Sequence[str]):
        cu = self._cu = ctypes.CDLL("libcuda.so.1")
        cu.cuLaunchKernel.argtypes = (
            [ctypes.c_void_p]
            + [ctypes.c_uint] * 7
            + [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        )
        cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        cu.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        cu.cuEventElapsedTime.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]
        cu.cuMemsetD32Async.argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p]
        cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        self.device, ctx = ctypes.c_int(), ctypes.c_void_p()
        self.check(cu.cuInit(0), "cuInit")
        self.check(cu.cuDeviceGet(ctypes.byref(self.device), 0), "cuDeviceGet")
        self.check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self.device), "cuDevicePrimaryCtxRetain")
        self.check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        major, minor = self.attribute(_ATTR_CC_MAJOR), self.attribute(_ATTR_CC_MINOR)
        self.arch = f"sm_{major}{minor}" + ("a" if major >= 9 else "")  # sm_90a on an H200
        self._module, self.stream = ctypes.c_void_p(), ctypes.c_void_p()
        cubin = compile_cubin(source, self.arch)
        self.check(cu.cuModuleLoadData(ctypes.byref(self._module), cubin), "cuModuleLoadData")
        self.functions = {}
        for name in kernels:
            fn = ctypes.c_void_p()
            self.check(
                cu.cuModuleGetFunction(ctypes.byref(fn), self._module, name.encode()), f"cuModuleGetFunction({name})"
            )
            self.functions[name] = fn
        self.check(cu.cuStreamCreate(ctypes.byref(self.stream), _STREAM_NON_BLOCKING), "cuStreamCreate")

    @staticmethod
    def check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} returned CUDA error {code}")

    def attribute(self, attr: int) -> int:
        value = ctypes.c_int()
        self.check(
            self._cu.cuDeviceGetAttribute(ctypes.byref(value), attr, self.device), f"cuDeviceGetAttribute({attr})"
        )
        return value.value

    @property
    def name(self) -> str:
        buf = ctypes.create_string_buffer(256)
        self.check(self._cu.cuDeviceGetName(buf, 256, self.device), "cuDeviceGetName")
        return buf.value.decode()

    @property
    def sm_count(self) -> int:
        return self.attribute(_ATTR_SM_COUNT)

    def use_all_shared_memory(self, kernel: str, static_bytes: int = 0) -> int:
        """Lets `kernel` ask for the opt-in maximum of dynamic shared memory (one CTA per SM),
        less `static_bytes` its own __shared__ variables take; returns that dynamic maximum."""
        smem = self.attribute(_ATTR_MAX_SHARED_OPTIN) - static_bytes
        self.check(
            self._cu.cuFuncSetAttribute(self.functions[kernel], _FUNC_MAX_DYNAMIC_SHARED, smem),
            f"cuFuncSetAttribute({kernel})",
        )
        return smem

    def launch(self, kernel: str, grid: int, block: int, args: Sequence[ctypes._SimpleCData], smem: int = 0) -> None:
        """Enqueues kernel<<<grid, block, smem, stream>>>(*args); args are ctypes scalars."""
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        self.check(
            self._cu.cuLaunchKernel(self.functions[kernel], grid, 1, 1, block, 1, 1, smem, self.stream, params, None),
            f"cuLaunchKernel({kernel})",
        )

    def synchronize(self) -> None:
        self.check(self._cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def alloc(self, nbytes: int) -> ctypes.c_uint64:
        ptr = ctypes.c_uint64()
        self.check(self._cu.cuMemAlloc_v2(ctypes.byref(ptr), nbytes), f"cuMemAlloc({nbytes})")
        return ptr

    def free(self, ptr: ctypes.c_uint64) -> None:
        self.check(self._cu.cuMemFree_v2(ptr), "cuMemFree")

    def memset32(self, ptr: ctypes.c_uint64, word: int, count: int) -> None:
        """Sets `count` 32-bit words at ptr to `word` and waits."""
        self.check(self._cu.cuMemsetD32Async(ptr, word, count, self.stream), "cuMemsetD32Async")
        self.synchronize()

    def copy_to_host(self, dst: ctypes.c_void_p, src: ctypes.c_uint64, nbytes: int) -> None:
        """Waits for the stream, then copies nbytes of device memory to host memory."""
        self.synchronize()
        self.check(self._cu.cuMemcpyDtoH_v2(dst, src, nbytes), "cuMemcpyDtoH")

    def event(self) -> ctypes.c_void_p:
        ev = ctypes.c_void_p()
        self.check(self._cu.cuEventCreate(ctypes.byref(ev), 0), "cuEventCreate")
        return ev

    def record(self, ev: ctypes.c_void_p) -> None:
        self.check(self._cu.cuEventRecord(ev, self.stream), "cuEventRecord")

    def elapsed_us(self, start: ctypes.c_void_p, end: ctypes.c_void_p) -> float:
        ms = ctypes.c_float()
        self.check(self._cu.cuEventSynchronize(end), "cuEventSynchronize")
        self.check(self._cu.cuEventElapsedTime(ctypes.byref(ms), start, end), "cuEventElapsedTime")
        return ms.value * 1e3
