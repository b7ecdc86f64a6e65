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
import asyncio
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
PROMPTS_FILE = BENCH / "prompts_concurrency.json"
RESULTS_MD = BENCH / "RESULTS.md"
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(BENCH))

from compare import TS_VENV, free_port, wait_for  # noqa: E402

MODEL = "smollm2"
SYSTEMS = ("ours", "torchserve", "hf_cb", "static", "before")
WORKER_MARKERS = ("inference_service.worker", "model_service_worker")
#: Continuous-batching settings of the served archive (issue 13).
CB_CONFIG = {"continuousBatching": True, "batchSize": 8, "maxBatchDelay": 0}
#: transformers' ContinuousBatchingConfig for ``hf_cb``: a cache sized for 8 requests of
#: < 256 tokens (pages of 256 tokens); left to its defaults it reserves 60 % of the RAM (5.6 GB here).
HF_CB_CONFIG = {"num_blocks": 24, "max_batch_tokens": 512}
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


# --------------------------------------------------------------------------- load plan
@dataclass
class Scenario:
    """One load: ``n`` requests; ``offsets[i]`` = seconds after the start at which request i is sent."""

    arrival: str
    n: int
    offsets: list[float]
    prompts: list[str]

    @property
    def key(self) -> str:
        """``together/8``-style identifier."""
        return f"{self.arrival}/{self.n}"


def load_prompts() -> list[str]:
    """The committed prompts (30-60 tokens each with SmolLM2's tokenizer)."""
    prompts = json.loads(PROMPTS_FILE.read_text())
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise SystemExit(f"{PROMPTS_FILE}: expected a JSON list of strings")
    return prompts


def plan(concurrency: list[int], mean_gap_s: float, seed: int, prompts: list[str]) -> list[Scenario]:
    """Together scenarios for every N, then staggered ones for N > 1 (Poisson arrivals, seeded per N)."""
    if max(concurrency) > len(prompts):
        raise SystemExit(f"at most {len(prompts)} concurrent streams (one distinct prompt each)")
    out = [Scenario("together", n, [0.0] * n, prompts[:n]) for n in concurrency]
    for n in concurrency:
        if n < 2:
            continue
        rng = random.Random(seed * 1000 + n)
        offsets, t = [], 0.0
        for _ in range(n):
            offsets.append(round(t, 4))
            t += rng.expovariate(1.0 / mean_gap_s)
        out.append(Scenario("staggered", n, offsets, prompts[:n]))
    return out


def request_body(prompt: str, max_new_tokens: int) -> bytes:
    """The JSON body every server-side system gets."""
    return json.dumps({"prompt": prompt, "max_new_tokens": max_new_tokens, "ignore_eos": True,
                       "include_usage": True}).encode()


# --------------------------------------------------------------------------- figures
def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100, linear interpolation between order statistics); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def token_count(messages: list[bytes]) -> tuple[int, str]:
    """Completion tokens of one stream: ``usage.completion_tokens`` of its last message, else its message count."""
    if messages:
        try:
            last = json.loads(messages[-1])
            if isinstance(last, dict) and isinstance(last.get("usage"), dict):
                return int(last["usage"]["completion_tokens"]), "usage"
        except (ValueError, KeyError, TypeError):
            pass
    return len(messages), "messages"


