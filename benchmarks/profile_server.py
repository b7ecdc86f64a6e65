"""Sample this project's server under load with py-spy and print where its CPU goes.

Starts the project server as ``compare.py`` does (echo model at startup, the 1000-message
stream model registered, token authorization and access log on), warms it, then runs one
scenario for ``--seconds`` while py-spy samples the frontend and every worker process. Prints,
per process, the share of samples in each function (inclusive and self) and, for the
frontend, the share spent in this project's own code. Raw py-spy stacks are kept in
``--out`` (default ``benchmarks/.profile/``) for speedscope or flame graphs.

    .venv/bin/python benchmarks/profile_server.py --scenario unary --seconds 10
    .venv/bin/python benchmarks/profile_server.py --scenario stream --seconds 10

Needs py-spy (``requirements-dev.txt``) and the right to ptrace the server (root, or
``kernel.yama.ptrace_scope=0``). Sampling costs CPU: read the shares, not the rates.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shutil
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

OWN = ("inference_service/",)
ENTRY = ("inference_service/__main__.py", "inference_service/cli.py", "inference_service/server.py",
         "inference_service/worker/main.py")  # at the bottom of every stack: not "own" time by themselves


def summarize(raw: Path, top: int) -> str:
    """Inclusive and self sample shares per function of one py-spy ``raw`` file."""
    inclusive: collections.Counter[str] = collections.Counter()
    own_self: collections.Counter[str] = collections.Counter()
    self_time: collections.Counter[str] = collections.Counter()
    total = own = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = [f.split(" (")[0] + (" " + f.split("(")[-1].split(":")[0].rstrip(")") if "(" in f else "")
                  for f in stack.split(";")]
        total += n
        for name in set(frames):
            inclusive[name] += n
        self_time[frames[-1]] += n
        mine = [f for f in frames if any(p in f for p in OWN) and not any(e in f for e in ENTRY)]
        if mine:
            own += n
            own_self[mine[-1]] += n
    if not total:
        return "  (no samples)\n"
    lines = [f"  samples: {total}; under this project's functions (entry points aside): {100 * own / total:.1f}%"]
    lines.append("  inclusive:")
    lines += [f"    {100 * c / total:5.1f}%  {name}" for name, c in inclusive.most_common(top)]
    lines.append("  self (innermost frame):")
    lines += [f"    {100 * c / total:5.1f}%  {name}" for name, c in self_time.most_common(top // 2)]
    return "\n".join(lines) + "\n"


async def drive(scenario: str, seconds: float, out: Path, top: int, which: str = "project",
                native: bool = False) -> None:
    """Start the server (``which``: project or bare), load it for ``seconds`` under py-spy (with
    C frames when ``native``), print the summaries."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    work = Path(tempfile.mkdtemp(prefix="profile-"))
    store = work / "store"
    compare_load.build_archives(store, Path(sys.executable).parent / "torch-model-archiver")
    server = compare_load.start_server(which, store, work)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.inference_port}") as channel:
            stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
            await compare_load.wait_serving(server, stub)
            await compare_load.register_stream(server)
            await compare_load.warm(server, stub, 2.0)
            procs = common.tree(server.proc.pid)
            out.mkdir(parents=True, exist_ok=True)
            spies = []
            for proc in procs:
                raw = out / f"{scenario}-{proc.pid}.txt"
                spies.append((proc, raw, subprocess.Popen(
                    [spy, "record", "-p", str(proc.pid), "-d", str(int(seconds)), "-r", "200", "-f", "raw",
                     "-o", str(raw), *(["--native"] if native else ["--nonblocking"])],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                if scenario == "unary":
                    result = await compare_load.unary(server, stub, "echo", 32, 1000)
                    print(f"# unary c=32: {result['req_per_s']} req/s", flush=True)
                else:
                    streams = 1 if scenario == "stream1" else 4
                    for _ttft, count in await asyncio.gather(*(compare_load.one_stream(server, stub, 1000)
                                                               for _ in range(streams))):
                        assert count == 1000
            for proc, raw, spy_proc in spies:
                _, err = spy_proc.communicate(timeout=60)
                role = "frontend" if proc.pid == server.proc.pid else "worker " + " ".join(proc.cmdline()[-2:])
                print(f"\n## {role} (pid {proc.pid})")
                if not raw.exists():
                    print(f"  py-spy failed: {err.decode(errors='replace').strip()[-300:]}")
                    continue
                print(summarize(raw, top), end="")
    finally:
        server.stop()


def main() -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=("unary", "stream", "stream1"), default="unary",
                        help="unary: Predictions of echo at concurrency 32; stream: 4 concurrent 1000-message "
                             "streams; stream1: one 1000-message stream after the other")
    parser.add_argument("--server", choices=("project", "bare"), default="project",
                        help="the server sampled: this project or benchmarks/bare_server.py")
    parser.add_argument("--native", action="store_true", help="C frames too (py-spy --native; costs more)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--top", type=int, default=40, help="functions listed per process")
    parser.add_argument("--out", type=Path, default=BENCH / ".profile")
    args = parser.parse_args()
    asyncio.run(drive(args.scenario, args.seconds, args.out, args.top, args.server, args.native))
    return 0


if __name__ == "__main__":
    sys.exit(main())
