"""Servers of benchmarks/llm_peers.py: start and stop this project, llama.cpp's llama-server
(F32 and Q4_1 GGUF) and ``transformers serve``, each with an OpenAI-compatible streaming API.

Every server runs in its own process group with ``threads`` intra-op threads and is stopped
with SIGTERM (SIGKILL after 30 s). :func:`tree_stats` reads the RSS and thread count of all
the server's processes. The peers come from ``benchmarks/build_llama_server.sh`` (under
``.cache/``); :func:`missing_peers` says which are not built.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / ".cache" / "llama"
HF_SITE = ROOT / ".cache" / "hf-serve-site"
PEER_FILES = {
    "llama_f32": (LLAMA / "llama-server", LLAMA / "smollm2-f32.gguf"),
    "llama_q4": (LLAMA / "llama-server", LLAMA / "smollm2-q4_1.gguf"),
    "hf_serve": (HF_SITE / "fastapi",),
}


@dataclass
class Running:
    """A started server: its process group leader, OpenAI base URL, model name, headers."""

    name: str
    proc: subprocess.Popen[bytes]
    base_url: str
    model: str
    headers: dict[str, str]
    log: Path
    start_s: float = 0.0

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after 30 s."""
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def missing_peers(names: list[str]) -> list[str]:
    """The peers of ``names`` whose files benchmarks/build_llama_server.sh has not made."""
    return [n for n in names if n in PEER_FILES and not all(p.exists() for p in PEER_FILES[n])]


def _spawn(name: str, argv: list[str], workdir: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    log = workdir / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=workdir, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    return proc, log


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, deadline_s: float,
               headers: dict[str, str] | None = None, body: bytes | None = None) -> None:
    """Poll ``url`` until it answers 200; RuntimeError with the log's tail if the process exits
    or the deadline passes."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            request = urllib.request.Request(url, data=body,
                                             headers={"Content-Type": "application/json", **(headers or {})})
            with urllib.request.urlopen(request, timeout=60) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise RuntimeError(f"{url} did not answer (exit {proc.poll()}):\n{tail}")


#: ``ours_<variant>``: the archive's build options and handler config on top of the default archive.
OUR_VARIANTS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "": ([], {}),
    "fp32_ov": (["--weight-format", "fp32"], {}),
    "torch": (["--engine", "torch"], {}),
    "torch_active": (["--engine", "torch"], {"omp_wait_policy": "active"}),
    "torch_passive": (["--engine", "torch"], {"omp_wait_policy": "passive"}),
    "torch_bounded": (["--engine", "torch"], {"omp_wait_policy": "bounded"}),
    "torch_bounded100k": (["--engine", "torch"], {"omp_wait_policy": "bounded", "omp_spin_count": 100000}),
}


def start_ours(workdir: Path, threads: int, variant: str = "") -> Running:
    """This server with the bundled archive (scripts/build_llm_archive) in one of
    :data:`OUR_VARIANTS`, one worker of ``threads`` threads; OpenAI API on its HTTP port."""
    import yaml

    store = workdir / "store"
    options, overrides = OUR_VARIANTS[variant]
    argv = [sys.executable, str(ROOT / "scripts" / "build_llm_archive"), "--model-store", str(store), *options]
    subprocess.run(argv, check=True, capture_output=True, timeout=900)
    # the worker's thread count as for the peers (worker_threads would do the same server-wide)
    import zipfile

    archive = store / "smollm2.mar"
    with zipfile.ZipFile(archive) as src:
        entries = {n: src.read(n) for n in src.namelist()}
    config = yaml.safe_load(entries["model-config.yaml"])
    config["handler"]["torch_threads"] = threads
    config["handler"].update(overrides)
    entries["model-config.yaml"] = yaml.safe_dump(config, sort_keys=False).encode()
    with zipfile.ZipFile(archive, "w") as dst:
        for n, data in entries.items():
            dst.writestr(n, data)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT / "src"))
    started = time.perf_counter()
    proc, log = _spawn("ours", [sys.executable, "-m", "inference_service", "--foreground", "--ncs",
                                "--model-store", str(store), "--models", "smollm2=smollm2.mar",
                                "--grpc-inference-port", "0", "--grpc-management-port", "0",
                                "--http-port", "0", "--http-management-port", "0", "--metrics-port", "0"],
                       workdir, env)
    status = workdir / ".inference_service" / "status.json"
    deadline = time.monotonic() + 300
    info: dict[str, Any] = {}
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            info = json.loads(status.read_text())
            if info.get("http_port") and (workdir / "key_file.json").exists():
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    if not info.get("http_port"):
        raise RuntimeError(f"this server did not start:\n{log.read_text(errors='replace')[-2000:]}")
    key = json.loads((workdir / "key_file.json").read_text())["inference"]["key"]
    headers = {"Authorization": f"Bearer {key}"}
    base = f"http://127.0.0.1:{info['http_port']}"
    body = json.dumps({"model": "smollm2", "prompt": "Hi", "max_tokens": 1}).encode()
    _wait_http(f"{base}/v1/completions", proc, log, 300, headers, body)
    return Running("ours", proc, base, "smollm2", headers, log, time.perf_counter() - started)


def start_llama(name: str, workdir: Path, threads: int, slots: int = 8) -> Running:
    """llama-server on the F32 (``llama_f32``) or Q4_1 (``llama_q4``) GGUF: ``slots`` parallel
    sequences with continuous batching, ``threads`` threads for decode and for prefill."""
    binary, gguf = PEER_FILES[name]
    port = free_port()
    started = time.perf_counter()
    proc, log = _spawn(name, [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                              "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(512 * slots),
                              "--no-webui"], workdir, dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    _wait_http(f"{base}/health", proc, log, 300)
    return Running(name, proc, base, "smollm2", {}, log, time.perf_counter() - started)


def start_hf_serve(workdir: Path, threads: int, model_dir: Path) -> Running:
    """``transformers serve --continuous-batching`` with the fp32 model folder preloaded
    (FastAPI and Uvicorn from ``.cache/hf-serve-site``)."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join([str(HF_SITE), str(ROOT / "src")]))
    started = time.perf_counter()
    proc, log = _spawn("hf_serve", [str(Path(sys.executable).parent / "transformers"), "serve", str(model_dir),
                                    "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
                                    "--device", "cpu"], workdir, env)
    base = f"http://127.0.0.1:{port}"
    body = json.dumps({"model": str(model_dir), "messages": [{"role": "user", "content": "Hi"}],
                       "max_tokens": 1}).encode()
    _wait_http(f"{base}/v1/chat/completions", proc, log, 300, None, body)
    return Running("hf_serve", proc, base, str(model_dir), {}, log, time.perf_counter() - started)


def tree_stats(pid: int) -> dict[str, float]:
    """RSS (MiB) and threads summed over ``pid`` and its descendants."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {"rss_mib": 0.0, "threads": 0}
    rss = threads = 0
    for proc in procs:
        try:
            rss += proc.memory_info().rss
            threads += proc.num_threads()
        except psutil.NoSuchProcess:
            continue
    return {"rss_mib": round(rss / 2**20, 1), "threads": threads}


class Spinner:
    """One process spinning on the CPU (a busy neighbour core) while the block runs."""

    def __enter__(self) -> Spinner:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait(10)
