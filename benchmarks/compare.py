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

For every load scenario the server's CPU time (user+sys of the server and all its child
processes, via psutil, sampled before and after a fixed number of requests/messages) is
reported per request or per message in µs, and the client's own CPU share (its process CPU
seconds / wall seconds, 1.0 = one core). The bare server has no workers, no models and no
management API: its rows (b) and (e) are empty and it answers every model name.

Prints one table (absolute numbers: this machine's) with ratios project/TorchServe and
project/bare, then one JSON line per server and scenario and one with the ratios.

``--smoke`` runs in seconds with tiny amounts of work and never starts TorchServe (for CI);
without it TorchServe must be installed by benchmarks/setup_torchserve.sh.

The LLM (streamed, against in-process generation and the peers) is benchmarks/llm_peers.py's.

Usage: .venv/bin/python benchmarks/compare.py [--smoke] [--servers project,torchserve,bare]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import format_table
from compare_load import FULL, SMOKE, bench_server, build_archives, start_server

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
]


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
    return format_table(header, lines), ratios


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
    except BaseException:
        print(f"# logs kept in {root}", file=sys.stderr)
        raise
    shutil.rmtree(root, ignore_errors=True)
    runs = max(1, args.repeat)
    if runs > 1:
        for run in range(runs):
            print(f"# run {run + 1} of {runs}")
            print(table([r for r in results if r["run"] == run], servers)[0])
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
