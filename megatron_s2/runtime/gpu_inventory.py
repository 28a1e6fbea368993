"""NVML inventory of this node's GPUs (``nvidia-ml-py``): count, ECC errors, clocks, temperature.

A machine without an NVIDIA driver (or without ``nvidia-ml-py``) gets an inventory that says
so in one line; querying never raises. Individual NVML queries that a GPU does not support
(ECC on consumer boards, clocks under MIG) are reported as ``None``, not as failures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["GpuStatus", "NodeInventory", "query_inventory"]


@dataclass(frozen=True)
class GpuStatus:
    index: int
    name: str
    uuid: str
    memory_total_mib: int
    temperature_c: int | None
    sm_clock_mhz: int | None
    max_sm_clock_mhz: int | None
    ecc_uncorrected: int | None
    """Volatile (since driver load) uncorrected ECC errors; > 0 means the GPU should be drained."""
    ecc_corrected: int | None
    """Volatile corrected ECC errors (informational)."""

    def problems(self) -> list[str]:
        if self.ecc_uncorrected:
            return [f"GPU {self.index} ({self.uuid}) has {self.ecc_uncorrected} uncorrected ECC errors"]
        return []


@dataclass(frozen=True)
class NodeInventory:
    host: str
    available: bool
    """Whether NVML answered (an NVIDIA driver is present)."""
    message: str
    """Driver/NVML version, or why there is no inventory ("no NVIDIA driver found ...")."""
    gpus: tuple[GpuStatus, ...] = field(default_factory=tuple)

    def problems(self, expected_gpus: int = 0) -> list[str]:
        out = [f"{self.host}: {p}" for gpu in self.gpus for p in gpu.problems()]
        if expected_gpus and len(self.gpus) < expected_gpus:
            out.append(f"{self.host}: {len(self.gpus)} GPUs visible to NVML, {expected_gpus} expected")
        return out


def _optional(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception:  # pynvml.NVMLError_NotSupported and friends: a missing reading, not a failure
        return None


def _gpu_status(nvml: Any, index: int) -> GpuStatus:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    name = nvml.nvmlDeviceGetName(handle)
    uuid = nvml.nvmlDeviceGetUUID(handle)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)

    def ecc(kind: int) -> int | None:
        return _optional(lambda: nvml.nvmlDeviceGetTotalEccErrors(handle, kind, nvml.NVML_VOLATILE_ECC))

    return GpuStatus(
        index=index,
        name=name.decode() if isinstance(name, bytes) else str(name),
        uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
        memory_total_mib=int(memory.total) // (1 << 20),
        temperature_c=_optional(lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
        sm_clock_mhz=_optional(lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
        max_sm_clock_mhz=_optional(lambda: nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM)),
        ecc_uncorrected=ecc(nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
        ecc_corrected=ecc(nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
    )


def query_inventory(host: str) -> NodeInventory:
    """Inventory of the GPUs NVML sees on this node (all of them, not only this rank's)."""
    try:
        import pynvml as nvml
    except ImportError:
        return NodeInventory(host, False, "no NVIDIA driver found (nvidia-ml-py is not installed; "
                                          "pip install nvidia-ml-py on GPU nodes)")
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded on CPU machines
        return NodeInventory(host, False, f"no NVIDIA driver found (NVML: {exc})")
    try:
        driver = nvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
        gpus = tuple(_gpu_status(nvml, i) for i in range(nvml.nvmlDeviceGetCount()))
        return NodeInventory(host, True, f"NVIDIA driver {driver}", gpus)
    except Exception as exc:
        return NodeInventory(host, False, f"NVML query failed: {exc}")
    finally:
        _optional(nvml.nvmlShutdown)
