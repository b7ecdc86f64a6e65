"""compare.py's servers and load scenarios: the echo and stream archives, the project,
TorchServe and bare servers as compare.py starts them, and scenarios (a), (b), (c), (e), (f), (g)
against one started server (see compare.py for what each measures)."""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from common import (
    HANDLERS,
    Meter,
    Server,
    memory_mib,
    percentile,
    register,
    start_bare,
    start_project,
    start_torchserve,
)

from inference_service._proto import inference_pb2, inference_pb2_grpc, management_pb2, management_pb2_grpc

PAYLOAD = b"x" * 64


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


def build_archives(store: Path, archiver: Path) -> None:
    """Archive benchmarks/handlers with torch-model-archiver 0.12.0 into ``store`` (echo.mar, stream.mar)."""
    store.mkdir(parents=True, exist_ok=True)
    for name, handler in (("echo", "echo_handler.py"), ("stream", "stream_handler.py")):
        subprocess.run([str(archiver), "--model-name", name, "--version", "1.0", "--handler", str(HANDLERS / handler),
                        "--config-file", str(HANDLERS / "model-config.yaml"), "--export-path", str(store), "--force"],
                       check=True, capture_output=True, timeout=120)


def start_server(name: str, store: Path, workdir: Path) -> Server:
    """Start the server ``name`` in ``workdir``: ``project`` (echo loaded at startup, model API on,
    token authorization on), ``torchserve`` (echo, model API on, no tokens), ``bare`` or
    ``bare_uvloop`` (benchmarks/bare_server.py, no models, no management API)."""
    if name == "project":
        return start_project("project", store, workdir, ["echo=echo.mar"], extra_args=["--enable-model-api"])
    if name == "torchserve":
        return start_torchserve(store, workdir, "echo=echo.mar", model_api=True)
    if name in ("bare", "bare_uvloop"):
        return start_bare(workdir, uvloop=name == "bare_uvloop")
    raise SystemExit(f"unknown server {name!r}: project, torchserve, bare or bare_uvloop")


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
                   "p50_ms": percentile(latencies, 50, 2), "p90_ms": percentile(latencies, 90, 2),
                   "p99_ms": percentile(latencies, 99, 2)})
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


