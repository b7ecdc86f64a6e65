"""TorchServe's system metrics on a real server's /metrics: names, labels, sane values, GPUs only with one."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import urllib.request
from pathlib import Path

from test_metrics import scrape

from conftest import ServerProcess, wait_for
from inference_service.observability.system_metrics import GIB, GPU_GAUGES, HOST_GAUGES

HOST_NAMES = [name for name, _, _ in HOST_GAUGES]
GPU_NAMES = [name for name, _, _ in GPU_GAUGES]
PERCENTS = [name for name, unit, _ in HOST_GAUGES if unit == "Percent"]


def _server(tmp_path: Path, env: dict[str, str] | None = None) -> ServerProcess:
    store = tmp_path / "store"
    store.mkdir()
    return ServerProcess(tmp_path / "work", store, [], env=env)


def _host_values(srv: ServerProcess) -> dict[str, float]:
    """One scrape's system metrics ``{name: value}``; each has exactly one sample, labelled as TorchServe's."""
    samples = scrape(srv)
    found: dict[str, float] = {}
    for (name, labels), value in samples.items():
        if name in HOST_NAMES:
            assert name not in found, name
            assert dict(labels) == {"Level": "Host", "Hostname": socket.gethostname()}, (name, labels)
            found[name] = value
    return found


def _meminfo_total_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def _raw(srv: ServerProcess) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.status['metrics_port']}/metrics", timeout=10) as r:
        return r.read().decode()


def test_system_metrics_have_sane_values_on_every_scrape(tmp_path):
    srv = _server(tmp_path)
    try:
        for _ in range(2):  # the CPU % of the second scrape is measured since the first
            values = wait_for(lambda: (v := _host_values(srv)) and len(v) == len(HOST_NAMES) and v,
                              10.0, 0.05, "every system metric with a sample")
            for name in PERCENTS:
                assert 0 <= values[name] <= 100, (name, values[name])
            total = _meminfo_total_mib()
            assert values["MemoryUsed"] > 0 and values["MemoryAvailable"] > 0
            assert abs(values["MemoryUsed"] + values["MemoryAvailable"] - total) < 1.0  # MiB, the same reading
            assert abs(values["MemoryUtilization"] - values["MemoryUsed"] / total * 100) < 0.01
            disk = shutil.disk_usage("/")  # TorchServe measures the file system of /
            assert abs(values["DiskUsage"] - disk.used / GIB) < 0.5  # GiB: others may write meanwhile
            assert abs(values["DiskAvailable"] - disk.free / GIB) < 0.5
            assert abs(values["DiskUtilization"] - disk.used / (disk.used + disk.free) * 100) < 1.0
        only = scrape(srv, "?name[]=CPUUtilization&name[]=MemoryUsed")
        assert {name for name, _ in only} == {"CPUUtilization", "MemoryUsed"}
        if shutil.which("nvidia-smi") is None:  # no GPU: not a sample, not even a HELP line
            text = _raw(srv)
            assert not [name for name in GPU_NAMES if name in text]
            assert "system metrics" not in srv.log()  # and nothing failed
    finally:
        assert srv.stop() == 0, srv.log()


def test_gpu_metrics_per_device_when_nvidia_smi_lists_gpus(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"  # two GPUs, the second without utilization figures
    fake.write_text('#!/bin/sh\nif [ "$1" = --list-gpus ]; then\n  echo "GPU 0: Fake (UUID: GPU-a)"\n'
                    '  echo "GPU 1: Fake (UUID: GPU-b)"\nelse\n'
                    "  printf '0, 42, 2048, 8192\\n1, [N/A], [N/A], 8192\\n'\nfi\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    srv = _server(tmp_path, env={"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"})
    try:
        def gpu_values() -> dict[tuple[str, str], float]:
            return {(name, dict(labels)["DeviceId"]): value for (name, labels), value in scrape(srv).items()
                    if name in GPU_NAMES}

        expected = {("GPUUtilization", "0"): 42.0, ("GPUMemoryUsed", "0"): 2048.0, ("GPUMemoryUtilization", "0"): 25.0}
        assert gpu_values() == expected  # GPU 1 reports nothing: no sample
        assert gpu_values() == expected  # read again at the next scrape
        labels = next(dict(ls) for n, ls in scrape(srv) if n == "GPUUtilization")
        assert labels == {"Level": "Host", "DeviceId": "0", "Hostname": socket.gethostname()}
    finally:
        assert srv.stop() == 0, srv.log()
