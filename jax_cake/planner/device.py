"""Which GPU a trace is planned for: architecture and SM count, found at trace time.

Order of lookup: the abstract mesh in scope (inside shard_map or
`jax.sharding.use_abstract_mesh`), else the mesh of the arguments' sharding, else
`jax.devices()[0]`. Abstract devices carry a kind name and a core count but no compute
capability, so the architecture comes from the kind name there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

# Kind-name fragments -> the architecture jax_cake plans for. Checked in order, so the
# longer names come first ("GH200" before "H200" is harmless: both are sm_90a).
_ARCH_BY_KIND = (
    ("GB300", "sm_103a"),
    ("B300", "sm_103a"),
    ("GB200", "sm_100a"),
    ("B200", "sm_100a"),
    ("R200", "sm_107a"),
    ("H200", "sm_90a"),
    ("H100", "sm_90a"),
    ("H800", "sm_90a"),
    ("H20", "sm_90a"),
    ("A100", "sm_80"),
    ("A10", "sm_86"),
    ("L40", "sm_89"),
)

# Compute capability -> architecture with the arch-specific suffix the kernels use.
_ARCH_BY_CC = {"9.0": "sm_90a", "10.0": "sm_100a", "10.3": "sm_103a", "10.7": "sm_107a"}


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What the planner needs to know about a device.

    platform: "cuda", "cpu", "rocm", ...; kind: the device kind name ("NVIDIA H200");
    arch: "sm_90a"-style name or None when not a CUDA GPU; sm_count: multiprocessors or
    None when unknown.
    """

    platform: str
    kind: str
    arch: str | None
    sm_count: int | None

    def describe(self) -> str:
        if self.arch is None:
            return f"{self.kind} ({self.platform})"
        return f"{self.kind} ({self.arch}, {self.sm_count} SMs)"


def _arch_from_kind(kind: str) -> str | None:
    upper = kind.upper()
    for fragment, arch in _ARCH_BY_KIND:
        if fragment in upper:
            return arch
    return None


def _normalize_platform(platform: str) -> str:
    return "cuda" if platform in ("gpu", "cuda") else platform


def from_jax_device(device: Any) -> DeviceInfo:
    """DeviceInfo of a `jax.Device` or a `jax.sharding.AbstractDevice`."""
    if isinstance(device, DeviceInfo):
        return device
    if not isinstance(getattr(device, "platform", None), str):
        raise TypeError(
            f"device must be a jax Device, a jax.sharding.AbstractDevice or a DeviceInfo, got {type(device).__name__}"
        )
    if isinstance(device, jax.sharding.AbstractDevice):
        platform = _normalize_platform(device.platform)
        arch = _arch_from_kind(device.device_kind) if platform == "cuda" else None
        return DeviceInfo(platform, device.device_kind, arch, device.num_cores)
    platform = _normalize_platform(device.platform)
    kind = getattr(device, "device_kind", platform)
    cc = getattr(device, "compute_capability", None)
    arch = None
    if platform == "cuda":
        if cc is not None:
            arch = _ARCH_BY_CC.get(str(cc), "sm_" + str(cc).replace(".", ""))
        else:
            arch = _arch_from_kind(kind)
    return DeviceInfo(platform, kind, arch, getattr(device, "core_count", None))


def _mesh_of(args) -> Any:
    for leaf in jax.tree_util.tree_leaves(args):
        sharding = getattr(leaf, "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and not getattr(mesh, "empty", True):
            return mesh
    return None


def current(*args: Any) -> DeviceInfo:
    """The device a trace over `args` is planned for (see the module docstring)."""
    abstract_mesh = jax.sharding.get_abstract_mesh()
    if not abstract_mesh.empty and abstract_mesh.abstract_device is not None:
        return from_jax_device(abstract_mesh.abstract_device)
    mesh = _mesh_of(args)
    if mesh is not None:
        abstract_device = getattr(mesh, "abstract_device", None)
        if abstract_device is not None:
            return from_jax_device(abstract_device)
        devices = getattr(mesh, "devices", None)
        if devices is not None:
            return from_jax_device(devices.flat[0])
    return from_jax_device(jax.devices()[0])
