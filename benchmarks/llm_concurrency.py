#!/usr/bin/env python3
"""Many LLM streams at once: this server vs TorchServe 0.12 vs transformers in-process (issue 13).

Systems, side by side in one run (``--systems``, default all but ``before``):

- ``ours``: this server (``--ncs``, free ports, temporary working directory, token
  authorization on), one worker of the bundled SmolLM2 archive (``scripts/build_llm_archive``)
  whose model-config.yaml this script sets to ``continuousBatching: true``, ``batchSize: 8``,
  ``maxBatchDelay: 0``; clients call gRPC StreamPredictions.
- ``torchserve``: TorchServe 0.12.0 (``benchmarks/setup_torchserve.sh``) serving the very same
  archive and handler, one worker, ``continuousBatching: true``, batchSize 8. Clients use its
  HTTP/1.1 streaming predictions API (chunked responses), because TorchServe 0.12's
  continuous batching drops every gRPC stream after its first message (see ``TS_GRPC_NOTE``);
  ``--ts-api grpc`` measures that path anyway.
- ``hf_cb``: transformers' continuous batching in a child process
  (``model.init_continuous_batching()``, paged cache; ``add_request(..., streaming=True)``).
- ``static``: ``model.generate`` on one left-padded batch of the same N prompts in a child
  process, all at once (the ceiling; no staggered arrivals).
- ``before`` (only with ``--before-tree DIR``): this server from another checkout (e.g.
  ``git worktree add /tmp/before 972beaf``) with a batchSize 1 archive, one stream only: the
  single-user baseline of the targets.

Load: N = 1, 2, 4, 8 concurrent streams (``--concurrency``) of ``--max-new-tokens`` tokens
(64; ``ignore_eos``), distinct prompts of 30-60 tokens from ``prompts_concurrency.json``,
arriving (a) ``together`` or (b) ``staggered``: Poisson arrivals with mean gap ``--mean-gap``
seconds (0.5), first at 0, from a fixed seed (``--seed``), identical for every system and run.
N = 1 runs only as ``together`` (staggered is the same thing).

Figures per system x arrival x N:

- ``agg_tokens_per_s``: total completion tokens / seconds from the first send to the last
  final message (tokens from ``include_usage``'s ``completion_tokens``, else one per message);
- ``ttft_p50_s`` / ``ttft_p90_s``: time from a request's send to its first message;
- ``itl_p50_ms`` / ``itl_p99_ms``: gaps between consecutive messages of a request (one text
  piece is about one token), pooled over the requests;
- ``peak_rss_mib``: the worker's VmHWM (``/proc/<pid>/status``, reset through
  ``/proc/<pid>/clear_refs`` before each scenario): for the servers the worker process (pid from
  DescribeModel, else the process tree), for ``hf_cb`` / ``static`` the child process.

Prints one table, the ratios (ours/torchserve, ours/static, ours(N)/ours(1)), each issue-13
target as ``met`` / ``MISSED`` and one JSON line. ``--runs K`` repeats everything and reports
medians per figure. ``--quick``: N = 1, 2 and 16 tokens, a fast end-to-end check.

Usage: .venv/bin/python benchmarks/llm_concurrency.py [--runs 3] [--quick]
           [--systems ours,torchserve,hf_cb,static] [--concurrency 1,2,4,8]
           [--before-tree DIR] [--ts-api http|grpc]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from llm_concurrency_inprocess import child_main, run_child
from llm_concurrency_plan import load_prompts, plan
from llm_concurrency_report import median_runs, print_report
from llm_concurrency_servers import run_server_system

SYSTEMS = ("ours", "torchserve", "hf_cb", "static", "before")
TS_TEST_HANDLER_NOTE = (
    "TorchServe's own continuous-batching test handler (test/pytest/test_data/streaming/stream_handler.py, "
    "batchSize 2) fails under transformers 5.23 at its first decode step: it unpacks each layer of the "
    "DynamicCache it extracted as a (key, value) pair, which transformers 5 no longer yields ('too many "
    "values to unpack (expected 2)'), so TorchServe runs this project's bundled LLM handler instead."
)
TS_GRPC_NOTE = (
    "TorchServe 0.12's gRPC StreamPredictions cannot stream a continuous batch: GRPCJob.isOpen() returns "
    "isCancelled(), so ContinuousBatching logs 'Connection to client got closed; Removing job' after the "
    "first message and the stream stalls until its deadline."
)



def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command line; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="repeat everything K times, report medians")
    parser.add_argument("--quick", action="store_true", help="N = 1, 2 and 16 tokens (a fast check)")
    parser.add_argument("--systems", default=None,
                        help=f"comma list of {','.join(SYSTEMS)} (default: all but before; before with --before-tree)")
    parser.add_argument("--concurrency", default=None, help="comma list of N (default 1,2,4,8)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens per stream (64; --quick 16)")
    parser.add_argument("--mean-gap", type=float, default=0.5, help="staggered arrivals: mean gap, seconds")
    parser.add_argument("--seed", type=int, default=13, help="seed of the staggered arrival times")
    parser.add_argument("--before-tree", default=None,
                        help="checkout of the server before the concurrency work (system 'before', N=1)")
    parser.add_argument("--ts-api", choices=("http", "grpc"), default="http",
                        help="TorchServe's client transport (gRPC streams stall under its continuous batching)")
    parser.add_argument("--rpc-timeout", type=float, default=None,
                        help="seconds per request (default 60 + N x tokens / 2)")
    parser.add_argument("--start-timeout", type=float, default=600, help="seconds for a server to serve the model")
    parser.add_argument("--handler-config", action="append", default=[], metavar="KEY=INT",
                        help="set a handler config key of ours' archive, e.g. max_num_batched_tokens=64 (repeatable)")
    parser.add_argument("--child", choices=("hf_cb", "static"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.handler_config = [(k, int(v)) for k, v in (item.split("=", 1) for item in args.handler_config)]
    except ValueError:
        parser.error("--handler-config takes KEY=INT")
    args.concurrency = [int(n) for n in (args.concurrency or ("1,2" if args.quick else "1,2,4,8")).split(",")]
    if args.max_new_tokens is None:
        args.max_new_tokens = 16 if args.quick else 64
    default = [s for s in SYSTEMS if s != "before" or args.before_tree]
    args.systems = args.systems.split(",") if args.systems else default
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
    if "before" in args.systems and not args.before_tree:
        parser.error("system 'before' needs --before-tree DIR")
    if args.runs < 1 or min(args.concurrency) < 1 or args.max_new_tokens < 1:
        parser.error("--runs, --concurrency and --max-new-tokens must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every system ``--runs`` times, print the report."""
    args = parse_args(argv)
    if args.child:
        return child_main(args.child)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    scenarios = plan(sorted(set(args.concurrency)), args.mean_gap, args.seed, load_prompts())
    notes = [TS_TEST_HANDLER_NOTE]
    if "torchserve" in args.systems:
        notes.append(TS_GRPC_NOTE + (" TorchServe is therefore measured through its HTTP/1.1 streaming predictions "
                                     "API (same handler, same bodies)." if args.ts_api == "http" else
                                     " Measured through gRPC anyway (--ts-api grpc): expect errors."))
    base = Path(tempfile.mkdtemp(prefix="llm-concurrency-"))
    runs: list[dict[str, dict[str, Any]]] = []
    for run in range(args.runs):
        results: dict[str, dict[str, Any]] = {}
        for system in args.systems:
            only = [s for s in scenarios if s.n == 1 and s.arrival == "together"] if system == "before" else (
                [s for s in scenarios if s.arrival == "together"] if system == "static" else scenarios)
            if not only:
                continue
            began = time.monotonic()
            print(f"[run {run + 1}/{args.runs}] {system}: {len(only)} scenarios ...", file=sys.stderr, flush=True)
            try:
                if system in ("hf_cb", "static"):
                    results[system] = run_child(system, only, args.max_new_tokens, base)
                else:
                    results[system] = run_server_system(system, only, args, base)
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - one failed system leaves the others' figures
                results[system] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            print(f"[run {run + 1}/{args.runs}] {system}: done in {time.monotonic() - began:.0f} s",
                  file=sys.stderr, flush=True)
        runs.append(results)
    print_report(median_runs(runs), scenarios, args, notes)
    print(f"logs: {base}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
