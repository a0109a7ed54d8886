"""GPU readings through NVML (``nvidia-ml-py``). A machine without the driver or without GPUs reads as
zero GPUs: the exporter still serves everything else."""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

try:
    import pynvml
except ImportError:  # the package is a dependency, but a slim install may leave it out
    pynvml = None


@dataclass(frozen=True)
class GpuReading:
    index: int
    name: str
    utilization_ratio: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    temperature_celsius: float | None
    power_watts: float | None


class GpuReader:
    """Initialises NVML once (it costs tens of milliseconds); each ``read`` only queries handles."""

    def __init__(self) -> None:
        self.available = _init_nvml()

    def read(self) -> list[GpuReading]:
        if not self.available:
            return []
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            log.warning("NVML device count failed: %s", exc)
            return []
        return [_read_one(i) for i in range(count)]

    def close(self) -> None:
        if self.available:
            pynvml.nvmlShutdown()
            self.available = False


def _init_nvml() -> bool:
    if pynvml is None:
        log.info("nvidia-ml-py not installed; reporting no GPUs")
        return False
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.info("NVML unavailable (%s); reporting no GPUs", exc)
        return False
    return True


def _read_one(index: int) -> GpuReading:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    utilization = _query(pynvml.nvmlDeviceGetUtilizationRates, handle)
    memory = _query(pynvml.nvmlDeviceGetMemoryInfo, handle)
    temperature = _query(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU)
    power_mw = _query(pynvml.nvmlDeviceGetPowerUsage, handle)
    name = _query(pynvml.nvmlDeviceGetName, handle)
    return GpuReading(
        index=index,
        name=name.decode() if isinstance(name, bytes) else str(name or ""),
        utilization_ratio=utilization.gpu / 100.0 if utilization is not None else None,
        memory_used_bytes=memory.used if memory is not None else None,
        memory_total_bytes=memory.total if memory is not None else None,
        temperature_celsius=float(temperature) if temperature is not None else None,
        power_watts=power_mw / 1000.0 if power_mw is not None else None,
    )


def _query(func, *args):
    """One NVML query; a field some GPUs do not support (power on many boards) reads as missing."""
    try:
        return func(*args)
    except pynvml.NVMLError as exc:
        log.debug("NVML %s failed: %s", func.__name__, exc)
        return None
