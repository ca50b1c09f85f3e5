"""GPU memory and utilisation per device as Prometheus metrics, read through NVML on each scrape.

A custom ``prometheus_client`` collector (the library's documented pattern for values owned by
another system: https://prometheus.github.io/client_python/collector/custom/) over NVML, the
NVIDIA Management Library, through its official Python binding ``nvidia-ml-py`` (module
``pynvml``). Exported per device NVML sees, labelled ``device`` (NVML's index, as
``nvidia-smi`` numbers them):

* ``ocrstream_gpu_memory_used_bytes`` and ``ocrstream_gpu_memory_total_bytes``
  (``nvmlDeviceGetMemoryInfo``: ``used`` and ``total``, bytes);
* ``ocrstream_gpu_utilization_ratio``: the share of the last sample period (1/6 s to 1 s,
  depending on the product) in which a kernel ran on the GPU, 0..1
  (``nvmlDeviceGetUtilizationRates().gpu`` / 100).

On a machine without an NVIDIA driver (``libnvidia-ml.so`` not found, NVML not initialisable,
no device) :func:`watch` registers nothing and logs one line at INFO: no metric, no error.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import ModuleType

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

_MEM_USED = ("ocrstream_gpu_memory_used_bytes", "GPU memory in use per device (NVML), bytes")
_MEM_TOTAL = ("ocrstream_gpu_memory_total_bytes", "GPU memory of each device (NVML), bytes")
_UTIL = ("ocrstream_gpu_utilization_ratio",
         "Share of NVML's last sample period in which a kernel ran on the device, 0..1")


class GpuCollector(Collector):
    """Reads every device's memory and utilisation from NVML when Prometheus scrapes.

    Build it with :meth:`open`, which initialises NVML once. A device whose reading fails at a
    scrape (a GPU fallen off the bus) is left out of that scrape, logged at DEBUG; the scrape
    itself never fails. Memory and utilisation are read apart: NVML reports no utilisation on a
    MIG-enabled GPU ("On MIG-enabled GPUs, querying device utilization rates is not currently
    supported", NVML API reference, ``nvmlDeviceGetUtilizationRates``), whose memory still counts.

    Args:
        nvml: The ``pynvml`` module (or a stand-in with the same functions), already initialised.
        handles: ``(device label, NVML handle)`` per device.
    """

    def __init__(self, nvml: ModuleType, handles: list[tuple[str, object]]):
        self.nvml = nvml
        self.handles = handles

    @classmethod
    def open(cls, nvml: ModuleType | None = None) -> GpuCollector | None:
        """NVML initialised and its devices listed, or None (logged once at INFO) when there is
        no NVML library, it cannot initialise (no driver) or it sees no device. A device NVML
        cannot open (``nvmlDeviceGetHandleByIndex`` fails: a GPU lost, or not permitted) is left
        out, logged at WARNING, and the others are watched.

        Args:
            nvml: The binding to use (tests pass a stand-in); default ``import pynvml``.
        """
        try:
            if nvml is None:
                import pynvml as nvml  # nvidia-ml-py
            nvml.nvmlInit()
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
            log.info("infer: no GPU metrics: NVML unavailable (%s)", exc or type(exc).__name__)
            return None
        try:
            count = nvml.nvmlDeviceGetCount()
        except Exception as exc:
            log.info("infer: no GPU metrics: NVML lists no device (%s)", exc or type(exc).__name__)
            _shutdown(nvml)
            return None
        handles = []
        for i in range(count):
            try:
                handles.append((str(i), nvml.nvmlDeviceGetHandleByIndex(i)))
            except Exception as exc:  # one lost or forbidden GPU: the others are still watched
                log.warning("infer: GPU %d left out of the GPU metrics: NVML cannot open it (%s)", i,
                            exc or type(exc).__name__)
        if not handles:
            log.info("infer: no GPU metrics: NVML sees no device")
            _shutdown(nvml)
            return None
        log.info("infer: GPU metrics for %d device(s) from NVML", len(handles))
        return cls(nvml, handles)

    def describe(self) -> list[GaugeMetricFamily]:
        """The three families, without samples (what the registry checks names against)."""
        return [GaugeMetricFamily(*_MEM_USED, labels=["device"]), GaugeMetricFamily(*_MEM_TOTAL, labels=["device"]),
                GaugeMetricFamily(*_UTIL, labels=["device"])]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """One sample per readable device in each family (called on every scrape)."""
        used, total, util = self.describe()
        for label, handle in self.handles:
            try:
                mem = self.nvml.nvmlDeviceGetMemoryInfo(handle)
                used.add_metric([label], float(mem.used))
                total.add_metric([label], float(mem.total))
            except Exception as exc:
                log.debug("infer: GPU %s memory unreadable through NVML: %r", label, exc)
            try:  # apart from memory: NVML does not report utilisation on a MIG-enabled GPU
                util.add_metric([label], float(self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu) / 100.0)
            except Exception as exc:
                log.debug("infer: GPU %s utilisation unreadable through NVML: %r", label, exc)
        yield from (used, total, util)

    def close(self) -> None:
        """Shut NVML down (the collector reads nothing afterwards)."""
        self.handles = []
        _shutdown(self.nvml)


def _shutdown(nvml: ModuleType) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:  # nothing to release
        log.debug("infer: nvmlShutdown failed", exc_info=True)


def watch(registry: CollectorRegistry, nvml: ModuleType | None = None) -> GpuCollector | None:
    """Register a :class:`GpuCollector` on ``registry`` when NVML sees a GPU; else do nothing.

    Returns:
        The collector registered, or None (no NVML, no driver, no device: logged once at INFO).
    """
    collector = GpuCollector.open(nvml)
    if collector is not None:
        registry.register(collector)
    return collector
