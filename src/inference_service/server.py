"""The gRPC server: two ``grpc.aio`` servers (inference, management) over one core, plus
TorchServe's HTTP/1.1 inference API (:mod:`inference_service.frontends.http.inference`) and management API
(:mod:`inference_service.frontends.http.management`) in the same loop.

Start-up order: health NOT_SERVING -> bind and start -> liveness SERVING ->
startup models load in the background -> readiness SERVING when they are ready.
Shutdown (SIGTERM/SIGINT): health NOT_SERVING, new requests UNAVAILABLE,
in-flight RPCs get ``drain_timeout_s`` to finish, then workers stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

import inference_service
from inference_service._proto import grpc_predict_v2_pb2, inference_pb2, management_pb2, open_inference_grpc_pb2
from inference_service.config import Settings
from inference_service.connection_limits import connection_cap, raise_open_file_limit
from inference_service.dispatch.gpu import detect_gpus
from inference_service.dispatch.worker_options import WorkerOptions
from inference_service.errors import InferenceError
from inference_service.frontends.grpc import cancelled_writes
from inference_service.frontends.grpc.health import Health, add_health
from inference_service.frontends.grpc.inference import InferenceServicer
from inference_service.frontends.grpc.management import ManagementServicer
from inference_service.frontends.grpc.open_inference import OpenInferenceServicer
from inference_service.frontends.grpc.options import server_options
from inference_service.frontends.grpc.registration import add_service
from inference_service.frontends.grpc.send_budget import SendBudget
from inference_service.frontends.http import limits as http_limits
from inference_service.frontends.http.connections import ConnectionGuard
from inference_service.frontends.http.inference import HttpInferenceApi, server_ssl_context
from inference_service.frontends.http.management import HttpManagementApi, management_ssl_context
from inference_service.frontends.http.shared_port import SharedHttpPort
from inference_service.frontends.openai.mount import preload_openai_api
from inference_service.heap import return_large_buffers_to_the_os
from inference_service.observability.accesslog import AccessLog
from inference_service.observability.loop_lag import LoopLagMonitor
from inference_service.observability.metrics import ServerMetrics, Telemetry
from inference_service.observability.status import STATUS_FILE_NAME, StartupModels, startup_key, write_json_atomic
from inference_service.security import tls
from inference_service.security.auth import INFERENCE, KEY_FILE_NAME, MANAGEMENT, TokenAuthorization
from inference_service.security.exposure import warn_exposed_binds
from inference_service.serving.core import InferenceCore
from inference_service.serving.registration import RegisterRequest
from inference_service.serving.snapshot import SnapshotModel, SnapshotStore
from inference_service.serving.startup import snapshot_to_restore, startup_requests

log = logging.getLogger("inference_service")

#: One gRPC server to bind: (API name, server, address, port (0: any free), credentials or None).
_Bind = tuple[str, grpc.aio.Server, str, int, "grpc.ServerCredentials | None"]


class Server:
    """A running inference-service instance.

    Args:
        settings: the configuration read once in ``main()``.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.instance_dir = settings.instance_dir
        self.extract_dir = self.instance_dir / f"models-{os.getpid()}"
        self.health = Health()
        # the status file: its state ("serving", "stopping"; None before it is first written),
        # the startup models it shows and the "models" map last written
        self._status_state: str | None = None
        self.startup_models = StartupModels()
        self._models_written: dict[str, dict[str, Any]] = {}
        self._status_scheduled = False
        # metrics (enable_metrics_api) and the access log (--no-access-log), see metrics.py / accesslog.py
        number_of_gpu = settings.number_of_gpu if settings.number_of_gpu is not None else detect_gpus()
        # TorchServe's system metrics: on /metrics in prometheus mode only, GPUs with number_of_gpu > 0
        self.metrics = ServerMetrics(system_metrics=settings.metrics_mode == "prometheus",
                                     number_of_gpu=number_of_gpu) if settings.enable_metrics_api else None
        # event-loop lag histogram and warnings naming the request that holds the loop (loop_lag.py)
        self.loop_lag = LoopLagMonitor(self.metrics.registry if self.metrics is not None else None)
        self.telemetry = Telemetry(
            self.metrics, AccessLog(json_fields=settings.log_format == "json") if settings.access_log else None)
        self.core = InferenceCore(
            settings, self.extract_dir,
            number_of_gpu=number_of_gpu,
            on_health_change=self._changed,
            telemetry=self.telemetry,
            # workers log at the server's level and forward their serving statistics (LLM token
            # counts and engine gauges) to /metrics; with metrics_mode=prometheus also handler
            # metrics, instead of logging them
            worker_options=WorkerOptions(
                log_level=settings.log_level,
                service_envelope=settings.service_envelope,
                decode_input_request=settings.decode_input_request,
                max_response_size=settings.max_response_size,
                metrics_sink=self.metrics.handler_metrics if self.metrics is not None else None,
                forward_handler_metrics=settings.metrics_mode == "prometheus"),
        )
        if self.metrics is not None:
            self.metrics.attach(self.core)
        self.snapshots = SnapshotStore(settings.files_dir / "logs" / "config")
        if settings.snapshot:
            self.core.on_models_changed = self._save_snapshot
        self.auth = None if settings.disable_token_auth else TokenAuthorization(
            settings.files_dir / KEY_FILE_NAME, settings.token_expiration_min,
            fixed={INFERENCE: settings.inference_key or "", MANAGEMENT: settings.management_key or ""},
            status_codes=settings.grpc_status_codes)
        self.servers: list[grpc.aio.Server] = []
        self.http_api: HttpInferenceApi | None = None
        self.http_management: HttpManagementApi | None = None
        self.http_shared: SharedHttpPort | None = None
        self.ports: dict[str, int] = {}
        self.http_cap = 1000  # connections per HTTP port (and the metrics port), set at start
        self._stopped = asyncio.Event()
        self._startup_tasks: list[asyncio.Task[None]] = []

    @property
    def status_file(self) -> Path:
        """``<instance dir>/status.json``: pid, ports, state and the startup models' states, for
        ``--start``, scripts and tests (fields: :mod:`inference_service.observability.status`)."""
        return self.instance_dir / STATUS_FILE_NAME

    def _changed(self) -> None:
        """A model or worker changed (called by the core): recompute health, and the startup
        models' states of the status file (coalesced to once per event loop turn)."""
        self.health.changed()
        if self._status_scheduled or self._status_state != "serving":
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._status_scheduled = True
        loop.call_soon(self._refresh_status)

    def _refresh_status(self) -> None:
        """Rewrite the status file if a startup model's state changed (not once stopping)."""
        self._status_scheduled = False
        if self._status_state == "serving" and self.startup_models.as_json() != self._models_written:
            try:
                self._write_status("serving")
            except OSError as exc:
                log.error("cannot write the status file %s: %s", self.status_file, exc)

    def _write_status(self, state: str) -> None:
        self._status_state = state
        self._models_written = self.startup_models.as_json()
        write_json_atomic(self.status_file, {
            "pid": os.getpid(),
            "state": state,
            "inference_address": self.settings.inference_address,
            "inference_port": self.ports.get("inference"),
            "management_address": self.settings.management_address,
            "management_port": self.ports.get("management"),
            "health_port": self.ports.get("health"),
            "http_address": self.settings.http_address if self.settings.http_port is not None else None,
            "http_port": self.ports.get("http"),
            "http_management_address": self.settings.http_management_address
            if self.settings.http_management_port is not None else None,
            "http_management_port": self.ports.get("http_management"),
            "metrics_address": self.settings.metrics_address if self.metrics is not None else None,
            "metrics_port": self.ports.get("metrics"),
            "tls": self.settings.enable_grpc_ssl,
            "key_file": str(self.auth.key_file) if self.auth is not None else None,
            "version": inference_service.__version__,
            "models": self._models_written,
        })

    async def start(self) -> None:
        """Bind every port, start serving and begin loading the startup models, in the order of
        the calls below (the startup models load in the background).

        Raises:
            OSError: a port cannot be bound, a TLS file cannot be read or the
                key file cannot be written (the message names it).
        """
        credentials = await self._prepare()
        binds = self._grpc_servers(credentials)
        await self._bind_grpc(binds, credentials)
        await self._start_http()
        await self._start_metrics()
        self._begin_startup_models()

    async def _prepare(self) -> grpc.ServerCredentials | None:
        """Create the instance and extraction directories, read the TLS files, write the key
        file (before any port accepts) and start the health service; returns the gRPC
        credentials (None: plaintext)."""
        self.instance_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # checked by the command line
        self.extract_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        credentials = tls.server_credentials(self.settings)
        if self.auth is not None:
            self.auth.start()  # key_file.json exists before the ports accept
        cancelled_writes.install()  # a cancel during a blocked write is no error (cancelled_writes.py)
        http_limits.install_log_filter()  # nor is a request that breaks HTTP (logged without traceback)
        if self.settings.http_port is not None:  # /v1's API, imported before anything is served
            await preload_openai_api()
        self.loop_lag.start()
        await self.health.start(self.core)
        return credentials

    def _grpc_servers(self, credentials: grpc.ServerCredentials | None) -> list[_Bind]:
        """The inference and management gRPC servers with their services, health and reflection,
        plus the plaintext health-only server when ``health_port`` is set: what to bind where."""
        s = self.settings
        inference = grpc.aio.server(
            interceptors=self.auth.interceptors(INFERENCE) if self.auth else None,
            options=server_options(s, s.inference_max_connection_age_ms, s.inference_max_connection_age_grace_ms))
        management = grpc.aio.server(
            interceptors=self.auth.interceptors(MANAGEMENT) if self.auth else None,
            options=server_options(s, s.management_max_connection_age_ms, s.management_max_connection_age_grace_ms))
        # answer bytes a connection's client has not read yet, capped (send_budget.py)
        budget = SendBudget(s.connections.max_unread_bytes, s.connections.unread_pause_s)
        add_service(inference, inference_pb2.DESCRIPTOR.services_by_name["InferenceAPIsService"],
                    InferenceServicer(self.core, self.telemetry, s.grpc_status_codes), budget)
        add_service(management, management_pb2.DESCRIPTOR.services_by_name["ManagementAPIsService"],
                    ManagementServicer(self.core, s.enable_model_api, self.telemetry, s.grpc_status_codes))
        # the Open Inference Protocol (KServe v2) under KServe's and TorchServe's package names
        open_inference = []
        for pb2 in (grpc_predict_v2_pb2, open_inference_grpc_pb2):
            service_descriptor = pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
            add_service(inference, service_descriptor, OpenInferenceServicer(self.core, pb2, self.telemetry,
                                                                              s.grpc_status_codes), budget)
            open_inference.append(service_descriptor.full_name)
        for srv, service in ((inference, "InferenceAPIsService"), (management, "ManagementAPIsService")):
            add_health(self.health.servicer, srv)
            # server reflection, so grpcurl, Postman and Evans work without the proto files
            api = (inference_pb2 if srv is inference else management_pb2).DESCRIPTOR.services_by_name[service]
            reflection.enable_server_reflection(
                (api.full_name, *(open_inference if srv is inference else ()),
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), srv)
        binds: list[_Bind] = [("inference", inference, s.inference_address, s.inference_port, credentials),
                              ("management", management, s.management_address, s.management_port, credentials)]
        if s.health_port is not None:  # plaintext, health only: for probes when the APIs use TLS
            health_only = grpc.aio.server()
            add_health(self.health.servicer, health_only)
            binds.append(("health", health_only, s.health_address, s.health_port, None))
        return binds

    async def _bind_grpc(self, binds: list[_Bind], credentials: grpc.ServerCredentials | None) -> None:
        """Bind each gRPC server to its address (port 0: a free one, kept in :attr:`ports`), start
        them and turn liveness SERVING.

        Raises:
            OSError: a port cannot be bound (the message names the API and the address).
        """
        s = self.settings
        warn_exposed_binds({"inference": s.inference_address, "management": s.management_address},
                           token_auth=self.auth is not None, tls=credentials is not None)
        for key, srv, address, port, creds in binds:
            host = f"[{address}]" if ":" in address and not address.startswith("[") else address
            try:
                bound = tls.add_port(srv, f"{host}:{port}", creds)
            except RuntimeError as exc:
                raise OSError(f"cannot bind the {key} API to {address}:{port}: {exc}") from exc
            if bound == 0:
                raise OSError(f"cannot bind the {key} API to {address}:{port}")
            self.ports[key] = bound
        self.servers = [srv for _, srv, *_ in binds]
        for srv in self.servers:
            await srv.start()
        await self.health.set_live()
        log.info("inference API listening on %s:%d, management API on %s:%d (%s)",
                 s.inference_address, self.ports["inference"], s.management_address, self.ports["management"],
                 "plaintext" if credentials is None else "mutual TLS" if s.client_ca_file else "TLS")
        if "health" in self.ports:
            log.info("health-only port (plaintext) listening on %s:%d", s.health_address, self.ports["health"])

    async def _start_http(self) -> None:
        """TorchServe's HTTP/1.1 inference and management APIs over the same core, each unless
        its port is None (``--no-http``, ``--no-http-management``), on one port when their
        addresses are the same (:mod:`~inference_service.frontends.http.shared_port`).

        Raises:
            OSError: a port cannot be bound.
        """
        s = self.settings
        self.http_cap = cap = connection_cap(s.connections, raise_open_file_limit(), 3)  # 8080, 8081, metrics
        if s.http_port is not None:  # TorchServe's HTTP/1.1 inference API, same core
            self.http_api = HttpInferenceApi(self.core, keys=self.auth.keys if self.auth else None,
                                             max_request_size=s.max_request_size, ssl_context=server_ssl_context(s),
                                             access_log=self.telemetry.access_log)
            self.http_api.app.middlewares.insert(0, self.loop_lag.middleware)
            self.http_api.connection_guard = ConnectionGuard(s.connections, cap, "HTTP inference API")
        if s.http_management_port is not None:  # TorchServe's HTTP/1.1 management API, same core
            self.http_management = HttpManagementApi(
                self.core, auth=self.auth, model_api_enabled=s.enable_model_api,
                max_request_size=s.max_request_size, ssl_context=management_ssl_context(s),
                access_log=self.telemetry.access_log, status_codes=s.http_management_status_codes)
            self.http_management.app.middlewares.insert(0, self.loop_lag.middleware)
            self.http_management.connection_guard = ConnectionGuard(s.connections, cap, "HTTP management API")
        if self.http_api is not None and self.http_management is not None and s.http_shared:
            guard = ConnectionGuard(s.connections, cap, "HTTP inference and management API")
            self.http_shared = SharedHttpPort(self.http_api, self.http_management, guard)
            self.ports["http"] = self.ports["http_management"] = await self.http_shared.start(s.http_address,
                                                                                               s.http_port or 0)
            log.info("HTTP inference and management APIs listening on %s:%d", s.http_address, self.ports["http"])
            return
        for key, api, address, port in (("http", self.http_api, s.http_address, s.http_port),
                                        ("http_management", self.http_management, s.http_management_address,
                                         s.http_management_port)):
            if api is not None and port is not None:
                self.ports[key] = await api.start(address, port)
                log.info("%s listening on %s:%d (%s)", "HTTP inference API" if key == "http" else
                         "HTTP management API", address, self.ports[key],
                         "HTTPS" if api.ssl_context is not None else "plaintext")

    async def _start_metrics(self) -> None:
        """The Prometheus metrics API (``enable_metrics_api``), bound in a thread.

        Raises:
            OSError: its port cannot be bound (the message names the address).
        """
        s = self.settings
        if self.metrics is not None:
            context = server_ssl_context(s, "metrics_address")  # TorchServe's https:// metrics_address
            try:
                self.ports["metrics"] = await asyncio.to_thread(
                    self.metrics.serve, s.metrics_address, s.metrics_port, self.telemetry.access_log,
                    self.http_cap, s.connections.request_head_timeout_s, context)
            except OSError as exc:
                raise OSError(f"cannot bind the metrics API to {s.metrics_address}:{s.metrics_port}: "
                              f"{exc.strerror or exc}") from exc
            log.info("metrics API listening on %s://%s:%d/metrics (metrics_mode %s)",
                     "https" if s.metrics_tls else "http", s.metrics_address, self.ports["metrics"], s.metrics_mode)

    def _begin_startup_models(self) -> None:
        """Write the status file (state ``serving``, every startup model ``registering``: ``--start``
        waits for each), then load the restored snapshot's and the named models in tasks; once
        all have been tried, readiness may turn SERVING."""
        restored = snapshot_to_restore(self.settings, self.snapshots) or []
        requests = [(startup_key(req.model_name or req.url), req) for req in startup_requests(self.settings)]
        for key in [startup_key(m.name, m.version) for m in restored] + [key for key, _ in requests]:
            self.startup_models.registering(key)  # in the status file from the start: --start waits for each
        self._write_status("serving")
        if restored:
            self._startup_tasks.append(asyncio.create_task(self._restore(restored)))
        for key, req in requests:
            self._startup_tasks.append(asyncio.create_task(self._load_startup(req, key)))
        if self._startup_tasks:
            self._startup_tasks.append(asyncio.create_task(self._finish_startup(list(self._startup_tasks))))
        else:
            self.core.finish_startup(failed=False)

    async def _finish_startup(self, tasks: list[asyncio.Task[None]]) -> None:
        """Once every startup model has been tried, readiness and Ping may turn healthy."""
        await asyncio.gather(*tasks, return_exceptions=True)
        self.core.finish_startup(self.startup_models.any_failed)

    def _save_snapshot(self) -> None:
        try:
            self.snapshots.save(self.core, self.settings.model_store)
        except OSError as exc:
            log.error("cannot write the config snapshot in %s: %s", self.snapshots.directory, exc)

    async def _restore(self, models: list[SnapshotModel]) -> None:
        for m in models:
            m.request.extra["max_workers"] = m.max_workers
            await self._load_startup(m.request, startup_key(m.name, m.version))
        for m in models:
            if m.default:
                try:
                    self.core.set_default(m.name, m.version)
                except InferenceError as exc:
                    log.error("cannot restore the default version of %s: %s", m.name, exc.message)

    async def _load_startup(self, req: RegisterRequest, key: str) -> None:
        """Register one startup model; its outcome goes to the log and, under ``key``, to the
        status file (a failure to load its workers later too, see :meth:`_changed`)."""
        try:
            version = await self.core.register(req)
        except InferenceError as exc:
            log.error("startup model %s failed to register: %s", req.model_name or req.url, exc.message)
            self.startup_models.failed(key, exc.message)
        except Exception as exc:
            log.exception("startup model %s failed to register", req.model_name or req.url)
            self.startup_models.failed(key, f"{type(exc).__name__}: {exc}")
        else:
            self.startup_models.registered(key, version)
        self._changed()

    async def stop(self, grace: float | None = None) -> None:
        """Graceful shutdown: NOT_SERVING, refuse new work, drain, stop workers, clean up."""
        if self._stopped.is_set():
            return
        grace = self.settings.drain_timeout_s if grace is None else grace
        log.info("shutting down (drain timeout %.0fs)", grace)
        self.core.accepting = False
        with contextlib.suppress(Exception):
            self._write_status("stopping")
        await self.health.shutdown()
        startup = [task for task in self._startup_tasks if not task.done()]
        for task in startup:
            task.cancel()
        if startup:  # let them unwind before the workers stop (their cancellation is theirs, ours propagates)
            await asyncio.wait(startup)
        # New requests now get UNAVAILABLE from the core; health checks still answer
        # NOT_SERVING. In-flight requests get ``grace`` seconds to finish.
        if not await self.core.wait_idle(grace):
            log.warning("%d requests still in flight after the %.0fs drain timeout; cancelling them",
                        self.core.inflight, grace)
        await asyncio.gather(*(srv.stop(0.5) for srv in self.servers))
        if self.http_api is not None:
            await self.http_api.stop()
        if self.http_management is not None:
            await self.http_management.stop()
        if self.http_shared is not None:
            await self.http_shared.stop()
        await self.core.shutdown()
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.stop)
        if self.auth is not None:
            await self.auth.stop()
        self.loop_lag.stop()
        shutil.rmtree(self.extract_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            self.status_file.unlink()
        self._stopped.set()
        log.info("stopped")


async def serve(settings: Settings) -> int:
    """Run a server until SIGTERM or SIGINT, then shut down gracefully. Returns the exit status."""
    return_large_buffers_to_the_os()
    server = Server(settings)
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    try:
        await server.start()
    except OSError as exc:
        log.error("%s", exc)
        if str(exc).startswith("cannot bind"):  # a port clash: name every port, to move them at once
            log.error("%s", settings.ports_message())
        await server.stop(0)
        return 1
    await stop_requested.wait()
    await server.stop()
    return 0
