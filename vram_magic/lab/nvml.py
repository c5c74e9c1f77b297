"""The devices as NVML sees them (through nvidia-ml-py's ``pynvml``): totals and the processes on each.

NVML is optional: without the package, without a driver, or when it fails, :meth:`Nvml.read` returns no
devices and a sentence that says why. Nothing here initialises CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used: int | None  # bytes; None where NVML gives no per-process figure (MIG, WDDM)


@dataclass(frozen=True)
class NvmlDevice:
    index: int  # NVML's index (PCI bus order, which CUDA follows only with CUDA_DEVICE_ORDER=PCI_BUS_ID)
    name: str
    uuid: str
    total: int
    used: int
    free: int
    mig: bool
    processes: tuple[GpuProcess, ...]


class Nvml:
    """One NVML session for the server's life: initialised on first use, failures remembered as a note."""

    def __init__(self, module: Any = None) -> None:
        self._nvml = module
        self._ready = False
        self.note: str | None = None

    def _init(self) -> Any:
        if self._ready or self.note is not None:
            return self._nvml if self._ready else None
        nvml = self._nvml
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError:
                self.note = ("nvidia-ml-py is not installed in the server's environment: no GPU figures from NVML "
                             "(pip install 'vram_magic[lab]'); kernels with vram_magic loaded still report their own")
                return None
        try:
            nvml.nvmlInit()
        except Exception as err:
            self.note = f"NVML is not available ({_nvml_error(err)}): no GPU figures from the driver"
            return None
        self._nvml, self._ready = nvml, True
        return nvml

    def read(self) -> tuple[list[NvmlDevice], list[str]]:
        nvml = self._init()
        if nvml is None:
            return [], [self.note] if self.note else []
        notes: list[str] = []
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as err:
            return [], [f"NVML could not count the devices ({_nvml_error(err)})"]
        devices = []
        for index in range(count):
            try:
                devices.append(_device(nvml, index))
            except Exception as err:
                notes.append(f"NVML could not read device {index} ({_nvml_error(err)})")
        return devices, notes

    def close(self) -> None:
        if self._ready:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._ready = False


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_error(err: Exception) -> str:
    return f"{type(err).__name__}: {err}".replace("NVMLError_", "")


def _device(nvml: Any, index: int) -> NvmlDevice:
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    mem = nvml.nvmlDeviceGetMemoryInfo(h)
    try:
        mig = bool(nvml.nvmlDeviceGetMigMode(h)[0])
    except Exception:  # not a MIG-capable device
        mig = False
    not_available = getattr(nvml, "NVML_VALUE_NOT_AVAILABLE", None)
    seen: dict[int, GpuProcess] = {}
    for query in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            procs = getattr(nvml, query)(h)
        except Exception:
            continue
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            if used is None or used == not_available or (isinstance(used, int) and used < 0):
                used = None
            pid = int(p.pid)
            if pid not in seen or (seen[pid].used is None and used is not None):
                seen[pid] = GpuProcess(pid, None if used is None else int(used))
    return NvmlDevice(index=index, name=_text(nvml.nvmlDeviceGetName(h)), uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                  total=int(mem.total), used=int(mem.used), free=int(mem.free), mig=mig,
                  processes=tuple(seen.values()))


def same_device(nvml_uuid: str, torch_uuid: str | None) -> bool:
    """NVML's ``GPU-xxxxxxxx-…`` against PyTorch's ``str(get_device_properties(i).uuid)`` (no prefix)."""
    if not torch_uuid:
        return False
    a = nvml_uuid.lower().removeprefix("gpu-").removeprefix("mig-")
    b = str(torch_uuid).lower().removeprefix("gpu-").removeprefix("mig-")
    return a == b
