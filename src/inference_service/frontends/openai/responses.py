"""OpenAI's Responses API on the HTTP inference port: ``POST /v1/responses`` (whole, or typed
server-sent events), ``GET`` and ``DELETE /v1/responses/{id}``.

A request becomes the chat completion request of the same conversation
(:mod:`~inference_service.frontends.openai.responses_schemas`), so the same typed LLM request, and
runs as one engine request through :meth:`InferenceCore.stream`; its answer is read into output
items (:mod:`~inference_service.frontends.openai.responses_output`) and, unless ``store`` is false,
kept in the bounded :class:`~inference_service.frontends.openai.responses_store.ResponseStore`.
Answers and differences from OpenAI's: docs/llm.md, "Responses API".
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from inference_service.contracts.controls import PRIORITY_HEADER
from inference_service.contracts.request_error import InvalidRequest
from inference_service.errors import InferenceError
from inference_service.frontends.limits import off_loop
from inference_service.frontends.openai.errors import IGNORED_HEADERS, NAMED_FIELD, SSE_HEADERS, OpenAIError
from inference_service.frontends.openai.format import Outcome, final_outcome, piece_of
from inference_service.frontends.openai.responses_output import OutputBuilder, ResponseShape, output_messages, sse
from inference_service.frontends.openai.responses_schemas import ResponsesRequest, Translation, translate
from inference_service.frontends.openai.responses_store import ResponseStore, StoredResponse, StoreLimits
from inference_service.frontends.openai.schemas import ChatCompletionRequest, validation_error_param
from inference_service.frontends.openai.tool_calls import reader_of
from inference_service.frontends.openai.tools import ToolPlan, constraint_param
from inference_service.frontends.request_ids import ACCESS_MODEL, handler_headers, request_id
from inference_service.serving.core import InferenceCore

log = logging.getLogger("inference_service.openai")

_R = TypeVar("_R", bound=BaseModel)
#: ``ResponseError.code`` of a failure by HTTP status (OpenAI's codes; others are ``server_error``).
_FAILURE_CODES = {429: "rate_limit_exceeded", 400: "invalid_prompt", 413: "invalid_prompt"}


class Host(Protocol):
    """What the Responses routes use of :class:`~inference_service.frontends.openai.api.OpenAIApi`."""

    core: InferenceCore

    async def _parse(self, request: web.Request, schema: type[_R]) -> _R: ...

    def _resolve(self, model_id: str) -> tuple[str, str]: ...

    def error_of(self, exc: InferenceError) -> OpenAIError: ...


@dataclass
class Prepared:
    """A Responses request made ready to run: its translation, tool plan and handler request body."""

    translation: Translation
    plan: ToolPlan
    body: bytes
    text_format: bool  # ``text.format`` constrains the answer

    def param(self, llm_field: str | None) -> str | None:
        """The Responses field that set the LLM request's ``llm_field``."""
        constrained = self.plan.mode not in ("none", "auto")
        return self.translation.param(constraint_param(llm_field, tools_constrain=constrained,
                                                       response_format=self.text_format))


def _renamed(exc: InvalidRequest, param: str | None) -> InvalidRequest:
    """``exc`` naming ``param`` where it named the chat request's field."""
    message = str(exc)
    if exc.field and param and param != exc.field:
        message = message.replace(f"'{exc.field}'", f"'{param}'")
    return InvalidRequest(message, param)


def prepare(request: ResponsesRequest, history: list[dict[str, Any]]) -> Prepared:
    """The handler request of ``request`` after ``history`` (work that grows with the input: run
    off the loop). Raises InvalidRequest naming the Responses field."""
    translation = translate(request, history)
    fmt = request.text.format if request.text is not None else None
    try:
        chat = ChatCompletionRequest.model_validate(translation.chat)
    except ValidationError as exc:
        param, message = validation_error_param(exc)
        raise InvalidRequest(message, translation.param(param)) from None
    try:
        plan = chat.tool_plan()
    except InvalidRequest as exc:
        raise _renamed(exc, translation.param(exc.field)) from None
    prepared = Prepared(translation, plan, b"", fmt is not None and fmt.type != "text")
    try:
        prepared.body = chat.to_generation_request(plan).choice(0).to_body()
    except InvalidRequest as exc:
        raise _renamed(exc, prepared.param(exc.field)) from None
    return prepared


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _serialized(shape: dict[str, Any], conversation: list[dict[str, Any]] | None) -> tuple[bytes, bytes]:
    return _json(shape), _json(conversation)


