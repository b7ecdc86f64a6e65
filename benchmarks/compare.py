#!/usr/bin/env python3
"""Side-by-side benchmark: this project vs TorchServe 0.12.0 vs a bare grpc.aio server (issue 9).

One command starts each server itself, in turn, in a temporary working directory on free
ports, and runs the same client load (grpc.aio, this project's generated stubs) against it:

- (f) cold start: seconds from spawning the server to the first successful Predictions of
  the echo model (1 worker, from the archive's model-config.yaml);
- (g) idle memory: RSS in MiB of the server (every non-worker process of its process tree:
  for TorchServe the ``torchserve`` launcher and the JVM) and of the one echo worker;
- warm-up: ``--warmup`` seconds of unary load (TorchServe's JVM gets ``--ts-warmup``, 60 s);
- (a) unary Predictions of the echo handler, 64-byte payload, concurrency 1, 8 and 32:
  req/s and p50/p90/p99 latency in ms;
- (b) dynamic batching: the echo archive registered again with batch_size=8,
  max_batch_delay=5 ms, 1 worker, under concurrency 32;
- (c) StreamPredictions of benchmarks/handlers/stream_handler.py (N=1000 messages, no
  compute): messages/s and time to first message of one stream, and messages/s of 4
  concurrent streams;
- (e) RegisterModel (synchronous, 1 worker) of the echo archive: ms (median of 3 in a full
  run), each followed by UnregisterModel;
- (d), with ``--llm`` only: benchmarks/llm_bench.py (the real SmolLM2 streaming 64 tokens,
  this project against generating in-process; TorchServe cannot load this project's LLM handler).

For every load scenario the server's CPU time (user+sys of the server and all its child
processes, via psutil, sampled before and after a fixed number of requests/messages) is
reported per request or per message in µs, and the client's own CPU share (its process CPU
seconds / wall seconds, 1.0 = one core). The bare server has no workers, no models and no
management API: its rows (b) and (e) are empty and it answers every model name.

Prints one table (absolute numbers: this machine's) with ratios project/TorchServe and
project/bare, then one JSON line per server and scenario and one with the ratios.

``--smoke`` runs in seconds with tiny amounts of work and never starts TorchServe (for CI);
without it TorchServe must be installed by benchmarks/setup_torchserve.sh.

Usage: .venv/bin/python benchmarks/compare.py [--smoke] [--servers project,torchserve,bare] [--llm]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
HANDLERS = BENCH / "handlers"
TS_VENV = BENCH / ".venv-torchserve"
sys.path.insert(0, str(ROOT / "src"))

from inference_service._proto import (  # noqa: E402
    inference_pb2,
    inference_pb2_grpc,
    management_pb2,
    management_pb2_grpc,
)

PAYLOAD = b"x" * 64
WORKER_MARKERS = ("inference_service.worker", "model_service_worker")


@dataclass
class Work:
    """Amounts of work of one run (full or ``--smoke``)."""

    unary_requests: int
    batch_requests: int
    stream_messages: int
    single_streams: int
    concurrent_rounds: int
    registers: int
    warmup_s: float
    ts_warmup_s: float


FULL = Work(unary_requests=3000, batch_requests=3000, stream_messages=1000, single_streams=20,
            concurrent_rounds=6, registers=3, warmup_s=5.0, ts_warmup_s=60.0)
SMOKE = Work(unary_requests=60, batch_requests=64, stream_messages=100, single_streams=1,
             concurrent_rounds=1, registers=1, warmup_s=0.3, ts_warmup_s=0.0)


@dataclass
class Server:
    """A started server: its process (group leader), ports and request metadata."""

    name: str
    proc: subprocess.Popen[bytes]
    workdir: Path
    inference_port: int
    management_port: int | None = None
    metadata: tuple[tuple[str, str], ...] = ()
    management_metadata: tuple[tuple[str, str], ...] = ()
    started_at: float = 0.0
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
        self.proc.wait(10)


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (TorchServe takes no port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_archives(store: Path, archiver: Path) -> None:
    """Archive benchmarks/handlers with torch-model-archiver 0.12.0 into ``store`` (echo.mar, stream.mar)."""
    store.mkdir(parents=True, exist_ok=True)
    for name, handler in (("echo", "echo_handler.py"), ("stream", "stream_handler.py")):
        subprocess.run([str(archiver), "--model-name", name, "--version", "1.0", "--handler", str(HANDLERS / handler),
                        "--config-file", str(HANDLERS / "model-config.yaml"), "--export-path", str(store), "--force"],
                       check=True, capture_output=True, timeout=120)


def wait_for(path: Path, proc: subprocess.Popen[bytes], deadline: float) -> dict[str, Any]:
    """Poll a JSON file written by a starting server; SystemExit if the process dies or the deadline passes."""
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


def start_project(store: Path, workdir: Path) -> Server:
    """This project, echo model loaded at startup, token authorization on (keys from key_file.json)."""
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - lives as long as the server
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "inference_service", "--foreground", "--ncs",
                             "--model-store", str(store), "--models", "echo=echo.mar", "--enable-model-api",
                             "--grpc-inference-port", "0", "--grpc-management-port", "0",
                             "--http-port", "0", "--http-management-port", "0", "--metrics-port", "0"],
                            cwd=workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    info = wait_for(workdir / ".inference_service" / "status.json", proc, time.monotonic() + 120)
    keys = json.loads((workdir / "key_file.json").read_text())
    return Server("project", proc, workdir, int(info["inference_port"]), int(info["management_port"]),
                  (("authorization", f"Bearer {keys['inference']['key']}"),),
                  (("authorization", f"Bearer {keys['management']['key']}"),), started)


def start_torchserve(store: Path, workdir: Path) -> Server:
    """TorchServe 0.12.0 from benchmarks/.venv-torchserve, gRPC on free ports, token authorization off."""
    if not (TS_VENV / "bin" / "torchserve").exists():
        raise SystemExit("TorchServe is not installed: run benchmarks/setup_torchserve.sh")
    grpc_port, grpc_mgmt = free_port(), free_port()
    (workdir / "config.properties").write_text("\n".join([
        f"inference_address=http://127.0.0.1:{free_port()}",
        f"management_address=http://127.0.0.1:{free_port()}",
        f"metrics_address=http://127.0.0.1:{free_port()}",
        f"grpc_inference_port={grpc_port}",
        f"grpc_management_port={grpc_mgmt}",
        "grpc_inference_address=127.0.0.1",
        "grpc_management_address=127.0.0.1",
        "disable_token_authorization=true",
        "enable_model_api=true",
        "default_workers_per_model=1",
        "install_py_dep_per_model=false",
        f"model_store={store}",
        "load_models=echo=echo.mar",
        "",
    ]))
    env = dict(os.environ, PATH=f"{TS_VENV / 'bin'}:{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(TS_VENV))
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - lives as long as the server
    started = time.perf_counter()
    proc = subprocess.Popen([str(TS_VENV / "bin" / "torchserve"), "--start", "--foreground", "--ncs",
                             "--model-store", str(store), "--ts-config", str(workdir / "config.properties")],
                            cwd=workdir, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Server("torchserve", proc, workdir, grpc_port, grpc_mgmt, started_at=started)


def start_bare(workdir: Path, uvloop: bool = False) -> Server:
    """benchmarks/bare_server.py in its own process (on uvloop: server ``bare_uvloop``)."""
    port_file = workdir / "port.json"
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(BENCH / "bare_server.py"), "--port-file", str(port_file),
                             *(["--uvloop"] if uvloop else [])],
                            cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    info = wait_for(port_file, proc, time.monotonic() + 60)
    return Server("bare_uvloop" if uvloop else "bare", proc, workdir, int(info["inference_port"]), started_at=started)


def start_server(name: str, store: Path, workdir: Path) -> Server:
    """Start the server ``name`` (project, torchserve, bare or bare_uvloop) in ``workdir``."""
    if name == "project":
        return start_project(store, workdir)
    if name == "torchserve":
        return start_torchserve(store, workdir)
    if name in ("bare", "bare_uvloop"):
        return start_bare(workdir, uvloop=name == "bare_uvloop")
    raise SystemExit(f"unknown server {name!r}: project, torchserve, bare or bare_uvloop")


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


def pct(values: list[float], q: int) -> float:
    """The q-th percentile (1..99) in the same unit as ``values``."""
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100)[q - 1]


async def wait_serving(server: Server, stub: Any, deadline_s: float = 180.0) -> float:
    """Seconds since the server was spawned until a Predictions of ``echo`` succeeds (cold start)."""
    request = inference_pb2.PredictionsRequest(model_name="echo", input={"data": PAYLOAD})
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            await stub.Predictions(request, metadata=server.metadata, timeout=5)
            return time.perf_counter() - server.started_at
        except grpc.aio.AioRpcError as err:
            if time.monotonic() > deadline or server.proc.poll() is not None:
                where = f"{server.workdir}/server.log or logs/"
                raise SystemExit(f"{server.name}: echo model not serving; see {where}") from err
            await asyncio.sleep(0.02)


async def unary(server: Server, stub: Any, model: str, concurrency: int, total: int) -> dict[str, Any]:
    """``total`` Predictions from ``concurrency`` concurrent callers: req/s, latency percentiles, CPU."""
    request = inference_pb2.PredictionsRequest(model_name=model, input={"data": PAYLOAD})
    latencies: list[float] = []
    errors: dict[str, int] = {}
    remaining = [total]

    async def caller() -> None:
        while remaining[0] > 0:
            remaining[0] -= 1
            t0 = time.perf_counter()
            try:
                reply = await stub.Predictions(request, metadata=server.metadata, timeout=60)
                assert reply.prediction == PAYLOAD, reply.prediction[:80]
                latencies.append((time.perf_counter() - t0) * 1000)
            except grpc.aio.AioRpcError as err:
                errors[err.code().name] = errors.get(err.code().name, 0) + 1

    meter = Meter(server.proc.pid)
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    result = meter.done(total, "req")
    result.update({"requests": total, "concurrency": concurrency, "errors": errors,
                   "req_per_s": round(len(latencies) / result["wall_s"], 1),
                   "p50_ms": round(pct(latencies, 50), 2), "p90_ms": round(pct(latencies, 90), 2),
                   "p99_ms": round(pct(latencies, 99), 2)})
    return result


async def warm(server: Server, stub: Any, seconds: float) -> int:
    """Unary load at concurrency 8 for ``seconds`` (JIT/JVM warm-up); returns the request count."""
    request = inference_pb2.PredictionsRequest(model_name="echo", input={"data": PAYLOAD})
    end = time.monotonic() + seconds
    count = [0]

    async def caller() -> None:
        while time.monotonic() < end:
            await stub.Predictions(request, metadata=server.metadata, timeout=60)
            count[0] += 1

    await asyncio.gather(*(caller() for _ in range(8)))
    return count[0]


async def one_stream(server: Server, stub: Any, messages: int) -> tuple[float, int]:
    """One StreamPredictions of ``messages`` messages: (seconds to first message, messages received)."""
    request = inference_pb2.PredictionsRequest(model_name="stream", input={"data": str(messages).encode()})
    t0 = time.perf_counter()
    first, count = None, 0
    async for _ in stub.StreamPredictions(request, metadata=server.metadata, timeout=120):
        if first is None:
            first = time.perf_counter() - t0
        count += 1
    return (first if first is not None else float("nan")), count


async def streaming(server: Server, stub: Any, work: Work) -> dict[str, Any]:
    """(c): single streams (msg/s, TTFT) then rounds of 4 concurrent streams (aggregate msg/s)."""
    n = work.stream_messages
    ttfts, rates, received = [], [], 0
    meter = Meter(server.proc.pid)
    for _ in range(work.single_streams):
        t0 = time.perf_counter()
        ttft, count = await one_stream(server, stub, n)
        rates.append(count / (time.perf_counter() - t0))
        ttfts.append(ttft * 1000)
        received += count
    single = meter.done(received, "msg")
    meter, received4 = Meter(server.proc.pid), 0
    for _ in range(work.concurrent_rounds):
        for _ttft, count in await asyncio.gather(*(one_stream(server, stub, n) for _ in range(4))):
            received4 += count
    four = meter.done(received4, "msg")
    expected = n * (work.single_streams + 4 * work.concurrent_rounds)
    return {"messages_per_stream": n, "complete": received + received4 == expected,
            "msg_per_s": round(statistics.median(rates), 1), "ttft_ms": round(statistics.median(ttfts), 2),
            "server_cpu_us_per_msg": single["server_cpu_us_per_msg"], "client_cpu_share": single["client_cpu_share"],
            "msg_per_s_4_streams": round(received4 / four["wall_s"], 1),
            "server_cpu_us_per_msg_4_streams": four["server_cpu_us_per_msg"],
            "client_cpu_share_4_streams": four["client_cpu_share"]}


async def register(server: Server, mgmt: Any, name: str, **kwargs: Any) -> float:
    """Synchronous RegisterModel of echo.mar (or ``url=``) with 1 worker; returns ms."""
    request = management_pb2.RegisterModelRequest(model_name=name, url=kwargs.pop("url", "echo.mar"),
                                                  initial_workers=1, synchronous=True, **kwargs)
    t0 = time.perf_counter()
    await mgmt.RegisterModel(request, metadata=server.management_metadata, timeout=180)
    return (time.perf_counter() - t0) * 1000


async def register_stream(server: Server) -> None:
    """Register stream.mar as model ``stream`` (1 worker), on servers with a management API."""
    if server.management_port is None:
        return
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.management_port}") as channel:
        await register(server, management_pb2_grpc.ManagementAPIsServiceStub(channel), "stream", url="stream.mar")


async def bench_server(server: Server, work: Work, scenarios: str = "abcde") -> list[dict[str, Any]]:
    """The ``scenarios`` (letters of a, b, c, e; (f) and (g) always run) against one started
    server; one result dict per scenario."""
    results: list[dict[str, Any]] = []

    def add(scenario: str, **values: Any) -> None:
        results.append({"server": server.name, "scenario": scenario, **values})

    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.inference_port}") as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        add("f_cold_start", cold_start_s=round(await wait_serving(server, stub), 3))
        await asyncio.sleep(1.0)  # idle
        add("g_idle_memory", **memory_mib(server.proc.pid))
        mgmt = None
        if server.management_port is not None:
            mchannel = grpc.aio.insecure_channel(f"127.0.0.1:{server.management_port}")
            mgmt = management_pb2_grpc.ManagementAPIsServiceStub(mchannel)
            times = []
            for i in range(work.registers if "e" in scenarios else 0):
                times.append(await register(server, mgmt, f"echo_reg{i}"))
                await mgmt.UnregisterModel(management_pb2.UnregisterModelRequest(model_name=f"echo_reg{i}"),
                                           metadata=server.management_metadata, timeout=60)
            if times:
                add("e_register", register_ms=round(statistics.median(times), 1), runs=len(times))
            await register(server, mgmt, "stream", url="stream.mar")
            await register(server, mgmt, "echo_b8", batch_size=8, max_batch_delay=5)
        warm_s = work.ts_warmup_s if server.name == "torchserve" else work.warmup_s
        add("warmup", seconds=warm_s, requests=await warm(server, stub, warm_s))
        for concurrency in (1, 8, 32) if "a" in scenarios else ():
            add(f"a_unary_c{concurrency}", **await unary(server, stub, "echo", concurrency, work.unary_requests))
        if mgmt is not None and "b" in scenarios:
            add("b_batch8_c32", **await unary(server, stub, "echo_b8", 32, work.batch_requests))
        if "c" in scenarios:
            add("c_stream", **await streaming(server, stub, work))
        if mgmt is not None:
            await mchannel.close()
    return results


ROWS = [  # (scenario, metric, label, higher is better)
    ("f_cold_start", "cold_start_s", "(f) cold start to SERVING, s", False),
    ("g_idle_memory", "server_rss_mib", "(g) idle RSS server, MiB", False),
    ("g_idle_memory", "worker_rss_mib", "(g) idle RSS echo worker, MiB", False),
    ("e_register", "register_ms", "(e) RegisterModel sync 1 worker, ms", False),
    *[row for c in (1, 8, 32) for row in (
        (f"a_unary_c{c}", "req_per_s", f"(a) unary c={c} req/s", True),
        (f"a_unary_c{c}", "p50_ms", f"(a) unary c={c} p50 ms", False),
        (f"a_unary_c{c}", "p90_ms", f"(a) unary c={c} p90 ms", False),
        (f"a_unary_c{c}", "p99_ms", f"(a) unary c={c} p99 ms", False),
        (f"a_unary_c{c}", "server_cpu_us_per_req", f"(a) unary c={c} server CPU µs/req", False),
        (f"a_unary_c{c}", "client_cpu_share", f"(a) unary c={c} client CPU share", False))],
    ("b_batch8_c32", "req_per_s", "(b) batch 8/5ms c=32 req/s", True),
    ("b_batch8_c32", "p50_ms", "(b) batch 8/5ms c=32 p50 ms", False),
    ("b_batch8_c32", "p99_ms", "(b) batch 8/5ms c=32 p99 ms", False),
    ("b_batch8_c32", "server_cpu_us_per_req", "(b) batch server CPU µs/req", False),
    ("c_stream", "msg_per_s", "(c) stream 1 msg/s", True),
    ("c_stream", "ttft_ms", "(c) stream time to first msg, ms", False),
    ("c_stream", "server_cpu_us_per_msg", "(c) stream server CPU µs/msg", False),
    ("c_stream", "client_cpu_share", "(c) stream client CPU share", False),
    ("c_stream", "msg_per_s_4_streams", "(c) 4 streams msg/s", True),
    ("c_stream", "server_cpu_us_per_msg_4_streams", "(c) 4 streams server CPU µs/msg", False),
    ("d_llm_stream", "server_tokens_per_s", "(d) LLM 64 tokens streamed, tokens/s", True),
    ("d_llm_stream", "inprocess_tokens_per_s", "(d) LLM in-process tokens/s", True),
    ("d_llm_stream", "server_ttft_s", "(d) LLM time to first token, s", False),
    ("d_llm_stream", "inprocess_ttft_s", "(d) LLM in-process time to first token, s", False),
    ("d_llm_stream", "tokens_per_s_ratio", "(d) LLM tokens/s served / in-process", True),
    ("d_llm_stream", "ttft_ratio", "(d) LLM TTFT served / in-process", False),
]


def llm_scenario(runs: int) -> dict[str, Any]:
    """(d): benchmarks/llm_bench.py (SmolLM2, 64 tokens, this project only); its JSON line."""
    done = subprocess.run([sys.executable, str(BENCH / "llm_bench.py"), "--runs", str(runs), "--max-new-tokens", "64"],
                          check=True, capture_output=True, text=True, timeout=1800)
    line = [text for text in done.stdout.splitlines() if text.startswith("{")][-1]
    return {"server": "project", **json.loads(line), "scenario": "d_llm_stream"}


def table(results: list[dict[str, Any]], servers: list[str]) -> tuple[str, dict[str, dict[str, float]]]:
    """The text table (servers as columns, ratios project/other) and the ratios by label."""
    value = {(r["server"], r["scenario"], m): v for r in results for m, v in r.items()}
    others = [s for s in ("torchserve", "bare", "bare_uvloop") if s in servers and "project" in servers]
    header = ["metric (this machine)", *servers, *[f"project/{o}" for o in others]]
    lines, ratios = [], {}
    for scenario, metric, label, _higher in ROWS:
        cells = [value.get((s, scenario, metric)) for s in servers]
        if all(c is None for c in cells):
            continue
        row = [label, *["-" if c is None else f"{c:g}" for c in cells]]
        mine = value.get(("project", scenario, metric))
        for other in others:
            other_server, _, other_scenario = other.partition(":")
            theirs = value.get((other_server, other_scenario or scenario, metric))
            if isinstance(mine, (int, float)) and isinstance(theirs, (int, float)) and theirs:
                ratio = round(mine / theirs, 2)
                ratios.setdefault(label, {})[f"project/{other}"] = ratio
                row.append(f"{ratio:g}")
            else:
                row.append("-")
        lines.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    text = "\n".join([fmt.format(*header), fmt.format(*["-" * w for w in widths]), *(fmt.format(*r) for r in lines)])
    return text, ratios


def medians(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One result per (server, scenario): the median of each numeric figure over the runs."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for result in results:
        groups.setdefault((result["server"], result["scenario"]), []).append(result)
    out = []
    for (server, scenario), group in groups.items():
        merged: dict[str, Any] = {"server": server, "scenario": scenario, "runs": len(group)}
        for key in group[0]:
            values = [r[key] for r in group if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
            if key not in ("server", "scenario", "run") and len(values) == len(group):
                merged[key] = round(statistics.median(values), 3)
        out.append(merged)
    return out


TARGETS = [  # (label, scenario, metric, other server (or "server:scenario") or None for absolute, bound, op)
    ("(c) stream 1 msg/s >= 0.95x bare", "c_stream", "msg_per_s", "bare", 0.95, ">="),
    ("(c) stream 1 msg/s > TorchServe's", "c_stream", "msg_per_s", "torchserve", 1.0, ">"),
    ("(c) 4 streams msg/s >= 0.8x bare", "c_stream", "msg_per_s_4_streams", "bare", 0.8, ">="),
    ("(c) 4 streams msg/s > TorchServe's", "c_stream", "msg_per_s_4_streams", "torchserve", 1.0, ">"),
    ("(c) stream time to first message <= 2 ms (p50)", "c_stream", "ttft_ms", None, 2.0, "<="),
    ("(c) stream server CPU/msg <= 1.5x bare, 1 stream", "c_stream", "server_cpu_us_per_msg", "bare", 1.5, "<="),
    ("(c) stream server CPU/msg <= 1.5x bare, 4 streams", "c_stream", "server_cpu_us_per_msg_4_streams", "bare",
     1.5, "<="),
    ("(b) batch 8/5ms c=32 req/s >= 0.8x bare unary c=32", "b_batch8_c32", "req_per_s", "bare:a_unary_c32", 0.8,
     ">="),
    ("(b) batch 8/5ms c=32 req/s > TorchServe's", "b_batch8_c32", "req_per_s", "torchserve", 1.0, ">"),
    ("(b) batch 8/5ms c=32 p50 < TorchServe's", "b_batch8_c32", "p50_ms", "torchserve", 1.0, "<"),
    ("(a) unary c=32 req/s >= 0.8x bare", "a_unary_c32", "req_per_s", "bare", 0.8, ">="),
    ("(a) unary c=32 req/s > TorchServe's", "a_unary_c32", "req_per_s", "torchserve", 1.0, ">"),
    ("(a) unary c=1 p50 <= 1.3x bare", "a_unary_c1", "p50_ms", "bare", 1.3, "<="),
    ("(d) LLM tokens/s served >= 0.95x in-process", "d_llm_stream", "tokens_per_s_ratio", None, 0.95, ">="),
    ("(d) LLM TTFT served <= 1.1x in-process", "d_llm_stream", "ttft_ratio", None, 1.1, "<="),
    ("(e) RegisterModel <= 1/3 TorchServe's", "e_register", "register_ms", "torchserve", 1 / 3, "<="),
    ("(f) cold start to SERVING <= 1 s", "f_cold_start", "cold_start_s", None, 1.0, "<="),
    ("(g) idle server RSS <= 1/2 TorchServe's", "g_idle_memory", "server_rss_mib", "torchserve", 0.5, "<="),
]


def check_targets(results: list[dict[str, Any]]) -> str:
    """Issue 17's targets (and issue 9's that were met) against ``results`` (the medians): value,
    bound and met / MISSED per line."""
    value = {(r["server"], r["scenario"], m): v for r in results for m, v in r.items()}
    lines = []
    for label, scenario, metric, other, bound, op in TARGETS:
        mine = value.get(("project", scenario, metric))
        if not isinstance(mine, (int, float)):
            continue
        if other is None:
            got, shown = mine, f"{mine:g}"
        else:
            other_server, _, other_scenario = other.partition(":")
            theirs = value.get((other_server, other_scenario or scenario, metric))
            if not isinstance(theirs, (int, float)) or not theirs:
                continue
            got, shown = mine / theirs, f"{mine:g} / {theirs:g} = {mine / theirs:.2f}x"
        met = {"<=": got <= bound, ">=": got >= bound, "<": got < bound, ">": got > bound}[op]
        lines.append(f"{'met   ' if met else 'MISSED'}  {label}: {shown}")
    return "\n".join(lines)


def main() -> int:
    """Run every server in turn (``--repeat`` times), print the table(s), the targets and the JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="seconds of tiny work; never starts TorchServe")
    parser.add_argument("--servers", default=None, help="comma list of project,torchserve,bare,bare_uvloop")
    parser.add_argument("--llm", action="store_true",
                        help="also (d): benchmarks/llm_bench.py, SmolLM2 streaming 64 tokens (project only, minutes)")
    parser.add_argument("--llm-runs", type=int, default=5, help="alternating (d) runs whose median is reported (5)")
    parser.add_argument("--ts-warmup", type=float, default=None, help="TorchServe JVM warm-up seconds (60)")
    parser.add_argument("--scenarios", default="abcde",
                        help="letters of the load scenarios to run: a (unary), b (batching), c (streams), "
                             "e (register); (f) and (g) always run")
    parser.add_argument("--repeat", type=int, default=1,
                        help="full runs of every server, each run starting with the next server; the table shows "
                             "medians")
    args = parser.parse_args()
    work = SMOKE if args.smoke else FULL
    if args.ts_warmup is not None:
        work = dataclasses.replace(work, ts_warmup_s=args.ts_warmup)
    servers = (args.servers or ("project,bare" if args.smoke else "project,torchserve,bare")).split(",")
    if args.smoke and "torchserve" in servers:
        raise SystemExit("--smoke never starts TorchServe")
    root = Path(tempfile.mkdtemp(prefix="compare-"))
    store = root / "store"
    build_archives(store, Path(sys.executable).parent / "torch-model-archiver")
    results: list[dict[str, Any]] = []
    try:
        for run in range(max(1, args.repeat)):
            # each run starts with a different server: the machine's speed drifts over minutes
            for name in servers[run % len(servers):] + servers[:run % len(servers)]:
                workdir = root / f"{name}-{run}"
                workdir.mkdir()
                server = start_server(name, store, workdir)
                try:
                    results += [{**r, "run": run} for r in asyncio.run(bench_server(server, work, args.scenarios))]
                finally:
                    server.stop()
                print(f"# run {run + 1}: {name} done", file=sys.stderr, flush=True)
        if args.llm:
            try:
                results.append({**llm_scenario(1 if args.smoke else args.llm_runs), "run": 0})
            except subprocess.CalledProcessError as exc:  # keep the load scenarios' figures
                print(f"# (d) llm_bench.py failed:\n{(exc.stderr or '')[-2000:]}", file=sys.stderr)
    except BaseException:
        print(f"# logs kept in {root}", file=sys.stderr)
        raise
    shutil.rmtree(root, ignore_errors=True)
    runs = max(1, args.repeat)
    if runs > 1:
        for run in range(runs):
            print(f"# run {run + 1} of {runs}")
            print(table([r for r in results if r["run"] == run or r["scenario"] == "d_llm_stream"], servers)[0])
    summary = medians(results)
    text, ratios = table(summary, servers)
    print(f"# {'smoke' if args.smoke else 'full'} run on {os.cpu_count()} CPUs; absolute numbers are this machine's"
          + (f"; median of {runs} runs" if runs > 1 else ""))
    print(text)
    print("# targets (issue 17; issue 9's met ones)"
          + (f", on the medians of {runs} runs" if runs > 1 else ", one run"))
    print(check_targets(summary))
    for result in results:
        print(json.dumps(result))
    print(json.dumps({"scenario": "ratios", "ratios": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
