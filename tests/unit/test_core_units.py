"""Unit tests of the pure pieces (IPC framing, config resolution, archive safety, status mapping) and
of the core's request lifecycle, stats view and health updates against stand-in models."""

from __future__ import annotations

import asyncio
import io
import json
import tarfile
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from inference_service.archive.model_archive import open_archive
from inference_service.config import ConfigError, Settings, apply_properties
from inference_service.contracts import wire
from inference_service.dispatch.jobs import Job, Kind
from inference_service.dispatch.supervisor import WorkerState
from inference_service.errors import InvalidArgument, NotFound, ResourceExhausted, grpc_code_for_http
from inference_service.frontends.grpc.health import NOT_SERVING, READINESS, Health
from inference_service.handler.encoding import encode_response
from inference_service.observability.metrics import ServerMetrics, Telemetry
from inference_service.serving.core import InferenceCore
from inference_service.serving.model_config import ModelConfig
from inference_service.serving.registration import ModelEntry, newest_version, version_key
from inference_service.serving.sleep import SleepState


def test_batch_frame_roundtrip():
    reqs = [wire.Request("a1", {"data": b"\x00\xffxyz", "other": b""}, {"h": "v"}, None),
            wire.Request("b2", {"body": b"hello", "file": b"{}"}, {}, "ts-seq-1",
                         {"body": "text/plain", "file": "application/json"})]
    frame = wire.encode_batch(reqs)
    length, kind = wire.HEADER.unpack_from(frame)
    assert kind == wire.BATCH and length == len(frame) - wire.HEADER.size + 1
    decoded = wire.decode_batch(frame[wire.HEADER.size:])
    assert decoded == [("a1", None, {"h": "v"}, {"data": bytearray(b"\x00\xffxyz"), "other": bytearray()}, {}),
                       ("b2", "ts-seq-1", {}, {"body": bytearray(b"hello"), "file": bytearray(b"{}")},
                        {"body": "text/plain", "file": "application/json"})]
    assert isinstance(decoded[0].inputs["data"], bytearray)


def test_malformed_batch_frame_raises():
    with pytest.raises(wire.ProtocolError):
        wire.decode_batch(b"\x00\x00\x00\x05{bad}")


def test_response_and_error_frames_roundtrip():
    body = wire.encode_response(wire.CHUNK, "rid", b"payload")[wire.HEADER.size:]
    assert wire.decode_response(body) == ("rid", b"payload")
    body = wire.encode_error("rid", 13, "bad \u00e9")[wire.HEADER.size:]
    assert wire.decode_error(body) == ("rid", 13, "bad \u00e9", 0)
    body = wire.encode_error("rid", 10, "conflict", 409)[wire.HEADER.size:]
    assert wire.decode_error(body) == ("rid", 10, "conflict", 409)