def figures(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Scenario figures from per-request records ``{"sent", "times", "tokens", "error"}`` (seconds).

    Returns:
        ``agg_tokens_per_s``, ``ttft_p50_s``, ``ttft_p90_s``, ``itl_p50_ms``, ``itl_p99_ms``,
        ``tokens`` (total), ``errors`` (failed requests), ``wall_s``.
    """
    ok = [r for r in requests if r["times"]]
    errors = sum(1 for r in requests if r.get("error"))
    tokens = sum(r["tokens"] for r in requests)
    start = min((r["sent"] for r in requests), default=0.0)
    end = max((r["times"][-1] for r in ok), default=start)
    wall = end - start
    ttfts = [r["times"][0] - r["sent"] for r in ok]
    gaps = [(b - a) * 1000 for r in ok for a, b in zip(r["times"], r["times"][1:], strict=False)]

    def rnd(value: float | None, digits: int) -> float | None:
        return None if value is None else round(value, digits)

    return {
        "agg_tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "ttft_p50_s": rnd(pct(ttfts, 50), 3), "ttft_p90_s": rnd(pct(ttfts, 90), 3),
        "itl_p50_ms": rnd(pct(gaps, 50), 1), "itl_p99_ms": rnd(pct(gaps, 99), 1),
        "tokens": tokens, "errors": errors, "wall_s": round(wall, 3),
    }


# --------------------------------------------------------------------------- memory
def reset_peak_rss(pid: int) -> bool:
    """Reset VmHWM of ``pid`` to its current RSS (``echo 5 > /proc/<pid>/clear_refs``); False if refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mib(pid: int) -> float | None:
    """VmHWM (peak resident set) of ``pid`` in MiB, None if unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


# --------------------------------------------------------------------------- in-process children
def child_main(system: str) -> int:
    """Child process of ``hf_cb`` / ``static``: read ``{"scenarios", "max_new_tokens"}`` on stdin,
    measure them, print one JSON line ``{"results": {key: {"requests", "peak_rss_mib"}}}``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from inference_service.llm.generation import build_prompt_ids, model_context_length
    from inference_service.llm.model import load_model, prepare_gguf
    from inference_service.llm.params import GenerationParams
    from inference_service.llm.requests import GenerationRequest

    job = json.loads(sys.stdin.read())
    max_new_tokens = int(job["max_new_tokens"])
    torch.set_num_threads(os.cpu_count() or 1)  # as the servers' single worker
    model, tokenizer = load_model(prepare_gguf())
    params = GenerationParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    ctx = model_context_length(model)

    def ids_of(prompt: str) -> list[int]:
        return build_prompt_ids(tokenizer, GenerationRequest(prompt=prompt, messages=None, params=params), ctx)

    scenarios = [Scenario(**s) for s in job["scenarios"]]
    run = _static_runner(model, tokenizer) if system == "static" else _hf_cb_runner(model, job.get("hf_cb_config"))
    results: dict[str, Any] = {}
    try:
        warm = scenarios[0]
        run([ids_of(p) for p in warm.prompts[:2]], [0.0, 0.0][: len(warm.prompts[:2])], 4, "warmup")
        for sc in scenarios:
            reset_peak_rss(os.getpid())
            requests = run([ids_of(p) for p in sc.prompts], sc.offsets, max_new_tokens, sc.key)
            results[sc.key] = {"requests": requests, "peak_rss_mib": peak_rss_mib(os.getpid())}
    finally:
        close = getattr(run, "close", None)
        if close is not None:
            close()
    print(json.dumps({"results": results}))
    return 0


def _static_runner(model: Any, tokenizer: Any) -> Any:
    """``run(prompt_ids, offsets, max_new_tokens, tag)`` doing one left-padded ``model.generate``.

    Every request's messages are the generation steps (a StoppingCriteria stamps each); offsets are
    ignored (all requests start together)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    class Stamp(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def run(prompt_ids: list[list[int]], offsets: list[float], max_new_tokens: int, tag: str) -> list[dict[str, Any]]:
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
        stamp = Stamp()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                                 stopping_criteria=StoppingCriteriaList([stamp]))
        tokens = int(out.shape[1] - width)
        return [{"sent": start, "times": list(stamp.times), "tokens": tokens, "error": None} for _ in prompt_ids]

    return run


def _hf_cb_runner(model: Any, cb_config: dict[str, Any] | None) -> Any:
    """``run(prompt_ids, offsets, max_new_tokens, tag)`` on one started ContinuousBatchingManager.

    Requests are added at their offsets from this thread, which also drains the manager's output
    queue (stamping each streamed output); bounded by a deadline of 60 s + 1 s per token."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(do_sample=False, max_new_tokens=64, eos_token_id=-1),
        continuous_batching_config=ContinuousBatchingConfig(**(cb_config or HF_CB_CONFIG)))
    manager.start()

    def run(prompt_ids: list[list[int]], offsets: list[float], max_new_tokens: int, tag: str) -> list[dict[str, Any]]:
        n = len(prompt_ids)
        records = [{"sent": 0.0, "times": [], "tokens": 0, "error": None} for _ in range(n)]
        index = {f"{tag}-{i}": i for i in range(n)}
        start = time.perf_counter()
        deadline = start + max(offsets) + 60 + n * max_new_tokens
        added, finished = 0, 0
        while finished < n:
            now = time.perf_counter()
            if now > deadline:
                for r in records:
                    r["error"] = r["error"] or "deadline"
                break
            while added < n and now - start >= offsets[added]:
                records[added]["sent"] = time.perf_counter()
                manager.add_request(prompt_ids[added], request_id=f"{tag}-{added}", max_new_tokens=max_new_tokens,
                                    streaming=True, eos_token_id=-1)
                added += 1
            wait = 0.05 if added == n else max(0.0, min(0.05, start + offsets[added] - time.perf_counter()))
            out = manager.get_result(timeout=wait) if wait > 0 else None
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped")
                continue
            i = index.get(out.request_id)
            if i is None:
                continue
            rec = records[i]
            rec["times"].append(time.perf_counter())
            rec["tokens"] = len(out.generated_tokens)
            if out.error:
                rec["error"] = str(out.error)
            if out.is_finished():
                finished += 1
        return records

    def close() -> None:
        manager.stop(block=True, timeout=30)

    run.close = close  # type: ignore[attr-defined]
    return run