class ResponsesApi:
    """The ``/v1/responses`` routes of ``host``'s sub-application; the store is made on first use
    from the server's settings (``responses_store_max_*``)."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self._store: ResponseStore | None = None

    @property
    def store(self) -> ResponseStore:
        if self._store is None:
            settings = self.host.core.settings
            self._store = ResponseStore(StoreLimits(settings.responses_store_max_entries,
                                                    settings.responses_store_max_bytes,
                                                    settings.responses_store_max_age_s))
        return self._store

    def _owner(self, request: web.Request) -> str:
        """Whose entries a request reads: a digest of its inference key (one owner when token
        authorization is off)."""
        if self.host.core.settings.disable_token_auth:
            return ""
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        return hashlib.sha256(token.strip().encode()).hexdigest()[:32] if scheme.lower() == "bearer" else ""

    def _stored(self, request: web.Request) -> tuple[str, StoredResponse]:
        response_id = request.match_info["response_id"]
        entry = self.store.get(response_id, self._owner(request))
        if entry is None:
            raise OpenAIError(404, f"Response with id '{response_id[:64]}' not found.")
        return response_id, entry

    async def retrieve(self, request: web.Request) -> web.Response:
        """``GET /v1/responses/{id}``: the stored response object; 404 when not stored (``store``
        false, evicted, another key's, never made)."""
        _, entry = self._stored(request)
        return web.Response(body=entry.response, content_type="application/json")

    async def delete(self, request: web.Request) -> web.Response:
        """``DELETE /v1/responses/{id}``: ``{"id", "object": "response", "deleted": true}``; 404 as GET."""
        response_id, _ = self._stored(request)
        self.store.delete(response_id, self._owner(request))
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    async def create(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/responses`` (answers, events and errors: docs/llm.md, "Responses API")."""
        body = await self.host._parse(request, ResponsesRequest)
        request[ACCESS_MODEL] = body.model
        name, version = self.host._resolve(body.model)
        owner = self._owner(request)
        history: list[dict[str, Any]] = []
        size = request.content_length or 0
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id, owner)
            if previous is None:
                raise OpenAIError(404, f"Previous response with id '{body.previous_response_id[:64]}' not found.",
                                  param="previous_response_id", code="previous_response_not_found")
            size += len(previous.conversation)
            history = await off_loop(json.loads, previous.conversation, size=len(previous.conversation))
        try:
            prepared = await off_loop(prepare, body, history, size=size)
        except InvalidRequest as exc:
            raise OpenAIError(400, str(exc), param=exc.field) from None
        headers = handler_headers(request.headers.items(), request.get("request_id") or request_id(None))
        if body.priority is not None:  # as on chat completions: the x-request-priority header's sense
            headers[PRIORITY_HEADER] = str(body.priority)
        shape = ResponseShape(body)
        builder = OutputBuilder(reader_of(prepared.plan))
        run = Run(self, request, owner, size, prepared, shape, builder)
        stream = self.host.core.stream(name, version, {"body": prepared.body}, headers)
        async with contextlib.aclosing(_texts(stream)) as texts:
            try:  # a failure before the first message is an error answer with its own status
                first = await anext(texts)
                if body.stream:
                    return await run.stream(first, texts)
                builder.feed(first[0])
                outcome = first[1]
                while outcome is None:
                    text, outcome = await anext(texts)
                    builder.feed(text)
            except InferenceError as exc:
                raise self._refusal(exc, prepared) from None
        answer = await run.finished(outcome)
        return web.Response(body=answer, content_type="application/json", headers=request.get(IGNORED_HEADERS))

    def _refusal(self, exc: InferenceError, prepared: Prepared) -> OpenAIError:
        """The error of a failure before the answer: the handler's 400 names the LLM's field first."""
        error = self.host.error_of(exc)
        named = NAMED_FIELD.match(exc.message) if exc.http_status == 400 else None
        error.param = prepared.param(named[1]) if named else error.param
        return error


async def _texts(stream: AsyncGenerator[tuple[bytes, bool], None]) -> AsyncGenerator[tuple[str, Outcome | None], None]:
    """``(text, None)`` of each intermediate message, then ``(last text, outcome)`` of the final one."""
    async with contextlib.aclosing(stream):
        async for payload, final in stream:
            if final:
                outcome = final_outcome(payload)
                yield outcome.text, outcome
                return
            yield piece_of(payload, False).text, None


class Run:
    """One request's answer being made: its events written (streamed), its end stored."""

    def __init__(self, api: ResponsesApi, request: web.Request, owner: str, size: int, prepared: Prepared,
                 shape: ResponseShape, builder: OutputBuilder) -> None:
        self.api, self.request, self.owner, self.size = api, request, owner, size
        self.prepared, self.shape, self.builder = prepared, shape, builder
        self.sequence = 0
        self.closing: list[dict[str, Any]] = []  # the events that close the output items
        self.whole: dict[str, Any] = {}  # the response object once finished

    def _conversation(self) -> list[dict[str, Any]]:
        """The conversation a chained request continues: this one's, instructions left out, and its output."""
        translation = self.prepared.translation
        skip = 1 if translation.origins[:1] == ["instructions"] else 0
        return translation.chat["messages"][skip:] + output_messages(self.builder.items)

    async def finished(self, outcome: Outcome) -> bytes:
        """The response object's JSON once the answer ended; stored (before any client sees the id)
        unless ``store`` is false or it exceeds the store's byte bound alone."""
        incomplete = outcome.reason == "length"
        self.closing = self.builder.finish(incomplete)
        whole = self.shape.object("incomplete" if incomplete else "completed", self.builder.items, outcome)
        conversation = self._conversation() if self.shape.store else None
        answer, kept = await off_loop(_serialized, whole, conversation, size=self.size)
        if self.shape.store and not self.api.store.put(self.shape.id, self.owner, answer, kept):
            log.warning("response %s not stored: its %d bytes exceed responses_store_max_bytes", self.shape.id,
                        len(answer) + len(kept))
            self.shape.store = whole["store"] = False
            answer = (await off_loop(_serialized, whole, None, size=self.size))[0]
        self.whole = whole
        return answer

    def _events(self, events: list[dict[str, Any]]) -> bytes:
        out = []
        for event in events:
            out.append(sse(event, self.sequence))
            self.sequence += 1
        return b"".join(out)

    async def stream(self, first: tuple[str, Outcome | None],
                     texts: AsyncGenerator[tuple[str, Outcome | None], None]) -> web.StreamResponse:
        """Send the typed events of the answer (``response.created`` ... ``response.completed``,
        ``response.incomplete`` at the token limit; ``error`` and ``response.failed`` for a late failure)."""
        request = self.request
        response = web.StreamResponse(headers={**SSE_HEADERS, **(request.get(IGNORED_HEADERS) or {})})
        opening = self.shape.object("in_progress", [])
        head = [{"type": "response.created", "response": opening}, {"type": "response.in_progress",
                                                                    "response": opening}]
        try:
            await response.prepare(request)
            await response.write(await off_loop(self._events, head, size=self.size))
            text, outcome = first
            while True:
                events = self.builder.feed(text)
                if outcome is not None:
                    break
                if events:
                    await response.write(self._events(events))
                text, outcome = await anext(texts)
            await self.finished(outcome)
            kind = "response.incomplete" if self.whole["status"] == "incomplete" else "response.completed"
            end = [*events, *self.closing, {"type": kind, "response": self.whole}]
            await response.write(await off_loop(self._events, end, size=self.size))
            await response.write_eof()
        except InferenceError as exc:  # the status line is gone: end with error events
            log.warning("HTTP stream of %s failed after its first event: %s", request.path, exc.message)
            error = self.api.host.error_of(exc)
            failed = self.shape.object("failed", self.builder.items, error={
                "code": _FAILURE_CODES.get(error.status, "server_error"), "message": exc.message})
            with contextlib.suppress(ConnectionResetError):
                await response.write(self._events([
                    {"type": "error", "code": error.code, "message": exc.message, "param": error.param},
                    {"type": "response.failed", "response": failed}]))
                await response.write_eof()
        except ConnectionResetError:  # the client went away; closing the stream aborts the request
            log.info("client of HTTP %s went away mid-stream", request.path)
        return response
