"""infer's GPU metrics (services/infer/gpu_metrics.py): nothing on a machine without a GPU, exact
values from NVML's readings where there is one (a stand-in NVML module: the collector's logic)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from services.common.settings import TelemetrySettings
from services.common.telemetry import Telemetry
from services.infer import gpu_metrics

GPU_FAMILIES = {"ocrstream_gpu_memory_used_bytes", "ocrstream_gpu_memory_total_bytes", "ocrstream_gpu_utilization_ratio"}


class FakeNvml:
    """The pynvml functions the collector calls, over fixed readings per device index."""

    class NVMLError(Exception):
        pass

    def __init__(self, devices: list[tuple[int, int, int]], broken: set[int] = frozenset()):
        self.devices = devices  # (used bytes, total bytes, utilisation %)
        self.broken = set(broken)
        self.calls: list[str] = []

    def nvmlInit(self):
        self.calls.append("init")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetMemoryInfo(self, handle):
        i = handle[1]
        if i in self.broken:
            raise self.NVMLError("GPU is lost")
        used, total, _ = self.devices[i]
        return SimpleNamespace(used=used, total=total, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=self.devices[handle[1]][2], memory=0)


def _families(registry: CollectorRegistry) -> set[str]:
    return {m.name for m in registry.collect()}


def test_without_a_gpu_nothing_is_registered_nothing_raises_and_one_line_is_logged(caplog):
    """This machine: the real nvidia-ml-py finds no libnvidia-ml.so."""
    tel = Telemetry("infer", TelemetrySettings())
    with caplog.at_level(logging.INFO, logger="services.infer.gpu_metrics"):
        assert gpu_metrics.watch(tel.registry) is None
    assert not GPU_FAMILIES & _families(tel.registry)
    assert b"ocrstream_gpu" not in generate_latest(tel.registry)
    [rec] = [r for r in caplog.records if r.name == "services.infer.gpu_metrics"]
    assert rec.levelno == logging.INFO
    assert rec.getMessage() == "infer: no GPU metrics: NVML unavailable (NVML Shared Library Not Found)"


def test_an_nvml_that_cannot_import_or_sees_no_device_registers_nothing():
    class NoDriver(FakeNvml):
        def nvmlInit(self):
            raise FakeNvml.NVMLError("Driver Not Loaded")

    reg = CollectorRegistry()
    assert gpu_metrics.watch(reg, NoDriver([])) is None
    empty = FakeNvml([])
    assert gpu_metrics.watch(reg, empty) is None
    assert empty.calls == ["init", "shutdown"]
    assert list(reg.collect()) == []


def test_each_device_reports_its_memory_and_utilisation_at_every_scrape():
    nvml = FakeNvml([(3 * 2**30, 80 * 2**30, 37), (0, 143_771_156_480, 100)])
    reg = CollectorRegistry()
    collector = gpu_metrics.watch(reg, nvml)
    assert collector is not None and _families(reg) == GPU_FAMILIES
    v = reg.get_sample_value
    assert v("ocrstream_gpu_memory_used_bytes", {"device": "0"}) == 3 * 2**30
    assert v("ocrstream_gpu_memory_total_bytes", {"device": "0"}) == 80 * 2**30
    assert v("ocrstream_gpu_utilization_ratio", {"device": "0"}) == 0.37
    assert v("ocrstream_gpu_memory_used_bytes", {"device": "1"}) == 0.0
    assert v("ocrstream_gpu_memory_total_bytes", {"device": "1"}) == 143_771_156_480
    assert v("ocrstream_gpu_utilization_ratio", {"device": "1"}) == 1.0
    nvml.devices[0] = (5 * 2**30, 80 * 2**30, 2)  # read again at the next scrape
    assert v("ocrstream_gpu_memory_used_bytes", {"device": "0"}) == 5 * 2**30
    assert v("ocrstream_gpu_utilization_ratio", {"device": "0"}) == 0.02
    text = generate_latest(reg).decode()
    assert 'ocrstream_gpu_memory_used_bytes{device="0"} 5.36870912e+09' in text
    assert "# TYPE ocrstream_gpu_utilization_ratio gauge" in text


def test_a_device_unreadable_at_a_scrape_is_left_out_and_the_scrape_goes_on():
    nvml = FakeNvml([(1, 10, 50), (2, 20, 60)], broken={0})
    reg = CollectorRegistry()
    gpu_metrics.watch(reg, nvml)
    assert reg.get_sample_value("ocrstream_gpu_memory_used_bytes", {"device": "0"}) is None
    assert reg.get_sample_value("ocrstream_gpu_memory_used_bytes", {"device": "1"}) == 2.0
    assert reg.get_sample_value("ocrstream_gpu_utilization_ratio", {"device": "1"}) == 0.6
    nvml.broken.clear()
    assert reg.get_sample_value("ocrstream_gpu_memory_total_bytes", {"device": "0"}) == 10.0


def test_a_device_without_utilisation_still_reports_its_memory():
    """NVML's nvmlDeviceGetUtilizationRates: "On MIG-enabled GPUs, querying device utilization
    rates is not currently supported" (NVML API reference); memory is still read."""
    class Mig(FakeNvml):
        def nvmlDeviceGetUtilizationRates(self, handle):
            if handle[1] == 0:
                raise FakeNvml.NVMLError("Not Supported")
            return super().nvmlDeviceGetUtilizationRates(handle)

    reg = CollectorRegistry()
    gpu_metrics.watch(reg, Mig([(7, 140, 50), (2, 20, 60)]))
    v = reg.get_sample_value
    assert (v("ocrstream_gpu_memory_used_bytes", {"device": "0"}), v("ocrstream_gpu_memory_total_bytes", {"device": "0"}),
            v("ocrstream_gpu_utilization_ratio", {"device": "0"})) == (7.0, 140.0, None)
    assert v("ocrstream_gpu_utilization_ratio", {"device": "1"}) == 0.6


def test_a_device_nvml_cannot_open_at_start_is_left_out_and_the_others_are_watched():
    class OneLost(FakeNvml):
        def nvmlDeviceGetHandleByIndex(self, i):
            if i == 0:
                raise FakeNvml.NVMLError("GPU is lost")
            return super().nvmlDeviceGetHandleByIndex(i)

    reg = CollectorRegistry()
    assert gpu_metrics.watch(reg, OneLost([(1, 10, 50), (2, 20, 60)])) is not None
    assert reg.get_sample_value("ocrstream_gpu_memory_used_bytes", {"device": "0"}) is None
    assert reg.get_sample_value("ocrstream_gpu_memory_used_bytes", {"device": "1"}) == 2.0
