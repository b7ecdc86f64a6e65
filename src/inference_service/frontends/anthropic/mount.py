"""The Messages API routes, mounted on the HTTP inference app beside ``/v1``; their module (and the
OpenAI door's, whose parsing they share) is imported on the first request, or by the preload the
server awaits before it serves."""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from inference_service.frontends.openai.mount import LazyOpenAIApi, preload_openai_api

#: path -> the :class:`~inference_service.frontends.anthropic.messages.MessagesApi` method.
ROUTES = {"/v1/messages": "messages", "/v1/messages/count_tokens": "count_tokens"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def is_anthropic_path(path: str) -> bool:
    """Whether a request path is one of Anthropic's routes (their key may come as ``x-api-key``)."""
    return path in ROUTES


def _module() -> Any:
    module = importlib.import_module("inference_service.frontends.anthropic.messages")
    importlib.import_module("inference_service.frontends.anthropic.schemas").build_shapes()
    return module


async def unauthorized_response(request: web.Request) -> web.Response:
    """401 ``authentication_error`` in Anthropic's shape."""
    await preload_openai_api()
    response: web.Response = _module().unauthorized_response(request)
    return response


def add_anthropic_routes(app: web.Application, openai: LazyOpenAIApi) -> None:
    """Mount :data:`ROUTES` on ``app`` (before its ``/v1`` sub-application), over ``openai``'s API."""
    door: list[Any] = []

    def route(name: str) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            if not door:
                api = await openai.api()
                door.append(_module().MessagesApi(api))
            response: web.StreamResponse = await door[0].answer(request, getattr(door[0], name))
            return response
        return handler

    for path, name in ROUTES.items():
        app.router.add_post(path, route(name))
