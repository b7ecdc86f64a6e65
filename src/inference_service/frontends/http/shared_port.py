"""TorchServe's HTTP inference and management APIs on one port, as TorchServe serves them when
``inference_address`` and ``management_address`` are the same (KServe's config.properties).

One front application routes each request by its path: ``/models`` and below, and ``/token``,
to the management API's application, everything else to the inference API's. Each keeps its own
middlewares (its key, its error bodies). A management call runs to its end even when its client
disconnects; an inference call is cancelled, as on its own port.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from aiohttp import web
from aiohttp.web_urldispatcher import AbstractRuleMatching, MatchedSubAppResource

from inference_service.frontends.http.connections import ConnectionGuard
from inference_service.frontends.http.inference import HttpInferenceApi, serve_app
from inference_service.frontends.http.management import HttpManagementApi
from inference_service.security.exposure import warn_exposed_binds

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def is_management_path(path: str) -> bool:
    """Whether ``path`` belongs to the management API (``/models``, ``/models/...``, ``/token``)."""
    return path in ("/models", "/token") or path.startswith("/models/")


class _PathRule(AbstractRuleMatching):
    """Matches the requests of one API: management paths, or all the others."""

    def __init__(self, management: bool) -> None:
        self.management = management

    async def match(self, request: web.Request) -> bool:
        return is_management_path(request.path) == self.management

    def get_info(self) -> Any:  # aiohttp's private _InfoDict
        return {"prefix": "/models" if self.management else "/"}

    @property
    def canonical(self) -> str:
        return "/models" if self.management else "/"


@web.middleware
async def _run_to_the_end(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """A management call is not cancelled by its client's disconnect (a register, a scale)."""
    return await asyncio.shield(handler(request))


def shared_app(inference: web.Application, management: web.Application, max_request_size: int) -> web.Application:
    """One application serving both APIs' (not yet started) applications."""
    front = web.Application(client_max_size=max_request_size)
    management.middlewares.insert(0, _run_to_the_end)
    for app, rule in ((management, _PathRule(True)), (inference, _PathRule(False))):
        # aiohttp's add_domain() with a rule on the path instead of the Host header
        front._add_subapp(partial(MatchedSubAppResource, rule, app), app)
    return front


class SharedHttpPort:
    """Both HTTP APIs served on one port (:func:`shared_app`); ``guard`` limits its connections."""

    def __init__(self, inference: HttpInferenceApi, management: HttpManagementApi, guard: ConnectionGuard) -> None:
        self.inference = inference
        self.app = shared_app(inference.app, management.app, inference.max_request_size)
        self.guard = guard
        self._runner: web.AppRunner | None = None

    async def start(self, address: str, port: int) -> int:
        """Bind ``address:port`` and serve both APIs; returns the bound port; OSError if it cannot."""
        self._runner, bound = await serve_app(self.app, "HTTP inference and management API", address, port,
                                              ssl_context=self.inference.ssl_context,
                                              shutdown_timeout_s=self.inference.shutdown_timeout_s,
                                              handler_cancellation=True, guard=self.guard)
        warn_exposed_binds({"HTTP inference and management": address}, self.inference.keys is not None,
                           self.inference.ssl_context is not None, tls_hint="use an https:// inference_address")
        return bound

    async def stop(self) -> None:
        """Stop listening and close connections."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