@pytest.mark.parametrize("status,code", [
    (400, grpc.StatusCode.INVALID_ARGUMENT), (404, grpc.StatusCode.NOT_FOUND),
    (503, grpc.StatusCode.UNAVAILABLE), (507, grpc.StatusCode.INTERNAL),
    (401, grpc.StatusCode.UNAUTHENTICATED), (403, grpc.StatusCode.PERMISSION_DENIED),
    (409, grpc.StatusCode.ABORTED), (413, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (429, grpc.StatusCode.RESOURCE_EXHAUSTED), (416, grpc.StatusCode.OUT_OF_RANGE),
    (499, grpc.StatusCode.CANCELLED), (501, grpc.StatusCode.UNIMPLEMENTED),
    (504, grpc.StatusCode.DEADLINE_EXCEEDED), (418, grpc.StatusCode.FAILED_PRECONDITION),
    (500, grpc.StatusCode.INTERNAL), (599, grpc.StatusCode.INTERNAL), (250, grpc.StatusCode.OK),
    (700, grpc.StatusCode.UNKNOWN),
])
def test_http_status_table(status, code):
    assert grpc_code_for_http(status) == code


def test_encode_response_forms():
    assert encode_response("é") == "é".encode()
    assert encode_response(b"\x01") == b"\x01"
    assert encode_response(bytearray(b"ab")) == b"ab"
    assert json.loads(encode_response({"a": [1, 2]})) == {"a": [1, 2]}
    assert encode_response(None) == b""
    import torch

    assert json.loads(encode_response(torch.tensor([[1, 2]]))) == [[1, 2]]
    with pytest.raises(TypeError):
        encode_response(object())


def test_model_config_precedence_and_validation():
    yaml_config = {"batchSize": 4, "maxBatchDelay": 50, "minWorkers": 2, "maxWorkers": 3, "responseTimeout": 9}
    config = ModelConfig.resolve(yaml_config, {"batch_size": 8, "max_batch_delay_ms": 0},
                                 {"response_timeout_s": 120})
    assert (config.batch_size, config.max_batch_delay_ms, config.min_workers, config.max_workers,
            config.response_timeout_s) == (8, 50, 2, 3, 9)
    defaults = ModelConfig.resolve({}, {})
    assert (defaults.batch_size, defaults.max_batch_delay_ms, defaults.response_timeout_s,
            defaults.startup_timeout_s, defaults.min_workers) == (1, 100, 120, 120, 0)
    with pytest.raises(InvalidArgument, match="batch_size"):
        ModelConfig.resolve({"batchSize": 0}, {})
    with pytest.raises(InvalidArgument, match="max_batch_delay_ms"):
        ModelConfig.resolve({"maxBatchDelay": "soon"}, {})
    with pytest.raises(InvalidArgument):
        ModelConfig.resolve({"minWorkers": 1.5}, {})


def test_properties_parsing():
    settings = Settings()
    unsupported = apply_properties(settings, {"grpc_inference_port": "9090", "job_queue_size": "5",
                                              "load_models": "a.mar, b=b.mar", "vmargs": "-Xmx1g"}, "test")
    assert settings.inference_port == 9090 and settings.job_queue_size == 5
    assert settings.load_models == ["a.mar", "b=b.mar"]
    assert unsupported == ["vmargs"]
    with pytest.raises(ConfigError, match="grpc_management_port"):
        apply_properties(Settings(), {"grpc_management_port": "x"}, "test")


def _zip(path: Path, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)


MANIFEST = json.dumps({"model": {"modelName": "m", "handler": "h.py", "modelVersion": "2.1"}}).encode()


def test_open_zip_archive(tmp_path):
    store, extract = tmp_path / "store", tmp_path / "extract"
    store.mkdir()
    _zip(store / "m.mar", {"MAR-INF/MANIFEST.json": MANIFEST, "h.py": b"x"})
    archive = open_archive("m.mar", store, extract)
    assert archive.version == "2.1" and archive.handler == "h.py" and archive.model_name == "m"
    assert (archive.model_dir / "h.py").read_bytes() == b"x"
    archive.remove()
    assert not archive.model_dir.exists()


@pytest.mark.parametrize("member", ["../evil.py", "/abs/evil.py", "a/../../evil.py"])
def test_zip_slip_is_refused(tmp_path, member):
    store, extract = tmp_path / "store", tmp_path / "extract"
    store.mkdir()
    _zip(store / "bad.mar", {"MAR-INF/MANIFEST.json": MANIFEST, member: b"x"})
    with pytest.raises(InvalidArgument, match="outside the archive"):
        open_archive("bad.mar", store, extract)
    assert not (tmp_path / "evil.py").exists()
    assert list(extract.iterdir()) == []


def test_tar_symlink_is_refused(tmp_path):
    store, extract = tmp_path / "store", tmp_path / "extract"
    store.mkdir()
    with tarfile.open(store / "bad.tar.gz", "w:gz") as tf:
        info = tarfile.TarInfo("MAR-INF/MANIFEST.json")
        info.size = len(MANIFEST)
        tf.addfile(info, io.BytesIO(MANIFEST))
        link = tarfile.TarInfo("link")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        tf.addfile(link)
    with pytest.raises(InvalidArgument, match="not a regular file"):
        open_archive("bad.tar.gz", store, extract)


def test_archive_size_cap(tmp_path):
    store, extract = tmp_path / "store", tmp_path / "extract"
    store.mkdir()
    _zip(store / "big.mar", {"MAR-INF/MANIFEST.json": MANIFEST, "w.bin": b"0" * 10_000})
    with pytest.raises(InvalidArgument, match="limit"):
        open_archive("big.mar", store, extract, max_bytes=5_000)


def test_archive_errors(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    (store / "nomanifest").mkdir()
    with pytest.raises(InvalidArgument, match="MANIFEST"):
        open_archive("nomanifest", store, tmp_path)
    with pytest.raises(NotFound):
        open_archive("absent.mar", store, tmp_path)
    (store / "bad").mkdir()
    (store / "bad" / "MAR-INF").mkdir()
    (store / "bad" / "MAR-INF" / "MANIFEST.json").write_text("{not json")
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        open_archive("bad", store, tmp_path)
    (store / "yaml").mkdir()
    (store / "yaml" / "MAR-INF").mkdir()
    (store / "yaml" / "MAR-INF" / "MANIFEST.json").write_text(
        json.dumps({"model": {"modelName": "y", "handler": "h", "configFile": "c.yaml"}}))
    (store / "yaml" / "c.yaml").write_text("!!python/object/apply:os.system ['true']\n")
    with pytest.raises(InvalidArgument, match="YAML"):
        open_archive("yaml", store, tmp_path)


# --------------------------------------------------------------------------- the core's request lifecycle
class _Runner:
    """A stand-in worker: records credits and cancels."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.credits = 0

    def credit(self, request_id: str, count: int) -> None:
        self.credits += count

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


class _FakeVersion:
    """A model version that answers each job with ``script`` (mailbox items) on the next loop turn."""

    version = "1.0"

    def __init__(self, script: list[tuple[Any, Any]] | None) -> None:
        self.script = script
        self.jobs: list[Job] = []
        self.runner = _Runner()
        self.slots: dict[int, Any] = {}
        self.queue: list[Job] = []
        self.restarts_total = 0
        self.sleep = SimpleNamespace(state=SleepState.READY, wakes=0, wake_seconds=0.0, woken_requests=0)
        self.config = ModelConfig()  # no SLOs: goodput is not counted

    def submit(self, job: Job, max_request_size: int) -> None:
        self.jobs.append(job)
        job.worker = self.runner
        job.dispatched = time.monotonic()
        if self.script is None:  # never answers
            return

        def answer() -> None:
            for kind, payload in self.script:
                if kind == Kind.ERROR:
                    job.fail(payload)
                    continue
                job.finished = kind == Kind.FINAL
                job.mailbox.put((kind, payload))

        asyncio.get_running_loop().call_soon(answer)


def _core(tmp_path: Path, script: list[tuple[Any, Any]] | None, **settings: Any) -> tuple[InferenceCore, Any]:
    metrics = ServerMetrics(hostname="h")
    core = InferenceCore(Settings(**settings), tmp_path, telemetry=Telemetry(metrics))
    model = _FakeVersion(script)
    core.models["m"] = ModelEntry({"1.0": model}, "1.0")  # type: ignore[dict-item]
    return core, model


def test_predict_joins_the_responses_and_records_the_request(tmp_path):
    core, model = _core(tmp_path, [(Kind.CHUNK, b"a"), (Kind.CHUNK, b"b"), (Kind.FINAL, b"c")])

    async def run() -> bytes:
        return await core.predict("m", "", {"data": b"x"})

    assert asyncio.run(run()) == b"abc"
    stats = core.telemetry.model("m", "1.0")  # recorded for the version that served it, not "default"
    assert (stats.requests, stats.messages, stats.cancellations, core.inflight) == (1, 0, 0, 0)
    assert stats.latency_us > 0 and not model.jobs[0].cancelled and model.jobs[0].stream is False


def test_stream_yields_each_response_and_ends_after_the_final_one(tmp_path):
    core, model = _core(tmp_path, [(Kind.CHUNK, b"a"), (Kind.FINAL, b"b")])

    async def run() -> list[tuple[bytes, bool]]:
        return [item async for item in core.stream("m", "", {"data": b"x"}, sequence_id="s1")]

    assert asyncio.run(run()) == [(b"a", False), (b"b", True)]
    stats = core.telemetry.model("m", "1.0")
    assert (stats.requests, stats.messages, stats.cancellations, core.inflight) == (1, 2, 0, 0)
    assert model.jobs[0].stream is True and model.jobs[0].sequence_id == "s1"


def test_errors_and_oversize_responses_are_raised(tmp_path):
    core, _ = _core(tmp_path, [(Kind.ERROR, NotFound("gone"))])
    with pytest.raises(NotFound, match="gone"):
        asyncio.run(core.predict("m", "", {"data": b"x"}))

    async def drain() -> None:
        async for _ in core.stream("m", "", {"data": b"x"}):
            pass

    with pytest.raises(NotFound, match="gone"):
        asyncio.run(drain())
    core, _ = _core(tmp_path, [(Kind.CHUNK, b"12"), (Kind.FINAL, b"34")], max_response_size=3)
    with pytest.raises(ResourceExhausted, match="max_response_size"):  # the joined response counts
        asyncio.run(core.predict("m", "", {"data": b"x"}))
    assert core.inflight == 0 and core.telemetry.model("m", "1.0").latency_us == 0


def test_a_cancelled_predict_aborts_the_job_and_propagates(tmp_path):
    core, model = _core(tmp_path, None)

    async def run() -> None:
        task = asyncio.create_task(core.predict("m", "", {"data": b"x"}))
        while not model.jobs:
            await asyncio.sleep(0)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(run())
    job = model.jobs[0]
    assert job.cancelled and model.runner.cancelled == [job.request_id]
    assert core.telemetry.model("m", "1.0").cancellations == 1 and core.inflight == 0


def test_closing_a_stream_early_aborts_the_job(tmp_path):
    core, model = _core(tmp_path, [(Kind.CHUNK, b"a"), (Kind.CHUNK, b"b")])

    async def run() -> None:
        messages = core.stream("m", "", {"data": b"x"})
        assert await anext(messages) == (b"a", False)
        await messages.aclose()

    asyncio.run(run())
    assert model.runner.cancelled == [model.jobs[0].request_id]
    assert core.telemetry.model("m", "1.0").cancellations == 1 and core.inflight == 0


def test_lookup_errors_and_no_telemetry(tmp_path):
    core = InferenceCore(Settings(), tmp_path)  # records nothing
    core.models["m"] = ModelEntry({"1.0": _FakeVersion([(Kind.FINAL, b"ok")])}, "1.0")  # type: ignore[dict-item]
    assert asyncio.run(core.predict("m", "", {})) == b"ok"
    with pytest.raises(NotFound):
        asyncio.run(core.predict("nope", "", {}))
    with pytest.raises(InvalidArgument):
        asyncio.run(core.predict("", "", {}))


def test_stats_view_counts_workers_by_state(tmp_path):
    core, model = _core(tmp_path, None)
    model.slots = {1: SimpleNamespace(state=WorkerState.READY, process=SimpleNamespace(pid=101)),
                   2: SimpleNamespace(state=WorkerState.BACKOFF, process=None),
                   3: SimpleNamespace(state=WorkerState.READY, process=SimpleNamespace(pid=None)),
                   4: SimpleNamespace(state=WorkerState.READY, process=SimpleNamespace(pid=103))}
    model.queue = [object(), object()]
    model.restarts_total = 5
    core.inflight = 1
    inflight, versions = core.stats()
    assert inflight == 1 and len(versions) == 1
    v = versions[0]
    assert (v.model_name, v.model_version, v.queue_depth, v.restarts) == ("m", "1.0", 2, 5)
    assert v.workers == {"STARTING": 0, "READY": 3, "BUSY": 0, "RESTARTING": 1, "FAILED": 0, "UNLOADING": 0}
    assert v.worker_pids == frozenset({101, 103})  # the running worker processes (what LLM gauges are keyed by)


@pytest.mark.parametrize("versions,newest", [
    (["1.0", "9.0", "10.0"], "10.0"), (["10.0", "9.0"], "10.0"), (["2", "1.10", "1.9"], "2"),
    (["1.10", "1.9"], "1.10"), (["b", "a"], "a"), (["1.0", "latest"], "1.0"), (["2.0", "2.0.0"], "2.0.0"),
])
def test_newest_version_orders_numerically_else_by_registration(versions, newest):
    assert newest_version(versions) == newest
    assert version_key("10.0") == (10, 0) and version_key("1.0a") is None and version_key("") is None


# --------------------------------------------------------------------------- health
def test_health_updates_are_not_lost_while_a_watcher_is_slow():
    class Core:
        models: dict[str, Any] = {}
        accepting = True
        ready = False

        def startup_ready(self) -> bool:
            return self.ready

        def model_ready(self, name: str) -> bool:
            return False

    async def run() -> None:
        health = Health()
        core = Core()
        await health.start(core)  # type: ignore[arg-type]
        await health.set_live()
        assert health.servicer._server_status[READINESS] == NOT_SERVING
        real_set, gate = health.servicer.set, asyncio.Event()

        async def slow_set(name: str, status: int) -> None:  # a Watch of READINESS holding its lock
            if name == READINESS:
                await gate.wait()
            await real_set(name, status)

        health.servicer.set = slow_set
        core.ready = True
        health.changed()
        await asyncio.sleep(0.01)  # the writer is stuck in set(SERVING)
        core.ready = False
        health.changed()  # NOT_SERVING again while the writer waits: must not be lost
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.wait_for(health.settled(), 5)
        assert health.servicer._server_status[READINESS] == NOT_SERVING
        core.models = {"m": object()}
        health.changed()
        await asyncio.sleep(0)
        await asyncio.wait_for(health.settled(), 5)
        assert health.servicer._server_status["model/m"] == NOT_SERVING
        await health.shutdown()

    asyncio.run(run())
