"""GPU pair facts torch does not expose: native peer atomics and NVLink.

Native atomics come from the CUDA driver API (``cuDeviceGetP2PAttribute``), NVLink from NVML
(``nvmlDeviceGetP2PStatus``), both through ctypes so nothing beyond the driver is needed.
Every query answers None when its library is missing or refuses, so "unknown" stays visible
to the caller instead of turning into a guess. Driver ordinals follow CUDA_VISIBLE_DEVICES
like torch's; NVML numbers GPUs physically, so GPUs are matched by PCI bus id.
"""

from __future__ import annotations

import ctypes
from functools import cached_property

import torch

CU_P2P_NATIVE_ATOMIC_SUPPORTED = 0x03  # CUdevice_P2PAttribute
NVML_P2P_CAPS_INDEX_NVLINK = 2  # nvmlGpuP2PCapsIndex_t
NVML_P2P_STATUS_OK = 0


def _load(name: str) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


class DriverApi:
    """The few CUDA driver calls needed, or None answers when libcuda is absent."""

    def __init__(self, library: str = "libcuda.so.1") -> None:
        self._lib = _load(library)
        if self._lib is not None and self._lib.cuInit(0) != 0:
            self._lib = None

    def _device(self, ordinal: int) -> ctypes.c_int | None:
        dev = ctypes.c_int()
        if self._lib is None or self._lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
            return None
        return dev

    def native_atomics(self, a: int, b: int) -> bool | None:
        da, db = self._device(a), self._device(b)
        if da is None or db is None:
            return None
        value = ctypes.c_int()
        rc = self._lib.cuDeviceGetP2PAttribute(ctypes.byref(value), CU_P2P_NATIVE_ATOMIC_SUPPORTED,
                                               da, db)
        return None if rc != 0 else bool(value.value)

    def pci_bus_id(self, ordinal: int) -> str | None:
        dev = self._device(ordinal)
        if dev is None:
            return None
        buf = ctypes.create_string_buffer(64)
        if self._lib.cuDeviceGetPCIBusId(buf, 64, dev) != 0:
            return None
        return buf.value.decode()


class Nvml:
    """NVLink between two GPUs by PCI bus id, or None when NVML is absent or refuses."""

    def __init__(self, library: str = "libnvidia-ml.so.1") -> None:
        self._lib = _load(library)
        if self._lib is not None and self._lib.nvmlInit_v2() != 0:
            self._lib = None

    def _handle(self, bus_id: str) -> ctypes.c_void_p | None:
        handle = ctypes.c_void_p()
        if self._lib.nvmlDeviceGetHandleByPciBusId_v2(bus_id.encode(), ctypes.byref(handle)) != 0:
            return None
        return handle

    def nvlink(self, bus_a: str | None, bus_b: str | None) -> bool | None:
        if self._lib is None or bus_a is None or bus_b is None:
            return None
        ha, hb = self._handle(bus_a), self._handle(bus_b)
        if ha is None or hb is None:
            return None
        status = ctypes.c_int()
        if self._lib.nvmlDeviceGetP2PStatus(ha, hb, NVML_P2P_CAPS_INDEX_NVLINK,
                                            ctypes.byref(status)) != 0:
            return None
        return status.value == NVML_P2P_STATUS_OK


class CudaPeerProbe:
    """``topology.PeerProbe`` for this machine: torch for P2P, the driver and NVML for the rest."""

    def __init__(self, driver: DriverApi | None = None, nvml: Nvml | None = None) -> None:
        self._driver_arg, self._nvml_arg = driver, nvml

    @cached_property
    def driver(self) -> DriverApi:
        return self._driver_arg or DriverApi()

    @cached_property
    def nvml(self) -> Nvml:
        return self._nvml_arg or Nvml()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def capability(self, device: int) -> tuple[int, int]:
        return torch.cuda.get_device_capability(device)

    def can_access(self, a: int, b: int) -> bool:
        return bool(torch.cuda.can_device_access_peer(a, b))

    def native_atomics(self, a: int, b: int) -> bool | None:
        return self.driver.native_atomics(a, b)

    def nvlink(self, a: int, b: int) -> bool | None:
        return self.nvml.nvlink(self.driver.pci_bus_id(a), self.driver.pci_bus_id(b))
