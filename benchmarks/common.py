"""The plumbing the benchmarks share: starting and stopping servers, their keys, health and
registration, one streamed call, CPU and memory of a process tree, percentiles and tables.

Importing it puts ``src/`` and ``benchmarks/`` first on ``sys.path``, so a benchmark run as
``.venv/bin/python benchmarks/x.py`` measures the checkout it lives in.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
HANDLERS = BENCH / "handlers"
TS_VENV = BENCH / ".venv-torchserve"
for _path in (str(BENCH), str(ROOT / "src")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from inference_service._proto import inference_pb2, management_pb2  # noqa: E402

#: Words of a worker's command line (this server's, TorchServe's): the rest of a tree is the server.
WORKER_MARKERS = ("inference_service.worker", "model_service_worker")
Metadata = tuple[tuple[str, str], ...]


# --------------------------------------------------------------------------- servers
@dataclass
class Server:
    """A started server: its process (group leader), ports and request metadata."""

    name: str
    proc: subprocess.Popen[bytes]
    workdir: Path
    inference_port: int
    management_port: int | None = None
    metadata: Metadata = ()
    management_metadata: Metadata = ()
    started_at: float = 0.0  #: time.perf_counter() just before the spawn
    http_port: int | None = None
    transport: str = "grpc"  #: how clients call it: grpc, or http (TorchServe's streaming /predictions)
    extra: dict[str, Any] = field(default_factory=dict)

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 30 s."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (TorchServe takes no port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(path: Path, proc: subprocess.Popen[bytes], deadline: float) -> dict[str, Any]:
    """Poll a JSON file written by a starting server until it names an ``inference_port``.

    Raises:
        SystemExit: the process died or ``deadline`` (``time.monotonic()``) passed.
    """
    while time.monotonic() < deadline:
        try:
            info = json.loads(path.read_text())
            if info.get("inference_port"):
                return info
        except (OSError, ValueError):
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    raise SystemExit(f"server did not start; see {path.parent}")


def auth_metadata(workdir: Path) -> tuple[Metadata, Metadata]:
    """``authorization: Bearer <key>`` of the inference and the management key in ``workdir/key_file.json``."""
    keys = json.loads((workdir / "key_file.json").read_text())
    return ((("authorization", f"Bearer {keys['inference']['key']}"),),
            (("authorization", f"Bearer {keys['management']['key']}"),))


def start_project(name: str, store: Path, workdir: Path, models: Sequence[str], *, extra_args: Sequence[str] = (),
                  env: dict[str, str] | None = None, startup_s: float = 120) -> Server:
    """This server in the foreground in ``workdir`` (``--ncs``, every port 0, token authorization on).

    Returns once ``status.json`` names its ports (the models may still be loading). Its output
    goes to ``workdir/server.log``.

    Raises:
        SystemExit: it exited or wrote no ports within ``startup_s`` seconds (it is killed).
    """
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - lives as long as the server
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "inference_service", "--foreground", "--ncs",
                             "--model-store", str(store), "--models", *models, *extra_args,
                             "--grpc-inference-port", "0", "--grpc-management-port", "0",
                             "--http-port", "0", "--http-management-port", "0", "--metrics-port", "0"],
                            cwd=workdir, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        info = wait_for(workdir / ".inference_service" / "status.json", proc, time.monotonic() + startup_s)
        metadata, management_metadata = auth_metadata(workdir)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        raise
    return Server(name, proc, workdir, int(info["inference_port"]), int(info["management_port"]),
                  metadata, management_metadata, started, http_port=info.get("http_port"))


def start_torchserve(store: Path, workdir: Path, load_models: str, *, model_api: bool = False,
                     env: dict[str, str] | None = None, transport: str = "grpc") -> Server:
    """TorchServe 0.12.0 from benchmarks/.venv-torchserve on free ports, token authorization off,
    one worker per model; returns at once (TorchServe writes no status file).

    Raises:
        SystemExit: TorchServe is not installed (benchmarks/setup_torchserve.sh installs it).
    """
    if not (TS_VENV / "bin" / "torchserve").exists():
        raise SystemExit("TorchServe is not installed: run benchmarks/setup_torchserve.sh")
    grpc_port, grpc_mgmt, http_port = free_port(), free_port(), free_port()
    (workdir / "config.properties").write_text("\n".join([
        f"inference_address=http://127.0.0.1:{http_port}",
        f"management_address=http://127.0.0.1:{free_port()}",
        f"metrics_address=http://127.0.0.1:{free_port()}",
        f"grpc_inference_port={grpc_port}",
        f"grpc_management_port={grpc_mgmt}",
        "grpc_inference_address=127.0.0.1",
        "grpc_management_address=127.0.0.1",
        "disable_token_authorization=true",
        *(["enable_model_api=true"] if model_api else []),
        "default_workers_per_model=1",
        "install_py_dep_per_model=false",
        f"model_store={store}",
        f"load_models={load_models}",
        "",
    ]))
    env = dict(env or os.environ, PATH=f"{TS_VENV / 'bin'}:{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(TS_VENV))
    env.pop("PYTHONPATH", None)
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - lives as long as the server
    started = time.perf_counter()
    proc = subprocess.Popen([str(TS_VENV / "bin" / "torchserve"), "--start", "--foreground", "--ncs",
                             "--model-store", str(store), "--ts-config", str(workdir / "config.properties")],
                            cwd=workdir, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Server("torchserve", proc, workdir, grpc_port, grpc_mgmt, started_at=started, http_port=http_port,
                  transport=transport)


def wait_model_serving(port: int, model: str, timeout_s: float) -> None:
    """Until ``grpc.health.v1`` on ``port`` says ``model/<model>`` is SERVING (its worker loaded it).

    Raises:
        SystemExit: not SERVING within ``timeout_s`` seconds.
    """
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(service=f"model/{model}"), timeout=5)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise SystemExit(f"{model} did not become SERVING")


async def register(server: Server, mgmt: Any, name: str, **kwargs: Any) -> float:
    """Synchronous RegisterModel of echo.mar (or ``url=``) with 1 worker; returns ms."""
    request = management_pb2.RegisterModelRequest(model_name=name, url=kwargs.pop("url", "echo.mar"),
                                                  initial_workers=1, synchronous=True, **kwargs)
    t0 = time.perf_counter()
    await mgmt.RegisterModel(request, metadata=server.management_metadata, timeout=180)
    return (time.perf_counter() - t0) * 1000


# --------------------------------------------------------------------------- clients
def stream_once(stub: Any, model: str, body: bytes, metadata: Metadata, timeout_s: float) -> tuple[float, float, bytes]:
    """One blocking StreamPredictions of ``body`` as input ``data``: (seconds to the first message,
    seconds to the end, the last message)."""
    start = time.perf_counter()
    first = None
    last = b""
    request = inference_pb2.PredictionsRequest(model_name=model, input={"data": body})
    for response in stub.StreamPredictions(request, timeout=timeout_s, metadata=metadata):
        if first is None:
            first = time.perf_counter()
        last = response.prediction
    end = time.perf_counter()
    return (first or end) - start, end - start, last


# --------------------------------------------------------------------------- processes
def tree(pid: int) -> list[psutil.Process]:
    """The process and all its live descendants."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def tree_cpu_s(pid: int) -> float:
    """User+sys CPU seconds of the process tree (live processes only)."""
    total = 0.0
    for proc in tree(pid):
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def memory_mib(pid: int) -> dict[str, Any]:
    """RSS in MiB of the server (non-worker processes of the tree) and of its largest worker."""
    server, workers = 0.0, []
    for proc in tree(pid):
        try:
            rss = proc.memory_info().rss / 2**20
            cmdline = " ".join(proc.cmdline())
        except psutil.NoSuchProcess:
            continue
        if any(marker in cmdline for marker in WORKER_MARKERS):
            workers.append(rss)
        else:
            server += rss
    return {"server_rss_mib": round(server, 1), "worker_rss_mib": round(max(workers), 1) if workers else None,
            "workers": len(workers)}


