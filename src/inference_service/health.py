"""``grpc.health.v1`` statuses derived from the core.

Service names:
- ``""``: liveness, SERVING while the server runs.
- ``org.pytorch.serve.grpc.inference.InferenceAPIsService``: readiness,
  SERVING only when every model loaded at startup has its minimum workers ready.
- ``org.pytorch.serve.grpc.management.ManagementAPIsService``: SERVING while the server runs.
- ``model/<model_name>``: SERVING while the model's default version has its
  minimum workers ready (and at least one).
"""

from __future__ import annotations

import asyncio
import contextlib

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from inference_service.core import InferenceCore

READINESS = "org.pytorch.serve.grpc.inference.InferenceAPIsService"
MANAGEMENT = "org.pytorch.serve.grpc.management.ManagementAPIsService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def model_service_name(model_name: str) -> str:
    """The health service name of one model."""
    return f"model/{model_name}"


class Health:
    """Keeps a :class:`HealthServicer` in step with the core (one update task at a time)."""

    def __init__(self) -> None:
        self.servicer = HealthServicer()
        self.core: InferenceCore | None = None
        self._pending: asyncio.Task[None] | None = None
        self._known_models: set[str] = set()
        self._live = False

    async def start(self, core: InferenceCore) -> None:
        """Set everything NOT_SERVING (before the server accepts)."""
        self.core = core
        for name in ("", READINESS, MANAGEMENT):
            await self.servicer.set(name, NOT_SERVING)

    async def set_live(self) -> None:
        """The server accepts calls: liveness and management SERVING, readiness computed."""
        self._live = True
        await self.servicer.set("", SERVING)
        await self.servicer.set(MANAGEMENT, SERVING)
        await self._update()

    def changed(self) -> None:
        """Schedule a recomputation (called from the core on any worker/model change)."""
        if self._pending is None or self._pending.done():
            with contextlib.suppress(RuntimeError):
                self._pending = asyncio.get_running_loop().create_task(self._update())

    async def _update(self) -> None:
        core = self.core
        if core is None or not self._live:
            return
        await asyncio.sleep(0)
        await self.servicer.set(READINESS, SERVING if core.startup_ready() and core.accepting else NOT_SERVING)
        names = set(core.models)
        for name in names | self._known_models:
            ok = name in names and core.model_ready(name) and core.accepting
            await self.servicer.set(model_service_name(name), SERVING if ok else NOT_SERVING)
        self._known_models = names

    async def shutdown(self) -> None:
        """Every service NOT_SERVING, and no further changes (graceful shutdown)."""
        self._live = False
        await self.servicer.enter_graceful_shutdown()
