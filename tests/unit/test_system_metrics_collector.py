"""TorchServe's system metrics: /proc parsing, CPU % between scrapes, GPU gauges only with a GPU."""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from inference_service.observability.metrics import ServerMetrics
from inference_service.observability.system_metrics import (
    GIB,
    GPU_GAUGES,
    HOST_GAUGES,
    MIB,
    CpuTimes,
    CpuUtilization,
    GpuSample,
    MemoryInfo,
    SystemMetricsCollector,
    query_nvidia_smi,
    read_cpu_times,
    read_memory,
)

GPU_NAMES = {name for name, _, _ in GPU_GAUGES}
HOST_NAMES = {name for name, _, _ in HOST_GAUGES}


def samples(collector: SystemMetricsCollector) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``{family name: [(labels, value)]}`` of one collect()."""
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in collector.collect()}


def test_read_cpu_times_and_memory(tmp_path):
    proc_stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice: guest is inside user, not counted again
    proc_stat.write_text("cpu  100 10 50 800 40 0 0 0 30 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    assert read_cpu_times(proc_stat) == CpuTimes(busy=160, total=1000)
    proc_stat.write_text("cpu  1 2 3 4\n")  # old kernels: four fields
    assert read_cpu_times(proc_stat) == CpuTimes(busy=6, total=10)
    for bad in ("", "intr 1 2 3\n", "cpu x y z w\n"):
        proc_stat.write_text(bad)
        assert read_cpu_times(proc_stat) is None
    assert read_cpu_times(tmp_path / "missing") is None

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       2048 kB\nMemFree:         512 kB\nMemAvailable:   1024 kB\n"
                       "Buffers:          64 kB\nCached:          128 kB\nHugePages_Total:       0\n")
    assert read_memory(meminfo) == MemoryInfo(total=2048 * 1024, available=1024 * 1024)
    meminfo.write_text("MemTotal: 2048 kB\nMemFree: 512 kB\nBuffers: 64 kB\nCached: 128 kB\n")  # before 3.14
    assert read_memory(meminfo) == MemoryInfo(total=2048 * 1024, available=(512 + 64 + 128) * 1024)
    meminfo.write_text("nothing here\n")
    assert read_memory(meminfo) is None
    assert read_memory(tmp_path / "missing") is None


def test_cpu_percent_is_measured_between_calls():
    readings = iter([CpuTimes(0, 1000), CpuTimes(250, 2000), CpuTimes(250, 2000), CpuTimes(1250, 3000), None])
    cpu = CpuUtilization(lambda: next(readings))   # the first reading is taken at construction
    assert cpu.percent() == 25.0                   # 250 busy of 1000 ticks since then
    assert cpu.percent() == 25.0                   # no tick since: the previous answer
    assert cpu.percent() == 100.0                  # 1000 of 1000
    assert cpu.percent() is None                   # unreadable

    first = iter([None, CpuTimes(0, 100), CpuTimes(0, 100), CpuTimes(50, 200)])
    cpu = CpuUtilization(lambda: next(first))
    assert cpu.percent() is None                   # nothing to compare with yet
    assert cpu.percent() is None                   # still no interval
    assert cpu.percent() == 50.0


def test_real_proc_readings_are_sane():
    times = read_cpu_times()
    memory = read_memory()
    assert times is not None and 0 <= times.busy <= times.total
    assert memory is not None and 0 < memory.available <= memory.total


def test_collector_values_units_and_labels(tmp_path):
    memory = MemoryInfo(total=8192 * MIB, available=6144 * MIB)
    readings = iter([CpuTimes(0, 100), CpuTimes(30, 200)])
    collector = SystemMetricsCollector("h", disk_path=tmp_path, meminfo=lambda: memory,
                                       cpu=CpuUtilization(lambda: next(readings)), gpus=list)
    got = samples(collector)
    disk = shutil.disk_usage(tmp_path)
    host = {"Level": "Host", "Hostname": "h"}
    assert set(got) == HOST_NAMES  # no GPU: no GPU family at all

    def one(name: str) -> float:
        [(labels, value)] = got[name]
        assert labels == host
        return value

    assert one("CPUUtilization") == 30.0
    assert one("MemoryUsed") == 2048.0 and one("MemoryAvailable") == 6144.0
    assert one("MemoryUtilization") == 25.0
    # the disk was read now; another process may write meanwhile, so a MiB of slack
    assert abs(one("DiskUsage") - disk.used / GIB) < 1 / 1024
    assert abs(one("DiskAvailable") - disk.free / GIB) < 1 / 1024
    assert abs(one("DiskUtilization") - disk.used / (disk.used + disk.free) * 100) < 0.01


def test_unreadable_sources_leave_samples_out_and_warn_once(tmp_path, caplog):
    def no_gpu_tool() -> list[GpuSample]:
        raise OSError("nvidia-smi exited with 9")

    collector = SystemMetricsCollector("h", disk_path=tmp_path / "gone", meminfo=lambda: None,
                                       cpu=CpuUtilization(lambda: None), gpus=no_gpu_tool)
    with caplog.at_level(logging.DEBUG, logger="inference_service.observability.system_metrics"):
        for _ in range(3):
            got = samples(collector)
            assert set(got) == HOST_NAMES and not any(got.values())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings  # the disk and the GPUs, once each
    assert any("nvidia-smi exited with 9" in w for w in warnings)


def test_gpu_gauges_per_device(tmp_path):
    gpus = [GpuSample("0", 37.0, 1024.0, 4096.0), GpuSample("1", None, None, None)]
    collector = SystemMetricsCollector("h", disk_path=tmp_path, gpus=lambda: gpus)
    got = samples(collector)
    assert set(got) == HOST_NAMES | GPU_NAMES
    dev0 = {"Level": "Host", "DeviceId": "0", "Hostname": "h"}
    assert got["GPUUtilization"] == [(dev0, 37.0)]       # a GPU that reports nothing has no sample
    assert got["GPUMemoryUsed"] == [(dev0, 1024.0)]
    assert got["GPUMemoryUtilization"] == [(dev0, 25.0)]


def _fake_nvidia_smi(directory: Path, script: str) -> None:
    exe = directory / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)


def test_query_nvidia_smi(tmp_path, monkeypatch):
    sleep = shutil.which("sleep")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert query_nvidia_smi() == []  # not installed: no GPU, nothing run
    _fake_nvidia_smi(tmp_path, f'echo "$@" > "{tmp_path}/args"\n'
                               "printf '0, 12, 300, 81559\\n1, [N/A], [N/A], 81559\\nnoise\\n'\n")
    assert query_nvidia_smi() == [GpuSample("0", 12.0, 300.0, 81559.0), GpuSample("1", None, None, 81559.0)]
    assert (tmp_path / "args").read_text().split() == [
        "--query-gpu=index,utilization.gpu,memory.used,memory.total", "--format=csv,noheader,nounits"]
    _fake_nvidia_smi(tmp_path, "echo 'NVIDIA-SMI has failed' >&2; exit 9\n")
    with pytest.raises(OSError, match="exited with 9: NVIDIA-SMI has failed"):
        query_nvidia_smi()
    _fake_nvidia_smi(tmp_path, f"exec {sleep} 5\n")  # killed at the timeout
    with pytest.raises(OSError, match="did not answer"):
        query_nvidia_smi(timeout=0.2)


def test_server_metrics_expose_system_metrics_and_reserve_their_names(caplog, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi here: no GPU families
    m = ServerMetrics(hostname="h")
    text = m.render().decode()
    for name in HOST_NAMES:
        assert f"# TYPE {name} gauge\n" in text
    assert 'DiskUsage{Hostname="h",Level="Host"} ' in text
    assert "# HELP MemoryUsed Memory used on host (total - available); unit: Megabytes" in text
    assert not any(name in text for name in GPU_NAMES)
    only = m.render({"DiskUsage"}).decode()  # (a family without a sample yet is left out of a filtered scrape)
    assert only.count("# TYPE ") == 1 and "# TYPE DiskUsage gauge" in only
    # a handler metric may not take a system metric's name (GPU ones included)
    with caplog.at_level(logging.WARNING, logger="inference_service.observability.metrics"):
        m.handler_metrics("m", "1.0", [("CPUUtilization", "gauge", "Percent", {}, 1.0),
                                       ("GPUUtilization", "gauge", "Percent", {}, 1.0)])
    assert len(caplog.records) == 2
    assert 'CPUUtilization{Hostname="h"}' not in m.render().decode()


def test_collector_in_a_registry_of_its_own(tmp_path):
    registry = CollectorRegistry()
    registry.register(SystemMetricsCollector(os.uname().nodename, disk_path=tmp_path, gpus=list))
    text = generate_latest(registry).decode()
    assert text.count("# TYPE ") == len(HOST_GAUGES)


def test_server_metrics_follow_torchserves_mode_and_gpu_rules(tmp_path, monkeypatch):
    def gpus_listed() -> list:
        raise AssertionError("nvidia-smi must not be queried with number_of_gpu=0")

    monkeypatch.setattr("inference_service.observability.metrics.query_nvidia_smi", gpus_listed)
    off = ServerMetrics(hostname="h", system_metrics=False).render().decode()
    assert not [name for name in (*HOST_NAMES, *GPU_NAMES) if name in off]
    no_gpu = ServerMetrics(hostname="h", number_of_gpu=0).render().decode()
    assert all(f"# TYPE {name} gauge\n" in no_gpu for name in HOST_NAMES)
    assert not [name for name in GPU_NAMES if name in no_gpu]
