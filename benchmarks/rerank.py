#!/usr/bin/env python3
"""Pairs per second of ``/v1/rerank`` with 8 clients at once against sentence-transformers'
``CrossEncoder.predict`` in-process, on the same cross-encoder (the example model of
``scripts/build_rerank_archive --example``: all-MiniLM-L6-v2's encoder and a one-label head, the
size of ms-marco-MiniLM-L-6-v2), the same pairs and the same threads (issue 51: ours >= 1.2x).

Contenders (``--contenders``), one at a time, alternating over ``--runs``: ``ours`` (the archive's
default: the OpenVINO engine, fp32), ``ours_torch`` (``--engine torch``), ``st`` (``predict`` on
each request's pairs, ``batch_size=32``, one request after the other: what a service calling
sentence-transformers per request does; the reference of the goal) and ``st_all`` (one ``predict``
over every pair of a run: the most batching sentence-transformers can do, a stricter bar), and
``genai`` (OpenVINO GenAI's ``TextRerankPipeline`` in-process on the archive's IR, one call a
request, as it takes one query a call: the engine the handler does not use, measured without the
server's costs). The in-process contenders run with the server worker's threads. A request
is one query and ``--documents`` passages (20 to 80 words); ``--clients`` clients send
``--requests`` requests each, after one unmeasured request per client. Figure: pairs/s = pairs
scored / wall time, the median over the runs.

Prints the CPU model (``/proc/cpuinfo``), the threads, a table, the ratios and one JSON line.
``--smoke``: ``ours`` and ``st``, 1 run of 2 requests a client.

Usage: .venv/bin/python benchmarks/rerank.py [--runs 3] [--clients 8] [--requests 4] [--documents 20]
           [--contenders ours,ours_torch,st,st_all,genai] [--smoke]
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import ROOT, Server, format_table, start_project, wait_http
from embeddings import cpu_model

from inference_service.contracts.cpu import default_threads

GOAL = 1.2
BATCH = 32
_WORDS = ("the server answers requests over gRPC and HTTP while a worker runs the model on two cores and "
          "the client waits for scores of passages about cats dogs markets weather music travel food").split()


def workload(clients: int, requests: int, documents: int) -> list[list[tuple[str, list[str]]]]:
    """Each client's requests: ``(query, passages)``, deterministic, passages of 20 to 80 words."""
    out = []
    for client in range(clients):
        mine = []
        for r in range(requests):
            seed = client * 101 + r * 13
            query = " ".join(_WORDS[(seed + j * 5) % len(_WORDS)] for j in range(6 + seed % 6)) + "?"
            passages = [" ".join(_WORDS[(seed + d * 7 + j * 3) % len(_WORDS)] for j in range(20 + (seed + d * 37) % 61))
                        + "." for d in range(documents)]
            mine.append((query, passages))
        out.append(mine)
    return out


def start_ours(name: str, engine: str, work: Path) -> Server:
    """The server with the example archive built for ``engine``, once ``/v1/rerank`` answers."""
    store = work / f"store-{name}"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_rerank_archive"), "--example", "--model-store",
                    str(store), "--engine", engine], check=True, timeout=900, capture_output=True)
    workdir = work / f"work-{name}"
    workdir.mkdir()
    server = start_project(name, store, workdir, ["reranker=reranker.mar"], startup_s=120)
    server.base_url = f"http://127.0.0.1:{server.http_port}"
    server.headers = {"Authorization": dict(server.metadata)["authorization"]}
    try:
        wait_http(server, "/v1/rerank", 600, json.dumps({"model": "reranker", "query": "warm",
                                                          "documents": ["up"]}).encode())
    except BaseException:
        server.stop()
        raise
    return server


def run_ours(server: Server, load: list[list[tuple[str, list[str]]]]) -> float:
    """Pairs/s of every client sending its requests one after the other, all clients at once."""
    def send(query: str, passages: list[str]) -> None:
        body = json.dumps({"model": "reranker", "query": query, "documents": passages,
                           "return_documents": False}).encode()
        request = urllib.request.Request(server.base_url + "/v1/rerank", data=body,
                                         headers={"Content-Type": "application/json", **server.headers})
        with urllib.request.urlopen(request, timeout=300) as answer:
            if len(json.loads(answer.read())["results"]) != len(passages):
                raise RuntimeError("an answer lacks results")

    def client(mine: list[tuple[str, list[str]]]) -> None:
        for query, passages in mine:
            send(query, passages)

    with ThreadPoolExecutor(len(load)) as pool:
        list(pool.map(lambda mine: send(*mine[0]), load))  # one unmeasured request a client
        start = time.perf_counter()
        list(pool.map(client, load))
        elapsed = time.perf_counter() - start
    return sum(len(p) for mine in load for _, p in mine) / elapsed


