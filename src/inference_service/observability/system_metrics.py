"""TorchServe's system metrics (host CPU, memory, disk and GPUs), read at scrape time.

Same gauge names, units and labels as TorchServe's ``ts/metrics/metric_collector.py``
(``Level="Host"``, ``Hostname``, GPUs ``DeviceId``), but read when Prometheus scrapes: no
background thread, no child process. "Megabytes"/"Gigabytes" are TorchServe's names for
bytes / 1024² and / 1024³. GPU gauges come from ``nvidia-smi``; CPU and memory need ``/proc``.
A scrape never fails here: what cannot be read is left out and logged once.
See docs/observability.md.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily, Metric

log = logging.getLogger(__name__)

MIB = 1024 * 1024
GIB = 1024 * MIB
LEVEL = "Host"  #: the ``Level`` label of every system metric (TorchServe's)
NVIDIA_SMI_TIMEOUT_S = 5.0

#: ``(name, unit, help)`` of the host gauges, labels ``Level``, ``Hostname``.
HOST_GAUGES = (
    ("CPUUtilization", "Percent", "CPU utilization on host since the previous scrape"),
    ("MemoryUsed", "Megabytes", "Memory used on host (total - available)"),
    ("MemoryAvailable", "Megabytes", "Memory available on host"),
    ("MemoryUtilization", "Percent", "Memory utilization on host"),
    ("DiskUsage", "Gigabytes", "Disk used on host"),
    ("DiskUtilization", "Percent", "Disk utilization on host"),
    ("DiskAvailable", "Gigabytes", "Disk available on host"),
)
#: ``(name, unit, help)`` of the per-GPU gauges, labels ``Level``, ``DeviceId``, ``Hostname``.
GPU_GAUGES = (
    ("GPUMemoryUtilization", "Percent", "GPU memory utilization on host, per DeviceId"),
    ("GPUMemoryUsed", "Megabytes", "GPU memory used on host, per DeviceId"),
    ("GPUUtilization", "Percent", "GPU utilization on host, per DeviceId"),
)
HOST_LABELS = ("Level", "Hostname")
GPU_LABELS = ("Level", "DeviceId", "Hostname")
_UNITS = {"Percent": "Percent", "Megabytes": "Megabytes (MiB, bytes / 1024^2)",
          "Gigabytes": "Gigabytes (GiB, bytes / 1024^3)"}


@dataclass(frozen=True)
class CpuTimes:
    """One reading of ``/proc/stat``'s ``cpu`` line, in clock ticks: ``busy`` neither idle nor iowait;
    ``total`` all (guest time is part of user time, so not counted twice)."""

    busy: int
    total: int


@dataclass(frozen=True)
class MemoryInfo:
    """Host memory from ``/proc/meminfo``, in bytes (``available``: MemAvailable)."""

    total: int
    available: int


@dataclass(frozen=True)
class GpuSample:
    """One GPU as ``nvidia-smi`` reports it (percent; memory in MiB; ``None``: not reported)."""

    index: str
    utilization: float | None
    memory_used: float | None
    memory_total: float | None


def read_cpu_times(path: Path = Path("/proc/stat")) -> CpuTimes | None:
    """The aggregate CPU times of ``path`` (``None`` when it cannot be read or parsed)."""
    try:
        with open(path, encoding="ascii") as f:
            first = f.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu" or len(first) < 5:
        return None
    try:
        ticks = [int(v) for v in first[1:]]
    except ValueError:
        return None
    # user nice system idle iowait irq softirq steal guest guest_nice (later fields may be missing)
    total = sum(ticks[:8])
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return CpuTimes(busy=total - idle, total=total)


def read_memory(path: Path = Path("/proc/meminfo")) -> MemoryInfo | None:
    """Total and available memory from ``path`` (``None`` when it cannot be read or parsed)."""
    fields: dict[str, int] = {}
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    fields[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except (OSError, ValueError):
        return None
    total = fields.get("MemTotal")
    if not total:
        return None
    available = fields.get("MemAvailable")
    if available is None:  # kernels before 3.14
        available = fields.get("MemFree", 0) + fields.get("Buffers", 0) + fields.get("Cached", 0)
    return MemoryInfo(total=total, available=min(available, total))


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def query_nvidia_smi(timeout: float = NVIDIA_SMI_TIMEOUT_S) -> list[GpuSample]:
    """Every GPU ``nvidia-smi`` lists; empty when it is not on ``PATH`` (nothing is run then).

    Raises:
        OSError: ``nvidia-smi`` could not be run, timed out (``timeout`` s) or failed.
    """
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,utilization.gpu,memory.used,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise OSError(f"nvidia-smi did not answer within {timeout:g} s") from exc
    if out.returncode != 0:
        raise OSError(f"nvidia-smi exited with {out.returncode}: {out.stderr.strip()[:200]}")
    gpus = []
    for line in out.stdout.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4 or not fields[0].isdigit():
            continue
        gpus.append(GpuSample(fields[0], _number(fields[1]), _number(fields[2]), _number(fields[3])))
    return gpus


def _help(text: str, unit: str) -> str:
    return f"{text}; unit: {_UNITS[unit]}"


def _percent(part: float, whole: float) -> float:
    return min(100.0, max(0.0, part / whole * 100.0)) if whole > 0 else 0.0


class CpuUtilization:
    """CPU utilization between two readings of ``/proc/stat`` (psutil's ``cpu_percent(interval=None)``);
    the first interval starts at construction. Thread-safe."""

    def __init__(self, read: Callable[[], CpuTimes | None] = read_cpu_times) -> None:
        self._read = read
        self._lock = threading.Lock()
        self._last = read()
        self._value: float | None = None

    def percent(self) -> float | None:
        """Busy percent (0 to 100) since the previous call; ``None`` when ``/proc/stat`` cannot be read or
        before a first interval; within one clock tick, the previous answer."""
        now = self._read()
        if now is None:
            return None
        with self._lock:
            last = self._last
            if last is None or now.total > last.total:
                self._last = now
            if last is not None and now.total > last.total:
                self._value = _percent(now.busy - last.busy, now.total - last.total)
            return self._value


class SystemMetricsCollector:
    """``prometheus_client`` collector of TorchServe's system metrics, e.g.
    ``registry.register(SystemMetricsCollector("myhost"))``. ``disk_path``: a path on the measured
    file system (``/``, as TorchServe); ``gpus``: lists the GPUs, may raise ``OSError``; ``None``: no
    GPU gauges, nothing queried (TorchServe's ``number_of_gpu=0``)."""

    def __init__(self, hostname: str, disk_path: str | Path = "/",
                 meminfo: Callable[[], MemoryInfo | None] = read_memory,
                 cpu: CpuUtilization | None = None,
                 gpus: Callable[[], list[GpuSample]] | None = query_nvidia_smi) -> None:
        self.hostname = hostname
        self.disk_path = disk_path
        self._meminfo = meminfo
        self._cpu = cpu if cpu is not None else CpuUtilization()
        self._gpus = gpus
        self._warned: set[str] = set()

    def _warn_once(self, what: str, exc: BaseException) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("system metrics: cannot read %s (%s); left out of /metrics", what, exc)
        else:
            log.debug("system metrics: cannot read %s (%s)", what, exc)

    def describe(self) -> Iterator[Metric]:
        """Every family :meth:`collect` may yield, GPU ones included (unless ``gpus`` is ``None``),
        without samples."""
        for name, unit, help_text in (*HOST_GAUGES, *(GPU_GAUGES if self._gpus is not None else ())):
            yield GaugeMetricFamily(name, _help(help_text, unit))

    def collect(self) -> Iterator[Metric]:
        """The host gauges with what could be read now, then the GPU gauges if a GPU is listed."""
        host = [LEVEL, self.hostname]
        values: dict[str, float] = {}
        cpu = self._cpu.percent()
        if cpu is not None:
            values["CPUUtilization"] = cpu
        memory = self._meminfo()
        if memory is not None:
            used = memory.total - memory.available
            values["MemoryUsed"] = used / MIB
            values["MemoryAvailable"] = memory.available / MIB
            values["MemoryUtilization"] = _percent(used, memory.total)
        try:
            disk = shutil.disk_usage(self.disk_path)
        except OSError as exc:
            self._warn_once(f"disk usage of {self.disk_path}", exc)
        else:
            values["DiskUsage"] = disk.used / GIB
            values["DiskAvailable"] = disk.free / GIB
            values["DiskUtilization"] = _percent(disk.used, disk.used + disk.free)
        for name, unit, help_text in HOST_GAUGES:
            family = GaugeMetricFamily(name, _help(help_text, unit), labels=HOST_LABELS)
            if name in values:
                family.add_metric(host, values[name])
            yield family
        if self._gpus is None:
            return
        try:
            gpus = self._gpus()
        except OSError as exc:
            self._warn_once("GPUs", exc)
            return
        if not gpus:
            return
        gauges = {name: GaugeMetricFamily(name, _help(help_text, unit), labels=GPU_LABELS)
                  for name, unit, help_text in GPU_GAUGES}
        for gpu in gpus:
            labels = [LEVEL, gpu.index, self.hostname]
            if gpu.memory_used is not None and gpu.memory_total:
                gauges["GPUMemoryUtilization"].add_metric(labels, _percent(gpu.memory_used, gpu.memory_total))
            if gpu.memory_used is not None:
                gauges["GPUMemoryUsed"].add_metric(labels, gpu.memory_used)
            if gpu.utilization is not None:
                gauges["GPUUtilization"].add_metric(labels, gpu.utilization)
        yield from gauges.values()
