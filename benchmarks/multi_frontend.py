#!/usr/bin/env python3
"""What more than one frontend process would buy on this machine (issue 17, item 4).

The frontend is one Python thread. One way past that is N frontend processes sharing the
inference port (``SO_REUSEPORT``: the kernel spreads client connections over them), each with
workers of its own. This measures that layout without building it: N independent servers of
the same kind, each with the echo model (1 worker), and one client that spreads its
concurrency over N channels, one to each (as the kernel would spread N connections). For
N = 1 and N = 2 it reports unary Predictions req/s and p50 at concurrency 1 and 32 and the
CPU share of the servers and of the client, for this project and for the bare grpc.aio server.

    .venv/bin/python benchmarks/multi_frontend.py [--frontends 1,2] [--requests 6000] [--runs 3]

Caveat: the client shares the machine's cores with the servers (on 2 cores it takes about
half a core at concurrency 32), so what N frontends can add here is bounded by what is left.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import common  # noqa: E402 - the benchmarks' shared plumbing
import compare_load  # noqa: E402 - compare.py's servers and scenarios

from inference_service._proto import inference_pb2, inference_pb2_grpc  # noqa: E402


async def load(servers: list[common.Server], concurrency: int, total: int) -> dict[str, float]:
    """``total`` echo Predictions from ``concurrency`` callers spread round-robin over the servers."""
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{s.inference_port}") for s in servers]
    stubs = [inference_pb2_grpc.InferenceAPIsServiceStub(c) for c in channels]
    request = inference_pb2.PredictionsRequest(model_name="echo", input={"data": compare_load.PAYLOAD})
    for server, stub in zip(servers, stubs, strict=True):
        await compare_load.wait_serving(server, stub)
        await compare_load.warm(server, stub, 2.0)
    latencies: list[float] = []
    remaining = [total]
    targets = itertools.cycle(range(len(servers)))

    async def caller(index: int) -> None:
        stub, metadata = stubs[index], servers[index].metadata
        while remaining[0] > 0:
            remaining[0] -= 1
            t0 = time.perf_counter()
            reply = await stub.Predictions(request, metadata=metadata, timeout=60)
            assert reply.prediction == compare_load.PAYLOAD
            latencies.append((time.perf_counter() - t0) * 1000)

    cpu0 = sum(common.tree_cpu_s(s.proc.pid) for s in servers)
    client0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(caller(next(targets)) for _ in range(concurrency)))
    wall = time.perf_counter() - wall0
    server_cpu = sum(common.tree_cpu_s(s.proc.pid) for s in servers) - cpu0
    for channel in channels:
        await channel.close()
    return {"req_per_s": len(latencies) / wall, "p50_ms": statistics.median(latencies),
            "server_cpu_share": server_cpu / wall, "client_cpu_share": (time.process_time() - client0) / wall}


def main() -> int:
    """Start N servers of each kind in turn, load them, print one row per (kind, N, concurrency)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frontends", default="1,2", help="comma list of N")
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--runs", type=int, default=3, help="runs whose medians are printed")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="multi-frontend-"))
    store = root / "store"
    compare_load.build_archives(store, Path(sys.executable).parent / "torch-model-archiver")
    rows: dict[tuple[str, int, int], list[dict[str, float]]] = {}
    for run in range(args.runs):
        for kind in ("project", "bare"):
            for n in (int(x) for x in args.frontends.split(",")):
                servers = []
                try:
                    for i in range(n):
                        workdir = root / f"{kind}-{n}-{i}-{run}"
                        workdir.mkdir()
                        servers.append(compare_load.start_server(kind, store, workdir))
                    for concurrency in (1, 32):
                        result = asyncio.run(load(servers, concurrency, args.requests))
                        rows.setdefault((kind, n, concurrency), []).append(result)
                finally:
                    for server in servers:
                        server.stop()
        print(f"# run {run + 1} done", file=sys.stderr, flush=True)
    print(f"# N frontends (each with its own echo worker), {args.requests} requests, median of {args.runs} runs")
    print(f"{'server':8} {'N':>2} {'c':>3} {'req/s':>8} {'p50 ms':>7} {'servers CPU':>11} {'client CPU':>10}")
    for (kind, n, concurrency), results in rows.items():
        med = {key: statistics.median(r[key] for r in results) for key in results[0]}
        print(f"{kind:8} {n:>2} {concurrency:>3} {med['req_per_s']:>8.0f} {med['p50_ms']:>7.2f} "
              f"{med['server_cpu_share']:>11.2f} {med['client_cpu_share']:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