def run_child(system: str, scenarios: list[Scenario], max_new_tokens: int, workdir: Path) -> dict[str, Any]:
    """Run ``system`` (``hf_cb`` / ``static``) in a child process; its stderr goes to ``workdir/<system>.log``."""
    job = {"max_new_tokens": max_new_tokens, "hf_cb_config": HF_CB_CONFIG,
           "scenarios": [s.__dict__ for s in scenarios]}
    limit = 300 + sum(max(s.offsets) + 60 + s.n * max_new_tokens for s in scenarios)
    log_path = workdir / f"{system}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, __file__, "--child", system], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        try:
            out, _ = proc.communicate(json.dumps(job).encode(), timeout=limit)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"{system} child exited {proc.returncode}: {' | '.join(tail)}")
    results = json.loads(out.decode().strip().splitlines()[-1])["results"]
    return {key: {**figures(v["requests"]), "peak_rss_mib": v["peak_rss_mib"]} for key, v in results.items()}


# --------------------------------------------------------------------------- archives and servers
def build_archive(store: Path, config: dict[str, Any], drop: tuple[str, ...] = ()) -> Path:
    """``scripts/build_llm_archive`` into ``store``, then its model-config.yaml updated with ``config``
    (keys in ``drop`` removed). Returns the archive path."""
    import yaml

    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_llm_archive"), "--model-store", str(store),
                           "--force"], check=True, capture_output=True, timeout=900)
    archive = Path(done.stdout.decode().strip().splitlines()[-1])
    with zipfile.ZipFile(archive) as src:
        entries = {name: src.read(name) for name in src.namelist()}
    manifest = json.loads(entries["MAR-INF/MANIFEST.json"])
    config_name = manifest["model"]["configFile"]
    model_config = yaml.safe_load(entries[config_name]) or {}
    for key in drop:
        model_config.pop(key, None)
    model_config.update(config)
    entries[config_name] = ("# scripts/build_llm_archive's config as set by benchmarks/llm_concurrency.py\n"
                            + yaml.safe_dump(model_config, sort_keys=False)).encode()
    tmp = archive.with_suffix(".mar.tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for name, data in entries.items():
            dst.writestr(name, data)
    os.replace(tmp, archive)
    return archive


@dataclass
class Served:
    """A started server: process group leader, ports, request metadata, transport."""

    name: str
    proc: subprocess.Popen[bytes]
    workdir: Path
    inference_port: int
    management_port: int
    http_port: int | None = None
    metadata: tuple[tuple[str, str], ...] = ()
    management_metadata: tuple[tuple[str, str], ...] = ()
    transport: str = "grpc"
    extra: dict[str, Any] = field(default_factory=dict)

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after 30 s."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def start_ours(name: str, store: Path, workdir: Path, tree: Path | None = None) -> Served:
    """This server (or the one of checkout ``tree``) in the foreground, ports 0, token authorization on."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if tree is not None:
        env["PYTHONPATH"] = str(tree / "src")
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen([sys.executable, "-m", "inference_service", "--foreground", "--ncs",
                             "--model-store", str(store), "--models", f"{MODEL}={MODEL}.mar",
                             "--grpc-inference-port", "0", "--grpc-management-port", "0",
                             "--http-port", "0", "--http-management-port", "0", "--metrics-port", "0"],
                            cwd=workdir, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        info = wait_for(workdir / ".inference_service" / "status.json", proc, time.monotonic() + 120)
        keys = json.loads((workdir / "key_file.json").read_text())
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        raise
    return Served(name, proc, workdir, int(info["inference_port"]), int(info["management_port"]),
                  metadata=(("authorization", f"Bearer {keys['inference']['key']}"),),
                  management_metadata=(("authorization", f"Bearer {keys['management']['key']}"),))


def start_torchserve(store: Path, workdir: Path, transport: str) -> Served:
    """TorchServe 0.12.0 from benchmarks/.venv-torchserve: one worker of the archive, free ports, no tokens."""
    if not (TS_VENV / "bin" / "torchserve").exists():
        raise RuntimeError("TorchServe is not installed: run benchmarks/setup_torchserve.sh")
    grpc_port, grpc_mgmt, http_port = free_port(), free_port(), free_port()
    (workdir / "config.properties").write_text("\n".join([
        f"inference_address=http://127.0.0.1:{http_port}",
        f"management_address=http://127.0.0.1:{free_port()}",
        f"metrics_address=http://127.0.0.1:{free_port()}",
        f"grpc_inference_port={grpc_port}",
        f"grpc_management_port={grpc_mgmt}",
        "grpc_inference_address=127.0.0.1",
        "grpc_management_address=127.0.0.1",
        "disable_token_authorization=true",
        "default_workers_per_model=1",
        "install_py_dep_per_model=false",
        f"model_store={store}",
        f"load_models={MODEL}={MODEL}.mar",
        "",
    ]))
    env = dict(os.environ, PATH=f"{TS_VENV / 'bin'}:{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(TS_VENV),
               HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen([str(TS_VENV / "bin" / "torchserve"), "--start", "--foreground", "--ncs",
                             "--model-store", str(store), "--ts-config", str(workdir / "config.properties")],
                            cwd=workdir, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Served("torchserve", proc, workdir, grpc_port, grpc_mgmt, http_port=http_port, transport=transport)


def describe_workers(server: Served) -> list[dict[str, Any]]:
    """The model's ``workers`` entries from DescribeModel on the management port (empty on any failure)."""
    import grpc

    from inference_service._proto import management_pb2, management_pb2_grpc

    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.management_port}") as channel:
            reply = management_pb2_grpc.ManagementAPIsServiceStub(channel).DescribeModel(
                management_pb2.DescribeModelRequest(model_name=MODEL), timeout=10,
                metadata=server.management_metadata)
        described = json.loads(reply.msg)
    except (grpc.RpcError, ValueError):
        return []
    models = described if isinstance(described, list) else [described]
    return [w for m in models if isinstance(m, dict) for w in m.get("workers", []) if isinstance(w, dict)]


