"""Shared fixtures: build model archives, run the real server as a subprocess.

Every test talks to a real ``inference-service`` process (started with
``--foreground --ncs`` on ephemeral ports in a temporary working directory)
whose models run in real worker processes.

Tests wait for the state they need (:func:`wait_for`, :meth:`ServerProcess.wait_described`,
:meth:`ServerProcess.wait_workers`) under a deadline; a sleep is never a synchronisation
point, and wall-clock bounds are generous (the suite shares two cores with other work).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from inference_service._proto import (
    inference_pb2,
    inference_pb2_grpc,
    management_pb2,
    management_pb2_grpc,
)

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent
HANDLERS = Path(__file__).resolve().parent / "handlers"
BIN = Path(sys.executable).parent
ARCHIVER = str(BIN / "torch-model-archiver")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``scripts/test`` runs ``--dist loadgroup``) a module's tests run in one
    worker process, so its module fixtures start one server, not one per worker; modules that share
    a session fixture's server name one ``xdist_group`` of their own."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


def wait_for(predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.05,
             what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy, and return that.

    Args:
        predicate: called at once, then every ``interval`` s; its exceptions propagate.
        timeout: seconds before giving up.
        what: names the awaited state in the failure message.

    Raises:
        AssertionError: ``timeout`` s passed (the message names ``what``).
    """
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"{what}: not reached within {timeout}s"
        time.sleep(interval)
    return result


def build_mar(store: Path, name: str, handler: str, *, version: str = "1.0", extra_files: list[str] = (),
              serialized: str | None = None, model_file: str | None = None, config: str | None = None,
              archive_format: str = "default") -> str:
    """Archive handler files from tests/handlers with torch-model-archiver 0.12.0; returns the url."""
    # module:function entry points are passed as-is: the archiver copies module.py
    # from its working directory (tests/handlers).
    handler_arg = handler if ":" in handler else str(HANDLERS / handler)
    cmd = [ARCHIVER, "--model-name", name, "--version", version, "--handler", handler_arg,
           "--export-path", str(store), "--force", "--archive-format", archive_format]
    if extra_files:
        cmd += ["--extra-files", ",".join(str(HANDLERS / f) if (HANDLERS / f).exists() else f for f in extra_files)]
    if serialized:
        cmd += ["--serialized-file", serialized]
    if model_file:
        cmd += ["--model-file", str(HANDLERS / model_file)]
    if config:
        cmd += ["--config-file", config]
    # the archiver stages files in $TMPDIR/<model name> and removes that folder after: pytest workers
    # archiving the same name at once would take each other's files, so each call gets its own TMPDIR
    with tempfile.TemporaryDirectory(prefix="archiver-") as staging:
        subprocess.run(cmd, check=True, capture_output=True, timeout=60, cwd=HANDLERS,
                       env={**os.environ, "TMPDIR": staging})
    suffix = {"default": ".mar", "tgz": ".tar.gz", "no-archive": ""}[archive_format]
    return name + suffix


def build_dir(store: Path, dirname: str, handler_file: str, *, model_name: str, version: str = "1.0",
              config_yaml: str | None = None, handler_entry: str | None = None) -> str:
    """An unpacked (no-archive) model directory in the store; returns the url."""
    target = store / dirname
    if target.exists():
        shutil.rmtree(target)
    (target / "MAR-INF").mkdir(parents=True)
    shutil.copy(HANDLERS / handler_file, target / handler_file)
    model: dict[str, Any] = {"modelName": model_name, "handler": handler_entry or handler_file,
                             "modelVersion": version}
    if config_yaml is not None:
        (target / "model-config.yaml").write_text(config_yaml)
        model["configFile"] = "model-config.yaml"
    (target / "MAR-INF" / "MANIFEST.json").write_text(json.dumps({"runtime": "python", "model": model}))
    return dirname


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method: str, timeout: float | None, metadata: Any, credentials: Any,
                 wait_for_ready: bool | None, compression: Any) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


class BearerAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <key>`` from the server's key_file.json to every call.

    The file is read at each call (keys rotate; a restarted server writes new
    ones); a call that already carries ``authorization`` metadata is left alone,
    and without a key file (token authorization off) nothing is added.
    """

    def __init__(self, key_file: Path, scope: str) -> None:
        self.key_file = key_file
        self.scope = scope

    def _with_key(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = list(details.metadata or [])
        if not any(k == "authorization" for k, _ in metadata):
            try:
                metadata.append(("authorization", f"Bearer {read_key(self.key_file, self.scope)}"))
            except (OSError, ValueError, KeyError):
                pass
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_key(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_key(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_key(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._with_key(details), request_iterator)


def read_key(key_file: Path, scope: str) -> str:
    """The ``scope`` ("inference" / "management") key of a key_file.json."""
    return json.loads(key_file.read_text())[scope]["key"]


def auth_metadata(key_file: Path, scope: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the ``scope`` key of ``key_file`` (for raw stubs)."""
    return (("authorization", f"Bearer {read_key(key_file, scope)}"),)


def _descendants(pid: int) -> set[int]:
    out: set[int] = set()
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for child in map(int, children):
        out |= {child} | _descendants(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


class ServerProcess:
    """A real server subprocess and gRPC stubs to it.

    Token authorization is on (the server's default): ``channel`` / ``mchannel``
    (and so ``inference`` / ``management``) send the inference / management key
    of ``<workdir>/key_file.json``, re-read at every call. ``credentials`` makes
    them TLS channels.
    """

    def __init__(self, workdir: Path, store: Path, args: list[str], env: dict[str, str] | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.workdir = workdir
        self.store = store
        self.credentials = credentials
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "server.log"
        cmd = [sys.executable, "-m", "inference_service", "--foreground", "--ncs",
               "--grpc-inference-port", "0", "--grpc-management-port", "0", "--http-port", "0",
               "--http-management-port", "0", "--metrics-port", "0", "--model-store", str(store), *args]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, cwd=workdir, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self._connect()

    def _connect(self) -> None:
        """Wait for the status file, then open channels and stubs to the reported ports."""
        self.status = self._wait_status(30.0)
        self.inference_port = self.status["inference_port"]
        self.management_port = self.status["management_port"]
        self.channel = self.open_channel(self.inference_port, "inference")
        self.mchannel = self.open_channel(self.management_port, "management")
        self.inference = inference_pb2_grpc.InferenceAPIsServiceStub(self.channel)
        self.management = management_pb2_grpc.ManagementAPIsServiceStub(self.mchannel)
        self.worker_pids_seen: set[int] = set()

    @property
    def key_file(self) -> Path:
        """``<workdir>/key_file.json``, written by the server (token authorization on)."""
        return self.workdir / "key_file.json"

    def open_channel(self, port: int, scope: str | None) -> grpc.Channel:
        """A channel to 127.0.0.1:``port`` (TLS with ``credentials``), sending the ``scope`` key if given."""
        target = f"127.0.0.1:{port}"
        credentials = getattr(self, "credentials", None)
        channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
        return grpc.intercept_channel(channel, BearerAuth(self.key_file, scope)) if scope else channel

    def _wait_status(self, timeout: float) -> dict[str, Any]:
        path = self.workdir / ".inference_service" / "status.json"

        def started() -> dict[str, Any] | None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                return None
            return data if data.get("pid") == self.proc.pid else None

        try:
            return wait_for(started, timeout, 0.02, "server status file")
        except AssertionError:
            raise TimeoutError(f"server did not start within {timeout}s:\n{self.log()}") from None

    def log(self) -> str:
        """The server's output so far."""
        return self.log_path.read_text(errors="replace")

    # --- helpers -------------------------------------------------------------
    def predict(self, model: str, body: bytes | str, version: str = "", timeout: float = 30,
                **inputs: bytes) -> bytes:
        data = body.encode() if isinstance(body, str) else body
        req = inference_pb2.PredictionsRequest(model_name=model, model_version=version,
                                               input={"data": data, **inputs})
        return self.inference.Predictions(req, timeout=timeout).prediction

    def stream(self, model: str, body: bytes | str, timeout: float = 30) -> list[bytes]:
        data = body.encode() if isinstance(body, str) else body
        req = inference_pb2.PredictionsRequest(model_name=model, input={"data": data})
        return [r.prediction for r in self.inference.StreamPredictions(req, timeout=timeout)]

    def register(self, url: str, timeout: float = 120, **fields: Any) -> str:
        fields.setdefault("synchronous", True)
        fields.setdefault("initial_workers", 1)
        req = management_pb2.RegisterModelRequest(url=url, **fields)
        return self.management.RegisterModel(req, timeout=timeout).msg

    def unregister(self, name: str, version: str = "") -> str:
        req = management_pb2.UnregisterModelRequest(model_name=name, model_version=version)
        return self.management.UnregisterModel(req, timeout=30).msg

    def describe(self, name: str, version: str = "") -> list[dict[str, Any]]:
        req = management_pb2.DescribeModelRequest(model_name=name, model_version=version)
        return json.loads(self.management.DescribeModel(req, timeout=30).msg)

    def scale(self, name: str, min_worker: int, version: str = "", synchronous: bool = True) -> str:
        req = management_pb2.ScaleWorkerRequest(model_name=name, model_version=version, min_worker=min_worker,
                                                max_worker=min_worker, synchronous=synchronous)
        return self.management.ScaleWorker(req, timeout=60).msg

    def wait_described(self, name: str, predicate: Callable[[dict[str, Any]], Any], timeout: float = 30,
                       what: str = "", version: str = "") -> dict[str, Any]:
        """Poll DescribeModel until ``predicate(description)`` holds for the model's (default)
        version; returns that description. A model not registered yet (NOT_FOUND) is waited for.

        Raises:
            AssertionError: ``timeout`` s passed (with the last description).
        """
        last: list[dict[str, Any]] = []

        def check() -> dict[str, Any] | None:
            try:
                desc = self.describe(name, version)[0]
            except grpc.RpcError as err:  # a startup model is registered just after the server listens
                if err.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                return None
            last[:] = [desc]
            return desc if predicate(desc) else None

        try:
            return wait_for(check, timeout, 0.05, what or f"{name} described as wanted")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last description: {last}") from None

    def wait_workers(self, name: str, count: int, timeout: float = 30) -> list[dict[str, Any]]:
        """Wait until ``count`` workers of the model are READY; returns them."""
        desc = self.wait_described(
            name, lambda d: len([w for w in d["workers"] if w["status"] == "READY"]) == count, timeout,
            f"{name}: {count} READY workers")
        return [w for w in desc["workers"] if w["status"] == "READY"]

    def wait_busy(self, name: str, count: int = 1, pending: int = 0, timeout: float = 30) -> dict[str, Any]:
        """Wait until ``count`` workers of the model are BUSY and ``pending`` requests wait in its
        job queue (DescribeModel's ``jobQueueStatus``); returns the description."""
        return self.wait_described(
            name, lambda d: (len([w for w in d["workers"] if w["status"] == "BUSY"]) == count
                             and d["jobQueueStatus"]["pendingRequests"] == pending),
            timeout, f"{name}: {count} BUSY workers and {pending} queued requests")

    def worker_pids(self) -> set[int]:
        return _descendants(self.proc.pid)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, wait for exit; asserts no worker process outlives the server."""
        pids = self.worker_pids()
        self.channel.close()
        self.mchannel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        finally:
            self._log.close()
        try:
            wait_for(lambda: not any(_alive(p) for p in pids), 5.0, 0.05, "worker processes exit")
        except AssertionError:
            pass
        orphans = [p for p in pids if _alive(p)]
        assert not orphans, f"worker processes outlived the server: {orphans}"
        return code


@contextlib.contextmanager
def serving(work: Path, store: Path, models: Sequence[str], timeout: float = 600.0) -> Iterator[ServerProcess]:
    """A server on ``store`` with ``models`` (each ``<name>.mar``) started, each with a worker up
    within ``timeout`` s; stopped cleanly on exit."""
    srv = ServerProcess(work, store, ["--models", *(f"{name}={name}.mar" for name in models)])
    try:
        for name in models:
            srv.wait_workers(name, 1, timeout=timeout)
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def doubler_weights(path: Path) -> Path:
    """Save the Doubler's state dict (``handlers/doubler_model.py``, weight 2 * identity: y = 2x)
    to ``path``; returns ``path``."""
    import torch

    sys.path.insert(0, str(HANDLERS))
    try:
        from doubler_model import Doubler
    finally:
        sys.path.remove(str(HANDLERS))
    model = Doubler()
    with torch.no_grad():
        model.linear.weight.copy_(torch.eye(2) * 2)
    torch.save(model.state_dict(), path)
    return path


@pytest.fixture(scope="session")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model store with the test handlers archived by torch-model-archiver and as directories."""
    path = tmp_path_factory.mktemp("model_store")
    build_mar(path, "echo", "echo_handler.py")
    build_mar(path, "echo_tgz", "echo_handler.py", archive_format="tgz")
    build_mar(path, "fn", "function_handler:handle")
    build_mar(path, "gen", "generator_handler.py")
    build_mar(path, "broken", "failing_handler.py")
    (path / "seq-config.yaml").write_text("sequenceBatching: true\nmaxNumSequence: 8\nminWorkers: 2\nmaxWorkers: 2\n")
    build_mar(path, "seq", "sequence_handler.py", config=str(path / "seq-config.yaml"))
    build_mar(path, "echo_v2", "echo_handler.py", version="2.0")
    build_dir(path, "echo_dir", "echo_handler.py", model_name="echo_dir",
              config_yaml="batchSize: 4\nmaxBatchDelay: 5000\nminWorkers: 1\nmaxWorkers: 1\ncustom:\n  answer: 42\n")
    weights = doubler_weights(path / "doubler.pt")  # the BaseHandler test model: y = 2x
    build_mar(path, "doubler", "base_subclass_handler.py", serialized=str(weights), model_file="doubler_model.py")
    weights.unlink()
    return path


def _echo_server(store: Path, workdir: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(workdir, store, ["--enable-model-api", "--models", "echo=echo.mar", "--workers-per-model", "2"])
    try:
        srv.wait_workers("echo", 2)
        yield srv
    finally:
        code = srv.stop()
        assert code == 0, srv.log()


@pytest.fixture(scope="module")
def server(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with the model API enabled and the echo model (2 workers) loaded at startup, the
    module's own: its tests may register, scale and unregister models, or renew keys."""
    yield from _echo_server(store, tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="session")
def shared_server(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The same server as ``server``, one a session (per test process) for the modules that only
    read: they never change its models, workers or keys, and read its log from an offset or for
    their own lines. Such a module says so with a ``server`` fixture returning this one."""
    yield from _echo_server(store, tmp_path_factory.mktemp("shared_server"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Llama with SmolLM2's tokenizer (tests/llm_models.py), made once a session."""
    from llm_models import tiny_model_dir

    from inference_service.llm.model import prepare_gguf

    # the bundled GGUF's converted directory (converted once, into the user's cache) has the tokenizer
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama", prepare_gguf())


@pytest.fixture(scope="session")
def tiny_ir(tiny_llama: Path) -> Path:
    """The tiny Llama as fp32 OpenVINO IR, in the user's IR cache (content-keyed: converted once a
    machine, not once a run)."""
    from inference_service.llm.openvino_ir import prepare_ir

    return prepare_ir(tiny_llama, "fp32")[0]


@pytest.fixture(scope="session")
def llm_archives(tmp_path_factory: pytest.TempPathFactory):
    """``llm_archives.build(store, *args)``: an LLM archive built once a session per command line
    (tests/llm_models.py ``ArchiveCache``), copied into ``store``."""
    from llm_models import ArchiveCache

    return ArchiveCache(tmp_path_factory.mktemp("llm_archives"))


@pytest.fixture(scope="session")
def llm_server(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, llm_archives):
    """The real SmolLM2 (one worker) beside four archives of the tiny Llama: ``tiny`` (the bundled
    archive's continuous-batching form), ``tiny_gen`` (the generator handler), ``tiny_torch`` (the
    torch engine) and ``tiny_fp32`` (the OpenVINO engine on fp32 weights). One server a session,
    shared by tests/e2e/test_llm_server.py and test_openai_llm.py."""
    store = tmp_path_factory.mktemp("llm_store")
    llm_archives.build(store)  # converts the GGUF once (cached), writes smollm2.mar
    tiny = ("--model-path", str(tiny_llama))
    llm_archives.build(store, *tiny, "--name", "tiny")
    llm_archives.build(store, *tiny, "--name", "tiny_gen", "--generator")
    llm_archives.build(store, *tiny, "--name", "tiny_torch", "--engine", "torch")
    llm_archives.build(store, *tiny, "--name", "tiny_fp32", "--weight-format", "fp32")
    srv = ServerProcess(tmp_path_factory.mktemp("llm_work"), store,
                        ["--models", "smollm2=smollm2.mar", "tiny=tiny.mar", "tiny_gen=tiny_gen.mar",
                         "tiny_torch=tiny_torch.mar", "tiny_fp32=tiny_fp32.mar"])
    try:
        for name in ("smollm2", "tiny", "tiny_gen", "tiny_torch", "tiny_fp32"):
            srv.wait_workers(name, 1, timeout=600)
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()