def reset_peak_rss(pid: int) -> bool:
    """Reset VmHWM of ``pid`` to its current RSS (``echo 5 > /proc/<pid>/clear_refs``); False if refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mib(pid: int) -> float | None:
    """VmHWM (peak resident set) of ``pid`` in MiB, None if unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


class Meter:
    """Server CPU (process tree), client CPU and wall time over a block of fixed work."""

    def __init__(self, pid: int) -> None:
        """Sample the starting point."""
        self.pid = pid
        self.cpu0 = tree_cpu_s(pid)
        self.client0 = time.process_time()
        self.wall0 = time.perf_counter()

    def done(self, units: int, unit: str) -> dict[str, float]:
        """Wall seconds, server CPU µs per ``unit`` and the client's CPU share (1.0 = one core)."""
        wall = time.perf_counter() - self.wall0
        server = tree_cpu_s(self.pid) - self.cpu0
        client = time.process_time() - self.client0
        return {"wall_s": round(wall, 3), f"server_cpu_us_per_{unit}": round(server / max(units, 1) * 1e6, 1),
                "server_cpu_share": round(server / wall, 2), "client_cpu_share": round(client / wall, 2)}


# --------------------------------------------------------------------------- figures
def pct(values: list[float], q: int) -> float:
    """The q-th percentile (1..99, ``statistics.quantiles``' exclusive method); NaN if empty."""
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100)[q - 1]


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100, linear interpolation between order statistics); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """A text table: the first column left-aligned, the others right-aligned, a dashed rule under the header."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*header), fmt.format(*["-" * w for w in widths]), *(fmt.format(*r) for r in rows)])


def fmt(value: Any, width: int, digits: int) -> str:
    """Right-aligned number with ``digits`` decimals, or ``-`` for None."""
    if value is None:
        return f"{'-':>{width}}"
    return f"{value:>{width}.{digits}f}"