def worker_pid(server: Served) -> int | None:
    """The model's worker pid: DescribeModel's ``workers[].pid``, else the server's process tree."""
    import psutil

    for worker in describe_workers(server):
        try:
            pid = int(worker.get("pid", -1))
        except (TypeError, ValueError):
            continue
        if pid > 0 and psutil.pid_exists(pid):
            return pid
    try:
        for child in psutil.Process(server.proc.pid).children(recursive=True):
            if any(marker in " ".join(child.cmdline()) for marker in WORKER_MARKERS):
                return child.pid
    except psutil.Error:
        pass
    return None


# --------------------------------------------------------------------------- clients
async def grpc_stream(stub: Any, server: Served, body: bytes, timeout_s: float, times: list[float],
                      messages: list[bytes]) -> None:
    """One StreamPredictions; appends each message and its arrival time (kept when the call then fails)."""
    from inference_service._proto import inference_pb2

    call = stub.StreamPredictions(inference_pb2.PredictionsRequest(model_name=MODEL, input={"data": body}),
                                  timeout=timeout_s, metadata=server.metadata)
    async for response in call:
        times.append(time.perf_counter())
        messages.append(response.prediction)


async def http_stream(session: Any, server: Served, body: bytes, timeout_s: float, times: list[float],
                      messages: list[bytes]) -> None:
    """One streaming POST /predictions (TorchServe); appends each HTTP chunk and its arrival time."""
    import aiohttp

    url = f"http://127.0.0.1:{server.http_port}/predictions/{MODEL}"
    async with session.post(url, data=body, headers={"Content-Type": "application/json"},
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        buffer = b""
        async for data, end_of_chunk in resp.content.iter_chunks():
            buffer += data
            if end_of_chunk and buffer:
                times.append(time.perf_counter())
                messages.append(buffer)
                buffer = b""
        if buffer:
            times.append(time.perf_counter())
            messages.append(buffer)
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {b''.join(messages)[:200]!r}")


class Clients:
    """The client side of one server: gRPC (aio) stubs or an aiohttp session, created in the running loop."""

    def __init__(self, server: Served) -> None:
        self.server = server
        self.channel: Any = None
        self.stub: Any = None
        self.session: Any = None

    async def __aenter__(self) -> Clients:
        import grpc

        from inference_service._proto import inference_pb2_grpc

        if self.server.transport == "http":
            import aiohttp

            self.session = aiohttp.ClientSession()
        else:
            self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.server.inference_port}")
            self.stub = inference_pb2_grpc.InferenceAPIsServiceStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()
        if self.channel is not None:
            await self.channel.close()

    async def stream(self, body: bytes, timeout_s: float, times: list[float], messages: list[bytes]) -> None:
        """One streamed request over this server's transport; fills ``times`` and ``messages`` as they come."""
        if self.session is not None:
            await http_stream(self.session, self.server, body, timeout_s, times, messages)
        else:
            await grpc_stream(self.stub, self.server, body, timeout_s, times, messages)


