"""The few CUDA driver-API calls the measurement tools need, through NVIDIA's
`cuda.bindings` (cuda-python; installed with the CuTe DSL and on the GPU image).

`benchmarks.tune` (the busy kernel of condition (b)) and `benchmarks.memory_floor`
(data-movement kernels) compile a small CUDA source with nvcc at run time and launch it on
their own stream of the device's primary context, the context JAX uses too. Every call's
return code is checked. Kernel arguments are ctypes scalars (cuLaunchKernel copies each
from the address in its parameter array).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence


class NoDriverError(OSError):
    """No NVIDIA driver (libcuda) on this machine: not a GPU machine."""


def _driver():
    from cuda.bindings import driver  # only a GPU run needs it
    from cuda.pathfinder import DynamicLibNotFoundError

    try:
        check(driver.cuInit(0), "cuInit")
    except DynamicLibNotFoundError as e:
        raise NoDriverError(str(e)) from None
    return driver


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


def check(result, what: str):
    """Unpacks a cuda.bindings result tuple (CUresult, *values); raises on an error."""
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"{what} returned CUDA error {int(err)} ({err.name})")
    return values[0] if len(values) == 1 else tuple(values) if values else None


def profiler_range():
    """(start, stop): cuProfilerStart / cuProfilerStop of the current context (the one JAX
    made current on this thread), each return code checked. A profiler started with
    `--profile-from-start off` (ncu, nsys) records only what runs between the two."""
    driver = _driver()
    return (
        lambda: check(driver.cuProfilerStart(), "cuProfilerStart"),
        lambda: check(driver.cuProfilerStop(), "cuProfilerStop"),
    )


class Driver:
    """Device 0's primary context, one module of kernels compiled for it (`source`, CUDA C)
    and one non-blocking stream."""

    def __init__(self, source: str, kernels: Sequence[str]):
        cu = self._cu = _driver()
        self.device = check(cu.cuDeviceGet(0), "cuDeviceGet")
        ctx = check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        attr = cu.CUdevice_attribute
        major = self.attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = self.attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        self.arch = f"sm_{major}{minor}" + ("a" if major >= 9 else "")  # sm_90a on an H200
        self._module = check(cu.cuModuleLoadData(compile_cubin(source, self.arch)), "cuModuleLoadData")
        self.functions = {
            name: check(cu.cuModuleGetFunction(self._module, name.encode()), f"cuModuleGetFunction({name})")
            for name in kernels
        }
        self.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")

    def attribute(self, attr) -> int:
        return check(self._cu.cuDeviceGetAttribute(attr, self.device), f"cuDeviceGetAttribute({attr})")

    @property
    def name(self) -> str:
        return check(self._cu.cuDeviceGetName(256, self.device), "cuDeviceGetName").split(b"\0")[0].decode()

    @property
    def sm_count(self) -> int:
        return self.attribute(self._cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)

    def use_all_shared_memory(self, kernel: str, static_bytes: int = 0) -> int:
        """Lets `kernel` ask for the opt-in maximum of dynamic shared memory (one CTA per SM),
        less `static_bytes` its own __shared__ variables take; returns that dynamic maximum."""
        cu = self._cu
        smem = self.attribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        smem -= static_bytes
        attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(cu.cuFuncSetAttribute(self.functions[kernel], attr, smem), f"cuFuncSetAttribute({kernel})")
        return smem

    def launch(self, kernel: str, grid: int, block: int, args: Sequence, smem: int = 0) -> None:
        """Enqueues kernel<<<grid, block, smem, stream>>>(*args); args are ctypes scalars or
        device pointers from `alloc`."""
        values = [ctypes.c_uint64(int(a)) if isinstance(a, self._cu.CUdeviceptr) else a for a in args]
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        check(
            self._cu.cuLaunchKernel(
                self.functions[kernel], grid, 1, 1, block, 1, 1, smem, self.stream, ctypes.addressof(params), 0
            ),
            f"cuLaunchKernel({kernel})",
        )

    def synchronize(self) -> None:
        check(self._cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def alloc(self, nbytes: int):
        return check(self._cu.cuMemAlloc(nbytes), f"cuMemAlloc({nbytes})")

    def free(self, ptr) -> None:
        check(self._cu.cuMemFree(ptr), "cuMemFree")

    def memset32(self, ptr, word: int, count: int) -> None:
        """Sets `count` 32-bit words at ptr to `word` and waits."""
        check(self._cu.cuMemsetD32Async(ptr, word, count, self.stream), "cuMemsetD32Async")
        self.synchronize()

    def copy_to_host(self, dst: int, src, nbytes: int) -> None:
        """Waits for the stream, then copies nbytes of device memory to host address dst."""
        self.synchronize()
        check(self._cu.cuMemcpyDtoH(dst, src, nbytes), "cuMemcpyDtoH")

    def event(self):
        return check(self._cu.cuEventCreate(0), "cuEventCreate")

    def record(self, ev) -> None:
        check(self._cu.cuEventRecord(ev, self.stream), "cuEventRecord")

    def elapsed_us(self, start, end) -> float:
        check(self._cu.cuEventSynchronize(end), "cuEventSynchronize")
        return check(self._cu.cuEventElapsedTime(start, end), "cuEventElapsedTime") * 1e3
