"""The serving core shared by every front end: model registry, inference and management.

Every failure is an :class:`~inference_service.errors.InferenceError`. See docs/architecture.md."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncGenerator, Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import inference_service
from inference_service.config import Settings
from inference_service.contracts.controls import request_controls
from inference_service.dispatch.gpu import GpuAllocator
from inference_service.dispatch.jobs import Job, Kind
from inference_service.dispatch.worker_options import WorkerOptions
from inference_service.errors import (
    FailedPrecondition,
    InferenceError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    WorkerLoadError,
    shorten,
)
from inference_service.serving.cpu_budget import CpuBudget
from inference_service.serving.model_version import ModelVersion
from inference_service.serving.registration import (
    ModelEntry,
    RegisterRequest,
    list_models_page,
    newest_version,
    prepare_version,
)
from inference_service.serving.stats import RequestTelemetry, VersionStats, version_stats

log = logging.getLogger(__name__)
#: The version serving the current task's inference request ("": none), for its access line.
SERVED_VERSION: ContextVar[str] = ContextVar("served_version", default="")


class InferenceCore:
    """Registry of models and the inference / management operations on it.

    Args:
        settings: the server's settings, read once in ``main()``.
        extract_dir: this instance's directory for extracted archives.
        number_of_gpu: GPUs to place workers on, round-robin (0: CPU only).
        on_health_change: called when readiness may have changed.
        telemetry: where requests are recorded (default: nowhere).
    """

    def __init__(self, settings: Settings, extract_dir: Path, number_of_gpu: int = 0,
                 on_health_change: Callable[[], None] | None = None,
                 telemetry: RequestTelemetry | None = None,
                 worker_options: WorkerOptions | None = None) -> None:
        self.settings = settings
        self.extract_dir = extract_dir
        self.url_policy = settings.url_policy
        self.telemetry = telemetry
        self.worker_options = worker_options
        self.models: dict[str, ModelEntry] = {}
        self._on_health_change = on_health_change or (lambda: None)
        self._register_lock = asyncio.Lock()
        self.accepting = True
        self.on_models_changed: Callable[[], None] = lambda: None
        self.cpu_budget = CpuBudget()
        self.gpus = GpuAllocator(number_of_gpu)
        self.inflight = 0
        self.startup = "pending"  # then "done", or "failed": a startup model could not be registered
        self._idle = asyncio.Event()
        self._idle.set()

    # ------------------------------------------------------------------ lookup
    def get(self, name: str, version: str = "") -> ModelVersion:
        """The named version (default when ``version`` is empty).

        Raises:
            InvalidArgument: empty model name.
            NotFound: unknown model or version.
        """
        if not name:
            raise InvalidArgument("model_name is required", reason="MODEL_NAME_REQUIRED")
        entry = self.models.get(name)
        if entry is None:
            raise NotFound(f"model {shorten(name)!r} is not registered")
        ver = version or entry.default_version
        model = entry.versions.get(ver)
        if model is None:
            raise NotFound(f"model {name!r} has no version {shorten(version)!r}", reason="VERSION_NOT_FOUND")
        return model

    # --------------------------------------------------------------- inference
    def _submit(self, model: ModelVersion, job: Job) -> None:
        """Submit through the version's admission check; Unavailable (SHUTTING_DOWN) once shutting down."""
        if not self.accepting:
            raise Unavailable("server is shutting down", reason="SHUTTING_DOWN")
        model.submit(job, self.settings.max_request_size)

    def _check_response(self, payload: bytes) -> bytes:
        if len(payload) > self.settings.max_response_size:
            raise ResourceExhausted(
                f"response of {len(payload)} bytes exceeds max_response_size="
                f"{self.settings.max_response_size} bytes", reason="RESPONSE_TOO_LARGE")
        return payload

    def _enter(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight (graceful drain); False if ``timeout`` s passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def predict(self, name: str, version: str, inputs: dict[str, bytes],
                      headers: dict[str, str] | None = None,
                      time_remaining: float | None = None, *,
                      content_types: dict[str, str] | None = None, sequence_id: str | None = None,
                      response_headers: dict[str, str] | None = None) -> bytes:
        """Unary inference: the final response, preceded by any intermediate ones, concatenated.

        ``version`` "" is the default; ``time_remaining``: seconds left of the client's deadline;
        ``content_types``: of the inputs that have one (the worker decodes JSON and text ones);
        ``response_headers`` receives those the handler set (``context.set_response_header``);
        ``sequence_id``: of :meth:`enter_sequence`.

        Raises:
            InferenceError: NOT_FOUND, UNAVAILABLE, RESOURCE_EXHAUSTED, the handler's error.
        """
        result = b""
        # runs the lifecycle to its end (it returns after its one item), so its cleanup has run
        async for data, _final in self._lifecycle(name, version, inputs, headers, time_remaining, False,
                                                  sequence_id, content_types, response_headers=response_headers):
            result = data
        return result

    def stream(self, name: str, version: str, inputs: dict[str, bytes],
               headers: dict[str, str] | None = None,
               time_remaining: float | None = None,
               sequence_id: str | None = None, *,
               content_types: dict[str, str] | None = None,
               group: str | None = None,
               response_headers: dict[str, str] | None = None) -> AsyncGenerator[tuple[bytes, bool], None]:
        """Streaming inference (batch of one): yields ``(payload, is_final)`` for each intermediate
        response, then for the final one (``is_final`` True). Requests of one ``group`` (the
        engine requests of one client request) are one unit of the job queue's fairness.

        Nothing happens (lookup errors included) until the first item is asked for. Closing the
        iterator early aborts the request in the worker. ``response_headers`` and raises as :meth:`predict`.
        """
        return self._lifecycle(name, version, inputs, headers, time_remaining, True, sequence_id, content_types,
                               group, response_headers)

    async def _lifecycle(self, name: str, version: str, inputs: dict[str, bytes],
                         headers: dict[str, str] | None, time_remaining: float | None, stream: bool,
                         sequence_id: str | None, content_types: dict[str, str] | None,
                         group: str | None = None,
                         response_headers: dict[str, str] | None = None) -> AsyncGenerator[tuple[bytes, bool], None]:
        """The one request lifecycle of :meth:`predict` and :meth:`stream`; unary joins the parts."""
        model = self.get(name, version)
        SERVED_VERSION.set(model.version)
        telemetry = self.telemetry
        stats = telemetry.model(name, model.version) if telemetry is not None else None
        timeout, priority = request_controls(headers or {})  # x-request-timeout, x-request-priority
        time_remaining = time_remaining if time_remaining is not None else timeout
        job = Job(inputs, headers or {}, stream=stream, sequence_id=sequence_id,
                  deadline=None if time_remaining is None else time.monotonic() + time_remaining,
                  content_types=content_types or {}, group=group, priority=priority)
        if response_headers is not None:
            job.response_headers = response_headers
        if stats is not None:
            stats.requests += 1
        self._submit(model, job)
        self._enter()
        alarm = None if time_remaining is None else asyncio.get_running_loop().call_later(
            time_remaining, job.deadline_passed)
        parts: list[bytes] = []
        ok = cancelled = False
        last = first = 0.0  # monotonic times of the previous and the first stream message (metrics)
        messages = 0
        try:
            while True:
                kind, payload = await job.mailbox.get()
                if isinstance(payload, InferenceError):  # Kind.ERROR
                    raise payload
                final = kind == Kind.FINAL
                if stream:
                    data = self._check_response(payload)
                    if stats is not None:
                        last = stats.message(job.enqueued, last, final)
                        first, messages = first or last, messages + 1
                elif final:
                    parts.append(payload)
                    data = self._check_response(payload if len(parts) == 1 else b"".join(parts))
                else:
                    parts.append(payload)
                    job.took_chunk()
                    continue
                if final:
                    ok = True
                    yield data, True
                    return
                job.took_chunk()
                yield data, False
        except (asyncio.CancelledError, GeneratorExit):
            cancelled = not job.finished
            raise
        finally:
            self._leave()
            if alarm is not None:
                alarm.cancel()
            if not job.finished:
                job.abort()
            if stats is not None:
                slo = model.config.met_slo(job.enqueued, first, last, messages) if ok else None
                stats.finish(job.enqueued, job.dispatched, ok, cancelled or job.timed_out, slo)

    def open_sequence(self, name: str, version: str, sequence_id: str) -> ModelVersion:
        """Start (or continue) a sequence on the model (StreamPredictions2)."""
        model = self.get(name, version)
        model.open_sequence(sequence_id)
        return model

    # -------------------------------------------------------------- management
    async def register(self, req: RegisterRequest) -> ModelVersion:
        """Register a model archive from the model store (as TorchServe's RegisterModel).

        Config: request fields over model-config.yaml over defaults. The model's first version
        becomes its default.

        Raises:
            InvalidArgument: bad URL, archive, manifest or field values.
            PermissionDenied: a remote URL ``allowed_urls`` does not allow.
            NotFound: no such archive in the store.
            FailedPrecondition: the version is already registered.
            WorkerLoadError: synchronous and a worker failed to load (nothing is registered).
        """
        if not self.accepting:
            raise Unavailable("server is shutting down", reason="SHUTTING_DOWN")
        prepared = await prepare_version(self.settings, req, self.extract_dir)
        name, config, handler, archive = prepared.name, prepared.config, prepared.handler, prepared.archive
        try:
            async with self._register_lock:
                entry = self.models.get(name)
                if entry is not None and archive.version in entry.versions:
                    raise FailedPrecondition(
                        f"model {name!r} version {archive.version!r} is already registered",
                        reason="VERSION_REGISTERED")
                model = ModelVersion(name, archive, config, handler, inference_service.__version__,
                                     self._workers_changed, req.loaded_at_startup, prepared.extra_paths,
                                     gpus=self.gpus, worker_options=self.worker_options)
                entry = self.models.setdefault(name, ModelEntry())
                entry.versions[model.version] = model
                if not entry.default_version:
                    entry.default_version = model.version
        except BaseException:
            archive.remove()
            raise
        log.info("registered model %s version %s from %s (handler %s, batch_size %d, workers %d)",
                 name, model.version, req.url, handler, config.batch_size, config.min_workers)
        try:
            await model.scale(config.min_workers, config.max_workers, req.synchronous)
        except WorkerLoadError as exc:
            await self._remove_version(name, model.version)
            exc.model_version = model.version  # RegisterModel's request names none
            raise
        self._on_health_change()
        self.on_models_changed()
        return model

    def _workers_changed(self) -> None:
        """A worker of some version started, became ready, failed or left."""
        self.cpu_budget.check(self.models)  # first: logged before the status file says ready
        self._on_health_change()

    async def _remove_version(self, name: str, version: str) -> None:
        entry = self.models.get(name)
        if entry is None:
            return
        model = entry.versions.pop(version, None)
        if not entry.versions:
            del self.models[name]
        elif entry.default_version == version:
            entry.default_version = newest_version(entry.versions)
        if model is not None:
            await model.close()
        self._on_health_change()

    async def unregister(self, name: str, version: str = "") -> str:
        """Remove a version (the default one when ``version`` is empty), as TorchServe does.

        Raises:
            NotFound: unknown model or version.
            FailedPrecondition: it is the default version while others exist.
        """
        model = self.get(name, version)
        entry = self.models[name]
        if model.version == entry.default_version and len(entry.versions) > 1:
            raise FailedPrecondition(
                f"version {model.version} is the default of model {name!r}; set another default "
                "version first", reason="DEFAULT_VERSION")
        await self._remove_version(name, model.version)
        log.info("unregistered model %s version %s", name, model.version)
        self.on_models_changed()
        return model.version

    async def scale(self, name: str, version: str, min_worker: int, max_worker: int,
                    synchronous: bool, timeout: int, number_gpu: int = 0) -> ModelVersion:
        """ScaleWorker; ``number_gpu`` <= 0 means unset (TorchServe's gRPC ScaleWorker ignores it).

        Raises:
            InvalidArgument: negative or inconsistent counts, a ``timeout`` below -1.
            NotFound: unknown model or version.
            WorkerLoadError: synchronous and a new worker failed to load.
        """
        if min_worker < 0 or max_worker < 0:
            raise InvalidArgument("min_worker and max_worker must not be negative", reason="WORKER_COUNT")
        if timeout < -1:
            raise InvalidArgument(f"timeout must be -1 (no end), 0 (10 s) or 1..3600 s, got {timeout}")
        number_gpu = max(0, number_gpu)
        if min_worker > 64 or max_worker > 64:
            raise InvalidArgument("at most 64 workers per model version")
        if max_worker and max_worker < min_worker:
            raise InvalidArgument(f"max_worker ({max_worker}) is less than min_worker ({min_worker})",
                                  reason="MAX_BELOW_MIN")
        model = self.get(name, version)
        stop_timeout = min(10.0 if timeout == 0 else (math.inf if timeout < 0 else float(timeout)), 3600.0)
        await model.scale(min_worker, max_worker or min_worker, synchronous, stop_timeout, number_gpu or None)
        self._on_health_change()
        self.on_models_changed()
        return model

    def set_default(self, name: str, version: str) -> None:
        """SetDefault. Raises InvalidArgument (missing name or version) or NotFound."""
        if not version:
            raise InvalidArgument("model_version is required", reason="VERSION_REQUIRED")
        model = self.get(name, version)
        self.models[name].default_version = model.version
        log.info("model %s default version is now %s", name, version)
        self.on_models_changed()

    def versions(self, name: str, version: str = "") -> list[tuple[ModelVersion, bool]]:
        """DescribeModel's ``(version, is_default)`` pairs; "all" gives every version, sorted.

        Raises InvalidArgument (empty model name) or NotFound.
        """
        if version == "all":
            self.get(name)
            entry = self.models[name]
            return [(m, v == entry.default_version) for v, m in sorted(entry.versions.items())]
        model = self.get(name, version)
        return [(model, model.version == self.models[name].default_version)]

    def list_models(self, limit: int, next_page_token: int) -> dict[str, Any]:
        """ListModels' JSON, sorted by name; ``limit`` outside 1..100 means 100 (as TorchServe)."""
        return list_models_page(self.models, limit, next_page_token)

    def stats(self) -> tuple[int, list[VersionStats]]:
        """``(requests in flight, per-version stats)`` for the metrics; safe from another thread."""
        return self.inflight, [version_stats(name, version, model)
                               for name, entry in list(self.models.items())
                               for version, model in list(entry.versions.items())]

    # ------------------------------------------------------------------ health
    def finish_startup(self, failed: bool) -> None:
        """The server has tried to register every startup model (``failed``: one could not be)."""
        self.startup = "failed" if failed else "done"
        self._on_health_change()

    def healthy(self) -> bool:
        """The startup models have been registered (TorchServe answers nothing before) and every
        model version has at least its minimum workers ready (TorchServe's Ping rule)."""
        return self.startup != "pending" and all(
            m.healthy for e in self.models.values() for m in e.versions.values())

    def startup_ready(self) -> bool:
        """Readiness: every startup model was registered and has its minimum workers ready."""
        return self.startup == "done" and all(
            m.healthy for e in self.models.values() for m in e.versions.values() if m.loaded_at_startup)

    def model_ready(self, name: str) -> bool:
        """The model's default version has a ready worker (and its minimum)."""
        entry = self.models.get(name)
        if entry is None:
            return False
        model = entry.versions[entry.default_version]
        return model.serving

    async def shutdown(self) -> None:
        """Stop accepting, stop every worker, remove extracted archives."""
        self.accepting = False
        versions = [(name, version) for name, entry in self.models.items() for version in entry.versions]
        results = await asyncio.gather(*(self._remove_version(name, version) for name, version in versions),
                                       return_exceptions=True)
        for (name, version), result in zip(versions, results, strict=True):
            if isinstance(result, BaseException):  # pragma: no cover - best effort
                log.error("error stopping %s %s: %r", name, version, result)