def describe_error(exc: BaseException) -> str:
    """One line for a failed request: ``CODE: details`` for gRPC errors, else ``Type: message``."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):
        return f"{code().name}: {details()}"
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")


async def run_scenario(clients: Clients, sc: Scenario, max_new_tokens: int, timeout_s: float) -> list[dict[str, Any]]:
    """Send the scenario's requests at their offsets; one record per request (errors recorded, not raised)."""
    start = time.perf_counter()

    async def one(i: int) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, start + sc.offsets[i] - time.perf_counter()))
        sent = time.perf_counter()
        times: list[float] = []
        messages: list[bytes] = []
        error = None
        try:
            await clients.stream(request_body(sc.prompts[i], max_new_tokens), timeout_s, times, messages)
        except Exception as exc:  # noqa: BLE001 - a failed request is a figure, not a crash
            error = describe_error(exc)
        tokens, source = token_count(messages)
        return {"sent": sent, "times": times, "tokens": tokens, "source": source, "error": error}

    return list(await asyncio.gather(*(one(i) for i in range(sc.n))))


async def wait_serving(clients: Clients, deadline_s: float) -> None:
    """Until a 2-token request succeeds (the worker loaded the model), at most ``deadline_s`` seconds.

    Fails early when the log reports the model failing to load twice, or when 3 requests fail while
    DescribeModel shows a READY worker (the handler itself fails)."""
    server = clients.server
    deadline = time.monotonic() + deadline_s
    last, failed_ready = "", 0
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited; see {server.workdir}/server.log")
        if load_failures(server.workdir / "server.log") >= 2:
            raise RuntimeError(f"{server.name}: the model fails to load: "
                               f"{last_exception(server.workdir / 'server.log')} (see {server.workdir}/server.log)")
        messages: list[bytes] = []
        try:
            # 2 tokens: TorchServe 0.12 never answers an HTTP request that ends in its first continuous-
            # batching step (RestJob writes that "last" chunk without ever sending the response headers)
            await clients.stream(request_body("Hello", 2), 30, [], messages)
            return
        except Exception as exc:  # noqa: BLE001 - not serving yet, or the handler fails
            if messages:  # it answered (TorchServe's gRPC streams then stall: --ts-api grpc measures that)
                return
            last = describe_error(exc)
            if any(w.get("status") == "READY" for w in describe_workers(server)):
                failed_ready += 1  # the worker is up and the request still fails: the handler does
                if failed_ready >= 3:
                    raise RuntimeError(f"{server.name}: requests fail with a ready worker: "
                                       f"{last_exception(server.workdir / 'server.log') or last[:200]} "
                                       f"(see {server.workdir}/server.log)") from exc
        await asyncio.sleep(1.0)
    raise RuntimeError(f"{server.name} not serving after {deadline_s:.0f} s ({last[:200]})")


def last_exception(log: Path) -> str | None:
    """The last ``SomethingError: message`` line of a server log (a handler's traceback ends with it)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        found = re.search(r"\b(\w+(?:Error|Exception): .*)$", line)
        if found:
            return found.group(1)[:300]
    return None


def load_failures(log: Path) -> int:
    """How often a server log reports a failed model load (TorchServe's and this server's wording)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return 0
    return text.count("Load model failed") + len(re.findall(r"model \S+ failed to load", text))


def rpc_timeout(args: argparse.Namespace, n: int) -> float:
    """Deadline of one request in a scenario of ``n`` streams (``--rpc-timeout``, else 60 s + n x tokens / 2 s)."""
    return args.rpc_timeout or 60 + n * args.max_new_tokens * 0.5


