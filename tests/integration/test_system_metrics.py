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


def _server(tmp_path: Path, env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> ServerProcess:
    """A server in prometheus mode (TorchServe's system metrics are on /metrics in that mode only)."""
    store = tmp_path / "store"
    store.mkdir()
    return ServerProcess(tmp_path / "work", store, ["--metrics-mode", "prometheus", *args], env=env)


def _fake_nvidia_smi(tmp_path: Path) -> dict[str, str]:
    """An nvidia-smi listing two GPUs (the second without figures), each call noted in ``calls``; the env to run it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls"}\n'
                    'if [ "$1" = --list-gpus ]; then\n  echo "GPU 0: Fake (UUID: GPU-a)"\n'
                    '  echo "GPU 1: Fake (UUID: GPU-b)"\nelse\n'
                    "  printf '0, 42, 2048, 8192\\n1, [N/A], [N/A], 8192\\n'\nfi\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


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
    srv = _server(tmp_path, env=_fake_nvidia_smi(tmp_path))  # two GPUs, the second without utilization figures
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


def test_torchserve_rules_metrics_mode_and_number_of_gpu(tmp_path):
    """As TorchServe: no system metric on /metrics outside prometheus mode; no GPU metric (and no
    nvidia-smi call) with number_of_gpu=0, whatever the machine has."""
    env = _fake_nvidia_smi(tmp_path)
    config = tmp_path / "config.properties"
    config.write_text("number_of_gpu=0\n")
    srv = _server(tmp_path, env=env, args=("--ts-config", str(config)))
    try:
        names = {name for name, _ in scrape(srv)}
        assert set(HOST_NAMES) <= names and not names & set(GPU_NAMES)
        assert not (tmp_path / "calls").exists()  # nvidia-smi was never run
    finally:
        assert srv.stop() == 0, srv.log()
    store = tmp_path / "store2"
    store.mkdir()
    for mode in ("log", "legacy"):
        plain = ServerProcess(tmp_path / f"work-{mode}", store, ["--metrics-mode", mode], env=env)
        try:
            text = _raw(plain)
            assert "ts_inference_requests_total" in text  # the frontend counters stay
            assert not [name for name in (*HOST_NAMES, *GPU_NAMES) if name in text], mode
        finally:
            assert plain.stop() == 0, plain.log()
