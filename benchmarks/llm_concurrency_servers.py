"""llm_concurrency.py's served systems: the archive, this server and TorchServe started and
stopped, their clients (gRPC StreamPredictions, TorchServe's chunked HTTP), and one scenario
measured against a started server."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from common import (
    ROOT,
    WORKER_MARKERS,
    Server,
    peak_rss_mib,
    reset_peak_rss,
    start_project,
    start_torchserve,
)
from llm_concurrency_plan import CB_CONFIG, MODEL, Scenario, figures, request_body, token_count


def build_archive(store: Path, config: dict[str, Any], drop: tuple[str, ...] = (),
                  handler: dict[str, Any] | None = None) -> Path:
    """``scripts/build_llm_archive`` into ``store``, then its model-config.yaml updated with ``config``
    (keys in ``drop`` removed) and its ``handler`` section with ``handler``. Returns the archive path."""
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
    if handler:
        model_config["handler"] = {**(model_config.get("handler") or {}), **handler}
    entries[config_name] = ("# scripts/build_llm_archive's config as set by benchmarks/llm_concurrency.py\n"
                            + yaml.safe_dump(model_config, sort_keys=False)).encode()
    tmp = archive.with_suffix(".mar.tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for name, data in entries.items():
            dst.writestr(name, data)
    os.replace(tmp, archive)
    return archive


def start_ours(name: str, store: Path, workdir: Path, tree: Path | None = None) -> Server:
    """This server (or the one of checkout ``tree``) in the foreground, ports 0, token authorization on."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if tree is not None:
        env["PYTHONPATH"] = str(tree / "src")
    return start_project(name, store, workdir, [f"{MODEL}={MODEL}.mar"], env=env)


def start_ts(store: Path, workdir: Path, transport: str) -> Server:
    """TorchServe 0.12.0 serving the archive (one worker, no tokens), called over ``transport``."""
    return start_torchserve(store, workdir, f"{MODEL}={MODEL}.mar", env=dict(os.environ, HF_HUB_OFFLINE="1"),
                            transport=transport)


def describe_workers(server: Server) -> list[dict[str, Any]]:
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


def worker_pid(server: Server) -> int | None:
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
async def grpc_stream(stub: Any, server: Server, body: bytes, timeout_s: float, times: list[float],
                      messages: list[bytes]) -> None:
    """One StreamPredictions; appends each message and its arrival time (kept when the call then fails)."""
    from inference_service._proto import inference_pb2

    call = stub.StreamPredictions(inference_pb2.PredictionsRequest(model_name=MODEL, input={"data": body}),
                                  timeout=timeout_s, metadata=server.metadata)
    async for response in call:
        times.append(time.perf_counter())
        messages.append(response.prediction)


async def http_stream(session: Any, server: Server, body: bytes, timeout_s: float, times: list[float],
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

    def __init__(self, server: Server) -> None:
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


async def measure_server(server: Server, scenarios: list[Scenario], args: argparse.Namespace) -> dict[str, Any]:
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
        server = start_ts(store, workdir, args.ts_api)
    else:
        build_archive(store, CB_CONFIG, handler=dict(args.handler_config))
        server = start_ours(name, store, workdir)
    try:
        return asyncio.run(measure_server(server, scenarios, args))
    finally:
        server.stop()
