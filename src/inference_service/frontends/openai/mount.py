"""The ``/v1`` routes, mounted at start; :mod:`inference_service.frontends.openai.api` (and pydantic
with its schemas' validators, about 10 MiB) is imported by :func:`preload_openai_api`, which the
server awaits before it serves anything, so the first ``/v1`` request is as fast as the next;
without it, in a thread on the first ``/v1`` request."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from inference_service.errors import InferenceError

if TYPE_CHECKING:
    from inference_service.serving.core import InferenceCore

#: Where the API is mounted.
PREFIX = "/v1"
#: ``(method, path under PREFIX, OpenAIApi method)`` of every route.
ROUTES = (
    ("GET", "/models", "list_models"),
    ("GET", "/models/{model_id:.+}", "retrieve_model"),
    ("POST", "/chat/completions", "chat_completions"),
    ("POST", "/completions", "completions"),
    ("POST", "/embeddings", "embeddings"),
    ("POST", "/audio/transcriptions", "audio_transcriptions"),
    ("POST", "/audio/translations", "audio_translations"),
    ("POST", "/responses", "create_response"),
    ("GET", "/responses/{response_id}", "retrieve_response"),
    ("DELETE", "/responses/{response_id}", "delete_response"),
    ("POST", "/rerank", "rerank"),
    ("POST", "/score", "score"),
)
#: ``(method, path, OpenAIApi method)`` of vLLM's routes beside ``/v1``, at the root as vLLM serves them.
ROOT_ROUTES = (
    ("POST", "/tokenize", "tokenize"),
    ("POST", "/detokenize", "detokenize"),
    ("POST", "/rerank", "rerank"),
    ("POST", "/v2/rerank", "rerank"),
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_ROOT_PATHS = frozenset(path for _, path, _ in ROOT_ROUTES)


def is_openai_path(path: str) -> bool:
    """Whether a request path belongs to the OpenAI-compatible API (``/v1`` or below, vLLM's root routes)."""
    return path == PREFIX or path.startswith(PREFIX + "/") or path in _ROOT_PATHS


def _openai_api() -> Any:
    module = importlib.import_module("inference_service.frontends.openai.api")
    for shapes in ("schemas", "logprobs", "tokenizer", "responses_schemas"):
        importlib.import_module(f"inference_service.frontends.openai.{shapes}").build_shapes()
    return module


_imported: Any = None  # the API module once imported


async def preload_openai_api() -> Any:
    """The API module, imported in a thread the first time (callers meanwhile wait on the import lock there)."""
    global _imported
    if _imported is None:
        _imported = await asyncio.to_thread(_openai_api)
    return _imported


async def unauthorized_response(request: web.Request) -> web.Response:
    """401 in OpenAI's error shape for a ``/v1`` request without the inference key
    (:func:`inference_service.frontends.openai.api.unauthorized_response`)."""
    response: web.Response = (await preload_openai_api()).unauthorized_response(request)
    return response


class LazyOpenAIApi:
    """The ``/v1`` sub-application: :data:`ROUTES` and the error middleware, forwarding to an
    :class:`~inference_service.frontends.openai.api.OpenAIApi` built once its module is imported."""

    def __init__(self, core: InferenceCore, http_status: Callable[[InferenceError], int]) -> None:
        self.core = core
        self.http_status = http_status
        self._api: Any = None
        self.app = web.Application(middlewares=[self._errors_middleware])
        for method, path, name in ROUTES:
            self.app.router.add_route(method, path, self._forward(name))

    async def api(self) -> Any:
        """The :class:`~inference_service.frontends.openai.api.OpenAIApi`, built on first use."""
        if self._api is None:
            module = await preload_openai_api()
            if self._api is None:
                self._api = module.OpenAIApi(self.core, self.http_status)
        return self._api

    def _forward(self, name: str) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            response: web.StreamResponse = await getattr(await self.api(), name)(request)
            return response
        return handler

    def root_route(self, name: str) -> Handler:
        """A route outside ``/v1`` answered as the ``/v1`` ones, failures in OpenAI's shape."""
        forward = self._forward(name)

        async def handler(request: web.Request) -> web.StreamResponse:
            return await self._errors_middleware(request, forward)
        return handler

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """OpenAI's error answers for every ``/v1`` failure (``OpenAIApi``'s middleware)."""
        response: web.StreamResponse = await (await self.api())._errors_middleware(request, handler)
        return response


def add_openai_routes(app: web.Application, core: InferenceCore, *,
                      http_status: Callable[[InferenceError], int]) -> LazyOpenAIApi:
    """Mount the OpenAI-compatible API at ``/v1`` (and :data:`ROOT_ROUTES`) on ``app`` before it starts;
    ``app``'s middlewares (token authorization) run first, then failures are answered in OpenAI's shape."""
    api = LazyOpenAIApi(core, http_status)
    app.add_subapp(PREFIX, api.app)
    for method, path, name in ROOT_ROUTES:
        app.router.add_route(method, path, api.root_route(name))
    return api
