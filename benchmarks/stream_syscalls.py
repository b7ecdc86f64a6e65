#!/usr/bin/env python3
"""Where a streamed message's time goes in system calls, server and client side (issue 17).

For each server (this project, the bare grpc.aio server on asyncio's loop and on uvloop,
TorchServe 0.12.0), started as ``compare.py`` starts it, with the 1000-message stream model:
warm it, then run ``--streams`` single StreamPredictions of 1000 messages one after the other
while ``strace -c -f`` counts the system calls of every process of the server and, separately,
of this client process. Prints per streamed message: the server's and the client's system calls
in all, their writes (``write``/``writev``/``sendmsg``/``sendto``), reads
(``read``/``recvmsg``/``recvfrom``), ``epoll_wait`` and ``futex`` calls, and the TCP segments
the kernel sent (``/proc/net/snmp`` ``OutSegs``, both directions: every HTTP/2 write of
either side is at least one), plus the messages/s seen under strace (strace slows every
system call: read the counts, not the rate).

    .venv/bin/python benchmarks/stream_syscalls.py [--servers project,bare,bare_uvloop,torchserve] [--streams 10]

Needs strace and the right to ptrace the servers (root).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import common  # noqa: E402 - the benchmarks' shared plumbing
import compare_load  # noqa: E402 - compare.py's servers and scenarios

from inference_service._proto import inference_pb2_grpc  # noqa: E402

GROUPS = {
    "writes": ("write", "writev", "sendmsg", "sendto", "sendmmsg"),
    "reads": ("read", "readv", "recvmsg", "recvfrom", "recvmmsg"),
    "epoll_wait": ("epoll_wait", "epoll_pwait", "epoll_pwait2"),
    "futex": ("futex",),
}


def out_segments() -> int:
    """The kernel's TCP ``OutSegs`` counter (all sockets, loopback included)."""
    lines = Path("/proc/net/snmp").read_text().splitlines()
    tcp = [line.split() for line in lines if line.startswith("Tcp:")]
    return int(tcp[1][tcp[0].index("OutSegs")])


def strace_counts(path: Path) -> dict[str, int]:
    """Calls per system call name from an ``strace -c`` summary file."""
    counts: dict[str, int] = {}
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and re.fullmatch(r"[\d.]+", fields[0]) and fields[-1] != "total":
            try:
                counts[fields[-1]] = int(fields[3])
            except ValueError:
                continue
    return counts


def trace(pids: list[int], out: Path) -> subprocess.Popen[bytes]:
    """``strace -c -f`` attached to ``pids`` (threads and children followed), summary to ``out``."""
    args = ["strace", "-c", "-f", "-o", str(out)]
    for pid in pids:
        args += ["-p", str(pid)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # strace attaches to every thread before the measured work starts
    return proc


async def measure(server: common.Server, streams: int, workdir: Path) -> dict[str, float]:
    """Warm, then count system calls during ``streams`` single streams; figures per message."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.inference_port}") as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        await compare_load.wait_serving(server, stub)
        await compare_load.register_stream(server)
        await compare_load.warm(server, stub, 20.0 if server.name == "torchserve" else 2.0)
        for _ in range(3):
            await compare_load.one_stream(server, stub, 1000)
        server_out, client_out = workdir / "strace-server.txt", workdir / "strace-client.txt"
        tracers = [trace([p.pid for p in common.tree(server.proc.pid)], server_out),
                   trace([os.getpid()], client_out)]
        segments, started, received = out_segments(), time.perf_counter(), 0
        for _ in range(streams):
            received += (await compare_load.one_stream(server, stub, 1000))[1]
        wall = time.perf_counter() - started
        segments = out_segments() - segments
        for tracer in tracers:
            tracer.send_signal(signal.SIGINT)
            tracer.wait(30)
    result: dict[str, float] = {"msg_per_s_traced": received / wall, "tcp_segments": segments / received}
    for side, path in (("server", server_out), ("client", client_out)):
        counts = strace_counts(path)
        result[f"{side}_syscalls"] = sum(counts.values()) / received
        for group, names in GROUPS.items():
            result[f"{side}_{group}"] = sum(counts.get(n, 0) for n in names) / received
    return result


def main() -> int:
    """Measure each server in turn; print one table, system calls per streamed message."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", default="project,bare,bare_uvloop,torchserve")
    parser.add_argument("--streams", type=int, default=10)
    args = parser.parse_args()
    if shutil.which("strace") is None:
        raise SystemExit("needs strace (apt-get install strace)")
    root = Path(tempfile.mkdtemp(prefix="stream-syscalls-"))
    store = root / "store"
    compare_load.build_archives(store, Path(sys.executable).parent / "torch-model-archiver")
    rows = {}
    for name in args.servers.split(","):
        workdir = root / name
        workdir.mkdir()
        server = compare_load.start_server(name, store, workdir)
        try:
            rows[name] = asyncio.run(measure(server, args.streams, workdir))
        finally:
            server.stop()
    keys = list(next(iter(rows.values())))
    print(f"# per streamed message, {args.streams} streams of 1000 messages under strace -c -f")
    print(f"{'figure':22}" + "".join(f"{name:>13}" for name in rows))
    for key in keys:
        print(f"{key:22}" + "".join(f"{rows[name][key]:>13.2f}" for name in rows))
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
