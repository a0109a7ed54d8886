"""runtime/gpu.py's GpuReader and the controller's preflight GPU check through the real NVML."""

from __future__ import annotations

import pytest
import torch

from runtime.gpu import GpuReader

pytestmark = pytest.mark.gpu

GIB = 1 << 30


@pytest.fixture()
def reader():
    reader = GpuReader()
    yield reader
    reader.close()


def test_reader_sees_every_cuda_device_with_plausible_readings(reader):
    assert reader.available
    readings = reader.read()
    assert len(readings) >= torch.cuda.device_count() >= 1
    assert [r.index for r in readings] == list(range(len(readings)))
    for r in readings:
        assert r.name.strip() and "NVIDIA" in r.name.upper()
        assert r.memory_total_bytes is not None and r.memory_total_bytes > GIB
        assert r.memory_used_bytes is not None and 0 <= r.memory_used_bytes <= r.memory_total_bytes
        assert r.utilization_ratio is not None and 0.0 <= r.utilization_ratio <= 1.0  # NVML's 0–100 percent
        assert r.temperature_celsius is None or 0 < r.temperature_celsius < 120
        assert r.power_watts is None or 0 < r.power_watts < 2000
    # The same board torch sees (NVML counts every GPU; CUDA_VISIBLE_DEVICES may hide some from torch).
    props = torch.cuda.get_device_properties(0)
    assert any(abs(r.memory_total_bytes - props.total_memory) < 2 * GIB for r in readings)


def test_memory_used_follows_a_real_allocation(reader):
    index = torch.cuda.current_device()
    before = reader.read()[index].memory_used_bytes
    block = torch.empty(4 * GIB, dtype=torch.uint8, device="cuda")
    block.fill_(1)
    torch.cuda.synchronize()
    during = reader.read()[index].memory_used_bytes
    del block
    torch.cuda.empty_cache()
    assert during - before >= 3 * GIB  # a live reading, not a cached one


def test_close_leaves_a_reader_that_reports_no_gpus():
    reader = GpuReader()
    assert reader.read()
    reader.close()
    assert not reader.available and reader.read() == []


def test_preflight_sees_the_gpu_when_the_device_is_cuda(monkeypatch, tmp_path):
    from services.controller.runs.preflight import check_gpu, visible_gpus
    from shared.settings import ControllerSettings

    names, why = visible_gpus()
    assert names and why == ""
    monkeypatch.setenv("DRAFTLINE_DATA", str(tmp_path))
    monkeypatch.setenv("DRAFTLINE_DEVICE", "cuda")
    check = check_gpu(ControllerSettings())
    assert check.ok and f"{len(names)} GPU(s) visible" in check.message, check