async def measure_server(server: Served, scenarios: list[Scenario], args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, then each scenario with the worker's VmHWM reset before it."""
    async with Clients(server) as clients:
        await wait_serving(clients, args.start_timeout)
        pid = worker_pid(server)
        server.extra["worker_pid"] = pid
        warm = Scenario("together", min(2, max(s.n for s in scenarios)), [0.0, 0.0], scenarios[0].prompts[:2])
        warm.offsets = warm.offsets[: warm.n]
        await run_scenario(clients, warm, min(8, args.max_new_tokens), rpc_timeout(args, warm.n))
        out: dict[str, Any] = {}
        for sc in scenarios:
            reset = pid is not None and reset_peak_rss(pid)
            timeout = rpc_timeout(args, sc.n)
            requests = await asyncio.wait_for(run_scenario(clients, sc, args.max_new_tokens, timeout),
                                              timeout + max(sc.offsets) + 30)
            fig = figures(requests)
            fig["peak_rss_mib"] = peak_rss_mib(pid) if pid is not None and reset else None
            sources = {r["source"] for r in requests if r["source"]}
            fig["token_source"] = "/".join(sorted(sources)) or None
            first_error = next((r["error"] for r in requests if r["error"]), None)
            if first_error:
                fig["first_error"] = first_error[:300]
            out[sc.key] = fig
        return out


def run_server_system(name: str, scenarios: list[Scenario], args: argparse.Namespace, base: Path) -> dict[str, Any]:
    """Build the archive, start the server, measure, stop it (in ``finally``)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base))
    store = workdir / "model_store"
    if name == "before":
        build_archive(store, {"batchSize": 1}, drop=("continuousBatching", "maxBatchDelay"))
        server = start_ours(name, store, workdir, Path(args.before_tree).resolve())
    elif name == "torchserve":
        build_archive(store, CB_CONFIG)
        server = start_torchserve(store, workdir, args.ts_api)
    else:
        build_archive(store, CB_CONFIG)
        server = start_ours(name, store, workdir)
    try:
        return asyncio.run(measure_server(server, scenarios, args))
    finally:
        server.stop()


# --------------------------------------------------------------------------- report
FIGS = ("agg_tokens_per_s", "ttft_p50_s", "ttft_p90_s", "itl_p50_ms", "itl_p99_ms", "peak_rss_mib")
HIGHER_BETTER = {"agg_tokens_per_s"}


def median_runs(runs: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per system and scenario, the median of each figure over the runs that produced it."""
    merged: dict[str, dict[str, Any]] = {}
    systems = {s for run in runs for s in run}
    for system in systems:
        per = [run[system] for run in runs if system in run]
        if any("error" in p for p in per):
            errors = [p["error"] for p in per if "error" in p]
            if all("error" in p for p in per):
                merged[system] = {"error": errors[0]}
                continue
            per = [p for p in per if "error" not in p]
        keys = {k for p in per for k in p}
        merged[system] = {}
        for key in keys:
            rows = [p[key] for p in per if key in p]
            fig: dict[str, Any] = {}
            for name in (*FIGS, "tokens", "errors", "wall_s"):
                values = [r[name] for r in rows if r.get(name) is not None]
                fig[name] = round(statistics.median(values), 3) if values else None
            for name in ("token_source", "first_error"):
                found = [r[name] for r in rows if r.get(name)]
                if found:
                    fig[name] = found[0]
            fig["runs"] = len(rows)
            merged[system][key] = fig
    return merged


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b rounded, None when either is missing or b is 0."""
    return round(a / b, 3) if a is not None and b else None


def ratios(res: dict[str, dict[str, Any]], scenarios: list[Scenario]) -> dict[str, Any]:
    """ours/torchserve per figure and scenario, ours/static aggregate (together), ours(N)/ours(1) aggregate."""
    ours = res.get("ours", {})
    out: dict[str, Any] = {}
    if "error" in ours or not ours:
        return out
    ts = res.get("torchserve", {})
    static = res.get("static", {})
    base = ours.get("together/1", {}).get("agg_tokens_per_s")
    for sc in scenarios:
        mine = ours.get(sc.key, {})
        row: dict[str, Any] = {}
        if ts and "error" not in ts and sc.key in ts:
            for name in FIGS:
                row[f"{name}_vs_torchserve"] = ratio(mine.get(name), ts[sc.key].get(name))
        if static and "error" not in static and sc.key in static:
            row["agg_vs_static"] = ratio(mine.get("agg_tokens_per_s"), static[sc.key].get("agg_tokens_per_s"))
        row["agg_vs_ours_1"] = ratio(mine.get("agg_tokens_per_s"), base)
        out[sc.key] = row
    return out


def results_md_before() -> dict[str, float] | None:
    """The single-stream LLM figures recorded in RESULTS.md (tokens/s, TTFT s), if present."""
    try:
        text = RESULTS_MD.read_text()
    except OSError:
        return None
    tps = re.search(r"\(d\) LLM 64 tokens streamed, tokens/s\s+([\d.]+)", text)
    ttft = re.search(r"\(d\) LLM time to first token, s\s+([\d.]+)", text)
    if not tps or not ttft:
        return None
    return {"agg_tokens_per_s": float(tps.group(1)), "ttft_p50_s": float(ttft.group(1))}


def check_targets(res: dict[str, dict[str, Any]], scenarios: list[Scenario], top_n: int) -> list[dict[str, Any]]:
    """Issue 13's targets on the (median) figures: ``{"target", "status": met|MISSED|n/a, "detail"}``."""
    ours = res.get("ours", {}) if "error" not in res.get("ours", {}) else {}
    static = res.get("static", {}) if "error" not in res.get("static", {}) else {}
    ts = res.get("torchserve", {}) if "error" not in res.get("torchserve", {}) else {}
    together, staggered, one = f"together/{top_n}", f"staggered/{top_n}", "together/1"
    out: list[dict[str, Any]] = []

    def add(target: str, value: float | None, limit: float | None, op: str, detail: str = "") -> None:
        if value is None or limit is None:
            out.append({"target": target, "status": "n/a", "detail": detail or "not measured"})
            return
        ok = value >= limit if op == ">=" else value <= limit
        out.append({"target": target, "status": "met" if ok else "MISSED",
                    "detail": f"{value:g} {op} {limit:g}" + (f" ({detail})" if detail else "")})

    def get(system: dict[str, Any], key: str, name: str) -> float | None:
        return system.get(key, {}).get(name)

    static_agg = get(static, together, "agg_tokens_per_s")
    add(f"{top_n} together: aggregate >= 0.8x static batch", get(ours, together, "agg_tokens_per_s"),
        None if static_agg is None else round(0.8 * static_agg, 2), ">=", f"static {static_agg}")
    add(f"{top_n} together: TTFT p50 <= 1 s", get(ours, together, "ttft_p50_s"), 1.0, "<=")
    add(f"{top_n} together: TTFT p90 <= 2 s", get(ours, together, "ttft_p90_s"), 2.0, "<=")
    add(f"{top_n} together: ITL p99 <= 250 ms", get(ours, together, "itl_p99_ms"), 250.0, "<=")
    add(f"{top_n} staggered: TTFT p90 <= 1 s", get(ours, staggered, "ttft_p90_s"), 1.0, "<=")
    one_agg = get(ours, one, "agg_tokens_per_s")
    add(f"{top_n} staggered: aggregate >= 2x one stream's", get(ours, staggered, "agg_tokens_per_s"),
        None if one_agg is None else round(2 * one_agg, 2), ">=", f"one stream {one_agg}")
    before = res.get("before", {})
    if before and "error" not in before and one in before:
        base, source = before[one], "--before-tree, same run"
    else:
        base, source = results_md_before() or {}, "RESULTS.md's llm_bench figure (chat prompt of 42 tokens)"
    add("one stream: tokens/s >= 0.95x before", one_agg,
        None if base.get("agg_tokens_per_s") is None else round(0.95 * base["agg_tokens_per_s"], 2), ">=", source)
    base_ttft = base.get("ttft_p50_s")
    add("one stream: TTFT <= 1.1x before", get(ours, one, "ttft_p50_s"),
        None if base_ttft is None else round(1.1 * base_ttft, 3), "<=", source)
    rss1 = get(ours, one, "peak_rss_mib")
    add(f"worker peak RSS with {top_n} streams <= 1.5x with one", get(ours, together, "peak_rss_mib"),
        None if rss1 is None else round(1.5 * rss1, 1), "<=", f"one stream {rss1} MiB")
    for name in FIGS:
        pairs = [(sc.key, get(ours, sc.key, name), get(ts, sc.key, name)) for sc in scenarios]
        pairs = [(k, a, b) for k, a, b in pairs if a is not None and b is not None]
        target = f"ahead of TorchServe: {name}"
        if not pairs:
            out.append({"target": target, "status": "n/a", "detail": "not measured"})
            continue
        better = [(a > b) if name in HIGHER_BETTER else (a < b) for _, a, b in pairs]
        behind = [f"{k} {a:g} vs {b:g}" for (k, a, b), ok in zip(pairs, better, strict=True) if not ok]
        out.append({"target": target, "status": "met" if all(better) else "MISSED",
                    "detail": f"{len(pairs) - len(behind)}/{len(pairs)} scenarios"
                    + (f"; behind: {', '.join(behind)}" if behind else "")})
    return out


def fmt(value: Any, width: int, digits: int) -> str:
    """Right-aligned number or ``-``."""
    if value is None:
        return f"{'-':>{width}}"
    return f"{value:>{width}.{digits}f}"


def print_report(res: dict[str, dict[str, Any]], scenarios: list[Scenario], args: argparse.Namespace,
                 notes: list[str]) -> None:
    """The table, ratios, targets and the JSON line."""
    print(f"SmolLM2-135M-Instruct, {args.max_new_tokens} tokens per stream (ignore_eos, greedy), "
          f"{'median of ' + str(args.runs) + ' runs' if args.runs > 1 else '1 run'}, this machine")
    for note in notes:
        print(f"note: {note}")
    head = (f"{'system':<11}{'arrival':<10}{'N':>3}{'agg tok/s':>11}{'TTFT p50':>10}{'TTFT p90':>10}"
            f"{'ITL p50ms':>11}{'ITL p99ms':>11}{'RSS MiB':>9}{'tokens':>8}{'err':>5}")
    print(head)
    print("-" * len(head))
    for system in args.systems:
        rows = res.get(system)
        if rows is None:
            continue
        if "error" in rows:
            print(f"{system:<11}failed: {rows['error']}")
            continue
        for sc in scenarios:
            r = rows.get(sc.key)
            if r is None:
                continue
            print(f"{system:<11}{sc.arrival:<10}{sc.n:>3}{fmt(r['agg_tokens_per_s'], 11, 2)}"
                  f"{fmt(r['ttft_p50_s'], 10, 3)}{fmt(r['ttft_p90_s'], 10, 3)}{fmt(r['itl_p50_ms'], 11, 1)}"
                  f"{fmt(r['itl_p99_ms'], 11, 1)}{fmt(r['peak_rss_mib'], 9, 0)}{fmt(r['tokens'], 8, 0)}"
                  f"{fmt(r['errors'], 5, 0)}")
            if r.get("first_error"):
                print(f"{'':24}first error: {r['first_error'][:150]}")
    rat = ratios(res, scenarios)
    if rat:
        print("\nratios (ours / other; tokens/s: higher is better, the rest: lower is better)")
        print(f"{'arrival':<10}{'N':>3}{'agg/TS':>8}{'TTFT50/TS':>10}{'TTFT90/TS':>10}{'ITL50/TS':>9}"
              f"{'ITL99/TS':>9}{'RSS/TS':>8}{'agg/static':>11}{'agg/ours(1)':>12}")
        for sc in scenarios:
            r = rat.get(sc.key, {})
            cells = [r.get(f"{n}_vs_torchserve") for n in FIGS]
            print(f"{sc.arrival:<10}{sc.n:>3}{fmt(cells[0], 8, 2)}{fmt(cells[1], 10, 2)}{fmt(cells[2], 10, 2)}"
                  f"{fmt(cells[3], 9, 2)}{fmt(cells[4], 9, 2)}{fmt(cells[5], 8, 2)}"
                  f"{fmt(r.get('agg_vs_static'), 11, 2)}{fmt(r.get('agg_vs_ours_1'), 12, 2)}")
    top_n = max(s.n for s in scenarios)
    targets = check_targets(res, scenarios, top_n)
    print(f"\ntargets (issue 13; the full ones need N up to 8 and 64 tokens: this run has N up to {top_n}, "
          f"{args.max_new_tokens} tokens)")
    for t in targets:
        print(f"{t['status']:<7} {t['target']}: {t['detail']}")
    print(json.dumps({"scenario": "llm_concurrency", "runs": args.runs, "max_new_tokens": args.max_new_tokens,
                      "concurrency": args.concurrency, "mean_gap_s": args.mean_gap, "seed": args.seed,
                      "ts_api": args.ts_api, "results": res, "ratios": rat, "targets": targets, "notes": notes}))


# --------------------------------------------------------------------------- main
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
    parser.add_argument("--child", choices=("hf_cb", "static"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
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
