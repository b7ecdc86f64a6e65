"""``grpc.health.v1`` statuses derived from the core.

Service names:
- ``""``: liveness, SERVING while the server runs.
- ``org.pytorch.serve.grpc.inference.InferenceAPIsService``: readiness, SERVING only once
  the startup models have been registered and every one of them has its minimum workers
  ready (``InferenceCore.startup_ready``); NOT_SERVING for good if one failed to register.
- ``org.pytorch.serve.grpc.management.ManagementAPIsService``: SERVING while the server runs.
- ``model/<model_name>``: SERVING while the model's default version has its minimum workers
  ready (and at least one), NOT_SERVING while it is registered but not ready. A name that is
  not registered (never, or no longer) is an unknown service, as the gRPC health protocol
  specifies: ``Check`` fails with NOT_FOUND and ``Watch`` sends SERVICE_UNKNOWN.

Health needs no key (probes have none), so anyone who can reach the port can learn which
model names are registered now; nothing about models that were never registered.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from inference_service.frontends.grpc.registration import Malformed, add_service
from inference_service.serving.core import InferenceCore

READINESS = "org.pytorch.serve.grpc.inference.InferenceAPIsService"
MANAGEMENT = "org.pytorch.serve.grpc.management.ManagementAPIsService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class ModelHealthServicer(HealthServicer):
    """grpc's aio :class:`HealthServicer` where a service whose status is SERVICE_UNKNOWN (a
    model that was unregistered) is unknown to ``Check`` too: NOT_FOUND, as for a name never
    set. ``Watch`` already sends SERVICE_UNKNOWN for both."""

    async def Check(self, request: health_pb2.HealthCheckRequest,  # noqa: N802 - gRPC method name
                    context: grpc.aio.ServicerContext[Any, Any]) -> health_pb2.HealthCheckResponse:
        """The service's status; aborts with NOT_FOUND for an unknown service, INVALID_ARGUMENT
        for a request that does not parse (registered through :func:`add_health`)."""
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request message does not parse: {request.error}")
        status = self._server_status.get(request.service)
        if status is None or status == SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND)  # no details, as grpc's own servicer
        return health_pb2.HealthCheckResponse(status=status)


    async def Watch(self, request: health_pb2.HealthCheckRequest,  # noqa: N802 - gRPC method name
                    context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """grpc's Watch; aborts with INVALID_ARGUMENT for a request that does not parse."""
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request message does not parse: {request.error}")
        await super().Watch(request, context)


def add_health(servicer: ModelHealthServicer, server: grpc.aio.Server) -> None:
    """Serve ``grpc.health.v1.Health`` on ``server`` with request deserializers that never fail
    (:func:`~inference_service.frontends.grpc.registration.add_service`): a request that does not
    parse is INVALID_ARGUMENT, where the generated registration answers UNKNOWN and logs a traceback."""
    add_service(server, health_pb2.DESCRIPTOR.services_by_name["Health"], servicer)


def model_service_name(model_name: str) -> str:
    """The health service name of one model."""
    return f"model/{model_name}"


class Health:
    """Keeps a :class:`HealthServicer` in step with the core.

    A change (:meth:`changed`) recomputes every status once per event loop turn; each
    service name whose status differs from the last one asked for gets it written by its
    own writer task. ``HealthServicer.set`` waits while a ``Watch`` of that name is
    writing to a slow client, so the writer loops until the status it wrote is still
    the latest: a change made meanwhile is never lost, and one slow watcher delays only
    its own service name. Writers are owned here and cancelled by :meth:`shutdown`.
    """

    def __init__(self) -> None:
        self.servicer = ModelHealthServicer()
        self.core: InferenceCore | None = None
        self._scheduled = False
        self._wanted: dict[str, int] = {}  # service name -> the status last asked for
        self._writers: dict[str, asyncio.Task[None]] = {}
        self._known_models: set[str] = set()
        self._live = False

    async def start(self, core: InferenceCore) -> None:
        """Set everything NOT_SERVING (before the server accepts)."""
        self.core = core
        for name in ("", READINESS, MANAGEMENT):
            self._wanted[name] = NOT_SERVING
            await self.servicer.set(name, NOT_SERVING)

    async def set_live(self) -> None:
        """The server accepts calls: liveness and management SERVING, readiness computed
        (written before this returns)."""
        self._live = True
        for name in ("", MANAGEMENT):
            self._publish(name, SERVING)
        self._recompute()
        await self.settled()

    async def settled(self) -> None:
        """Wait until the statuses asked for so far are written (for start-up and tests)."""
        while writers := [t for t in self._writers.values() if not t.done()]:
            await asyncio.wait(writers)

    def changed(self) -> None:
        """Recompute soon (called from the core on any worker or model change; coalesced
        to once per event loop turn; no-op without a running loop)."""
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._scheduled = True
        loop.call_soon(self._recompute)

    def _recompute(self) -> None:
        self._scheduled = False
        core = self.core
        if core is None or not self._live:
            return
        self._publish(READINESS, SERVING if core.startup_ready() and core.accepting else NOT_SERVING)
        names = set(core.models)
        for name in names:
            self._publish(model_service_name(name), SERVING if core.model_ready(name) and core.accepting
                          else NOT_SERVING)
        for name in self._known_models - names:
            self._publish(model_service_name(name), SERVICE_UNKNOWN)
        self._known_models = names

    def _publish(self, name: str, status: int) -> None:
        """Ask for ``status`` on ``name``: start its writer unless one runs (it picks the change up)."""
        if self._wanted.get(name) == status:
            return
        self._wanted[name] = status
        writer = self._writers.get(name)
        if writer is None or writer.done():
            self._writers[name] = asyncio.get_running_loop().create_task(self._write(name),
                                                                         name=f"health-{name}")

    async def _write(self, name: str) -> None:
        """Write ``name``'s wanted status until what was written is still the one wanted."""
        written = None
        while (status := self._wanted[name]) != written:
            await self.servicer.set(name, status)
            written = status

    async def shutdown(self) -> None:
        """Every service NOT_SERVING, and no further changes (graceful shutdown)."""
        self._live = False
        writers = [t for t in self._writers.values() if not t.done()]
        for writer in writers:
            writer.cancel()
        if writers:
            await asyncio.wait(writers)  # their cancellation stays theirs; a cancel of ours propagates
        self._writers.clear()
        await self.servicer.enter_graceful_shutdown()