def run_st(model: Any, load: list[list[tuple[str, list[str]]]], together: bool) -> float:
    """Pairs/s of ``CrossEncoder.predict`` on each request's pairs, or on all pairs at once."""
    requests = [[(query, p) for p in passages] for mine in load for query, passages in mine]
    model.predict(requests[0], batch_size=BATCH)
    start = time.perf_counter()
    if together:
        model.predict([pair for pairs in requests for pair in pairs], batch_size=BATCH)
    else:
        for pairs in requests:
            model.predict(pairs, batch_size=BATCH)
    return sum(len(pairs) for pairs in requests) / (time.perf_counter() - start)


def run_genai(pipeline: Any, load: list[list[tuple[str, list[str]]]]) -> float:
    """Pairs/s of ``TextRerankPipeline.rerank`` on each request, one after the other."""
    requests = [request for mine in load for request in mine]
    pipeline.rerank(*requests[0])
    start = time.perf_counter()
    for query, passages in requests:
        pipeline.rerank(query, passages)
    return sum(len(passages) for _, passages in requests) / (time.perf_counter() - start)


def genai_pipeline(model_dir: Path, documents: int, threads: int) -> Any:
    """``TextRerankPipeline`` on the IR of ``model_dir`` in f32, answering all ``documents``."""
    import openvino_genai as ov_genai

    from inference_service.rerank.model import prepare_ir

    ir_dir, _ = prepare_ir(model_dir, "fp32")
    config = ov_genai.TextRerankPipeline.Config()
    config.top_n = documents
    return ov_genai.TextRerankPipeline(str(ir_dir), "CPU", config, INFERENCE_PRECISION_HINT="f32",
                                       INFERENCE_NUM_THREADS=threads)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4, help="measured requests a client per run")
    parser.add_argument("--documents", type=int, default=20, help="passages a request")
    parser.add_argument("--contenders", default="ours,st,st_all")
    parser.add_argument("--smoke", action="store_true", help="ours and st, 1 run of 2 requests a client")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.requests, args.contenders = 1, 2, "ours,st"
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = set(contenders) - {"ours", "ours_torch", "st", "st_all", "genai"}
    if unknown:
        parser.error(f"unknown contenders: {sorted(unknown)}")
    threads = default_threads(1)
    load = workload(args.clients, args.requests, args.documents)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from sentence_transformers import CrossEncoder

    from inference_service.llm.model import default_cache_root
    from inference_service.rerank.model import example_model

    torch.set_num_threads(threads)
    figures: dict[str, list[float]] = {c: [] for c in contenders}
    with tempfile.TemporaryDirectory(prefix="bench-rerank-") as tmp:
        servers = {c: start_ours(c, "torch" if c == "ours_torch" else "openvino", Path(tmp))
                   for c in contenders if c.startswith("ours")}
        model_dir = example_model(default_cache_root())
        st_model = CrossEncoder(str(model_dir), device="cpu", local_files_only=True)
        pipeline = genai_pipeline(model_dir, args.documents, threads) if "genai" in contenders else None
        try:
            for _ in range(args.runs):
                for name in contenders:
                    if name == "genai":
                        figures[name].append(run_genai(pipeline, load))
                    elif name.startswith("st"):
                        figures[name].append(run_st(st_model, load, name == "st_all"))
                    else:
                        figures[name].append(run_ours(servers[name], load))
        finally:
            for server in servers.values():
                server.stop()
    medians = {name: statistics.median(values) for name, values in figures.items()}
    print(f"CPU: {cpu_model()}; {os.cpu_count()} CPUs online, {threads} threads for each contender; {args.runs} "
          f"runs of {args.clients} clients x {args.requests} requests of {args.documents} passages")
    print(format_table(["contender", "pairs/s (median)", "runs"],
                       [[name, f"{medians[name]:.1f}", " ".join(f"{v:.1f}" for v in figures[name])]
                        for name in contenders]))
    ratios = {f"ours/{ref}": medians["ours"] / medians[ref] for ref in ("st", "st_all")
              if "ours" in medians and ref in medians}
    for key, ratio in ratios.items():
        print(f"{key}: {ratio:.2f}x" + (f" (goal >= {GOAL}x: {'met' if ratio >= GOAL else 'not met'})"
                                        if key == "ours/st" else ""))
    print(json.dumps({"cpu": cpu_model(), "threads": threads, "clients": args.clients, "requests": args.requests,
                      "documents": args.documents, "runs": args.runs,
                      "pairs_per_s": {k: round(v, 1) for k, v in medians.items()},
                      "ratios": {k: round(v, 2) for k, v in ratios.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
