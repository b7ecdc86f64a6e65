"""OpenAI's HTTP API for LLM models, on the HTTP inference port, over the same core as gRPC.

An aiohttp sub-application mounted at ``/v1`` on the first ``/v1`` request, behind the HTTP
API's token authorization. A request becomes the typed LLM request
(:mod:`inference_service.contracts.sampling`) and runs through :meth:`InferenceCore.stream`, so
concurrent requests share the LLM worker's continuous batch. Routes, answers and error codes:
see docs/clients.md.

Quick start::

    api = OpenAIApi(core, http_status)   # what openai_mount builds on the first /v1 request
    app.add_subapp("/v1", api.app)       # or mount it directly
    client = openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key=inference_key)
    client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from inference_service.contracts.controls import PRIORITY_HEADER
from inference_service.contracts.embeddings import InvalidEmbeddingRequest
from inference_service.contracts.sampling import GenerationRequest, InvalidRequest
from inference_service.errors import InferenceError, InvalidArgument
from inference_service.frontends.limits import check_json_nodes, off_loop, refuse_form
from inference_service.frontends.openai.audio import AudioApi
from inference_service.frontends.openai.choices import (
    Candidate,
    ChoiceError,
    ChoicePlan,
    merged,
    total_usage,
    whole_choices,
)
from inference_service.frontends.openai.embeddings import NotAnObject, handler_refusal_param, parse_embedding_body
from inference_service.frontends.openai.errors import (
    IGNORED_FIELDS_HEADER,
    IGNORED_HEADERS,
    NAMED_FIELD,
    SSE_HEADERS,
    OpenAIError,
    openai_error_response,
)
from inference_service.frontends.openai.format import (
    AnswerFormat,
    ChatFormat,
    CompletionFormat,
    Outcome,
    final_outcome,
    piece_of,
    sse_event,
)
from inference_service.frontends.openai.rerank import rerank_route
from inference_service.frontends.openai.responses import ResponsesApi
from inference_service.frontends.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    validation_error_param,
)
from inference_service.frontends.openai.tokenizer import DetokenizeBody, TokenizeBody
from inference_service.frontends.openai.tool_calls import ToolChatFormat
from inference_service.frontends.openai.tools import constraint_param
from inference_service.frontends.request_ids import ACCESS_MODEL, handler_headers, request_id
from inference_service.serving.core import InferenceCore

log = logging.getLogger("inference_service.openai")

_DONE = b"data: [DONE]\n\n"
_R = TypeVar("_R", bound=BaseModel)
_SHOWN_IGNORED = 20


def unauthorized_response(request: web.Request) -> web.Response:
    """401 for a /v1 request without the inference key, as OpenAI answers a missing or wrong
    ``api_key`` (code ``invalid_api_key``, ``WWW-Authenticate: Bearer``)."""
    message = ("Incorrect API key provided." if "Authorization" in request.headers
               else "You didn't provide an API key. Send it as 'Authorization: Bearer <inference key>' "
                    "(the inference key of key_file.json).")
    return openai_error_response(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def openai_param(openai_request: ChatCompletionRequest | CompletionRequest, field: str | None) -> str | None:
    """The OpenAI request field that set the LLM request's ``field`` (``max_new_tokens`` comes
    from ``max_completion_tokens`` or ``max_tokens``; a completion's ``top_logprobs`` from ``logprobs``;
    ``structured_outputs`` from ``tools`` or ``response_format`` when they set it)."""
    if field == "top_logprobs" and isinstance(openai_request, CompletionRequest):
        return "logprobs"
    if field != "max_new_tokens":
        tool_choice = getattr(openai_request, "tool_choice", None)
        return constraint_param(field, tools_constrain=tool_choice not in (None, "none", "auto"),
                                response_format=openai_request.response_format is not None)
    return "max_completion_tokens" if getattr(openai_request, "max_completion_tokens", None) else "max_tokens"


def _generation_requests(openai_request: ChatCompletionRequest | CompletionRequest) -> list[GenerationRequest]:
    """The LLM requests of an OpenAI request, one per prompt (InvalidRequest names the LLM's field)."""
    if isinstance(openai_request, CompletionRequest):
        return openai_request.to_generation_requests()
    return [openai_request.to_generation_request()]


class OpenAIApi:
    """The /v1 routes on an aiohttp sub-application (``self.app``).

    ``http_status`` maps an :class:`InferenceError` as the HTTP API does; ``JOB_QUEUE_FULL`` is 429 here.
    """

    def __init__(self, core: InferenceCore, http_status: Callable[[InferenceError], int]) -> None:
        self.core = core
        self.http_status = http_status
        self.started = int(time.time())
        self.app = web.Application(middlewares=[self._errors_middleware])
        self.app.router.add_get("/models", self.list_models, allow_head=False)
        self.app.router.add_get("/models/{model_id:.+}", self.retrieve_model, allow_head=False)
        self.app.router.add_post("/chat/completions", self.chat_completions)
        self.app.router.add_post("/completions", self.completions)
        self.app.router.add_post("/embeddings", self.embeddings)
        audio = AudioApi(self)  # POST /audio/transcriptions and /audio/translations
        self.audio_transcriptions, self.audio_translations = audio.transcriptions, audio.translations
        self.app.router.add_post("/audio/transcriptions", audio.transcriptions)
        self.app.router.add_post("/audio/translations", audio.translations)
        responses = ResponsesApi(self)  # POST /responses, GET and DELETE /responses/{response_id}
        self.create_response, self.retrieve_response = responses.create, responses.retrieve
        self.delete_response = responses.delete
        self.app.router.add_post("/responses", responses.create)
        self.app.router.add_get("/responses/{response_id}", responses.retrieve, allow_head=False)
        self.app.router.add_delete("/responses/{response_id}", responses.delete)
        self.app.router.add_post("/rerank", self.rerank)
        self.app.router.add_post("/score", self.score)

    # ------------------------------------------------------------ errors
    def error_of(self, exc: InferenceError) -> OpenAIError:
        """The OpenAI error of a core or handler failure: the HTTP API's status (429 for a full
        job queue), code = the reason in lower case, ``param`` ``model`` for an unknown model."""
        status = 429 if exc.reason == "JOB_QUEUE_FULL" else self.http_status(exc)
        headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))} if exc.retry_after_s is not None else None
        return OpenAIError(status, exc.message, param="model" if exc.reason == "MODEL_NOT_FOUND" else None,
                           code=exc.reason.lower(), headers=headers)

    @web.middleware
    async def _errors_middleware(self, request: web.Request,
                                 handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Answer every /v1 failure with OpenAI's error body (statuses: docs/clients.md)."""
        try:
            return await handler(request)
        except OpenAIError as exc:
            return exc.response()
        except InferenceError as exc:
            return self.error_of(exc).response()
        except web.HTTPRequestEntityTooLarge:
            return openai_error_response(413, f"request body exceeds max_request_size={request.client_max_size} bytes",
                                         code="request_too_large")
        except web.HTTPMethodNotAllowed as exc:
            return openai_error_response(405, f"Method {request.method} is not allowed on {request.path}",
                                         headers={"Allow": ", ".join(sorted(exc.allowed_methods))})
        except web.HTTPNotFound:
            return openai_error_response(404, f"Invalid URL ({request.method} {request.path})", code="unknown_url")
        except web.HTTPException as exc:
            return openai_error_response(exc.status, exc.reason)
        except ConnectionResetError:  # aiohttp's "Connection lost" while the body was being read
            log.info("HTTP %s %s: the connection closed before the whole request body arrived",
                     request.method, request.path)
            return openai_error_response(400, "the connection closed before the whole request body arrived")
        except Exception:
            log.exception("HTTP %s %s failed", request.method, request.path)
            return openai_error_response(500, "Internal server error")

    # ------------------------------------------------------------ models
    def _resolve(self, model_id: str) -> tuple[str, str]:
        """``(name, version)`` of a ``model`` name or ``name/version``; 404 ``model_not_found``."""
        if model_id in self.core.models:
            return model_id, ""
        name, _, version = model_id.rpartition("/")
        entry = self.core.models.get(name)
        if entry is not None and version in entry.versions:
            return name, version
        raise OpenAIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")

    def _ids(self) -> list[str]:
        """The LLM models' ids: a name whose default version is one, then its versions that are."""
        ids = []
        for name in sorted(self.core.models):
            entry = self.core.models[name]
            default = entry.versions.get(entry.default_version)
            if default is not None and default.accepts_generation:
                ids.append(name)
            ids += [f"{name}/{version}" for version in sorted(entry.versions)
                    if entry.versions[version].accepts_generation]
        return ids

    def _card(self, model_id: str) -> ModelCard:
        """The model card of ``model_id`` (one of :meth:`_ids`), with its chat template when known."""
        name, version = self._resolve(model_id)
        entry = self.core.models[name]
        model = entry.versions.get(version or entry.default_version)
        return ModelCard(id=model_id, created=self.started, chat_template=model.chat_template if model else None,
                         state=model.sleep.state.value if model else None)

    async def list_models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: the models whose handler takes the LLM request (``created``: server start)."""
        cards = [self._card(model_id) for model_id in self._ids()]
        return web.Response(text=ModelList(data=cards).model_dump_json(exclude_none=True),
                            content_type="application/json")

    async def retrieve_model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}``: one model card of :meth:`list_models`; 404 ``model_not_found`` else."""
        model_id = request.match_info["model_id"]
        if model_id not in self._ids():
            raise OpenAIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return web.Response(text=self._card(model_id).model_dump_json(exclude_none=True),
                            content_type="application/json")

    # ------------------------------------------------------------ generation
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions`` (answers and errors: docs/clients.md)."""
        chat = await self._parse(request, ChatCompletionRequest)
        try:
            plan = await off_loop(chat.tool_plan, size=request.content_length or 0)
        except InvalidRequest as exc:
            raise OpenAIError(400, str(exc), param=openai_param(chat, exc.field)) from None
        return await self._run(request, chat, ChatFormat(chat.model) if plan.mode == "none"
                               else ToolChatFormat(chat.model, plan))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions`` (answers and errors: docs/clients.md)."""
        completion = await self._parse(request, CompletionRequest)
        if completion.echo and completion.logprobs is not None:
            raise OpenAIError(400, "'echo' with 'logprobs' needs the prompt's log probabilities, which the engines "
                                   "do not compute; ask for one or the other", param="echo")
        return await self._run(request, completion, CompletionFormat(completion.model, completion.prompt,
                                                                     completion.n or 1, bool(completion.echo)))

    async def tokenize(self, request: web.Request) -> web.Response:
        """``POST /tokenize``: vLLM's, a prompt's or a chat's token ids by the model's tokenizer."""
        return await self._tokenizer(request, TokenizeBody)

    async def detokenize(self, request: web.Request) -> web.Response:
        """``POST /detokenize``: vLLM's, the text of token ids."""
        return await self._tokenizer(request, DetokenizeBody)

    async def _tokenizer(self, request: web.Request, schema: type[TokenizeBody] | type[DetokenizeBody]) -> web.Response:
        """Run a tokenizer request in the model's worker (its handler answers it with its tokenizer)."""
        body = await self._parse(request, schema)
        request[ACCESS_MODEL] = body.model
        name, version = self._resolve(body.model)
        if body.model not in self._ids():
            raise OpenAIError(400, f"The model `{body.model}` does not take LLM requests: {request.path} needs an "
                                   "LLM's tokenizer", param="model")
        try:
            asked = body.to_request()
        except InvalidRequest as exc:
            raise OpenAIError(400, str(exc), param=exc.field) from None
        headers = handler_headers(request.headers.items(), request.get("request_id") or request_id(None))
        try:
            payload = await self.core.predict(name, version, {"body": asked.to_body()}, headers)
        except InferenceError as exc:  # the handler's 400 names the field: OpenAI's param
            error = self.error_of(exc)
            error.param = handler_refusal_param(exc) or error.param
            raise error from None
        return web.Response(body=payload, content_type="application/json", headers=request.get(IGNORED_HEADERS))

    async def embeddings(self, request: web.Request) -> web.Response:
        """``POST /v1/embeddings``: the body, checked, to the model's handler, which answers
        OpenAI's JSON (answers and errors: docs/embeddings.md)."""
        raw = await request.read()
        try:
            settings = self.core.settings
            embedding = await off_loop(parse_embedding_body, raw, settings.max_json_depth, settings.max_json_nodes,
                                       size=len(raw))
        except InvalidArgument as exc:
            raise OpenAIError(400, exc.message) from None
        except NotAnObject as exc:
            raise OpenAIError(400, str(exc)) from None
        except InvalidEmbeddingRequest as exc:
            raise OpenAIError(400, str(exc), param=exc.field) from None
        request[ACCESS_MODEL] = embedding.model
        name, version = self._resolve(str(embedding.model))
        headers = handler_headers(request.headers.items(), request.get("request_id") or request_id(None))
        try:
            payload = await self.core.predict(name, version, {"body": raw}, headers)
        except InferenceError as exc:  # the handler's 400 names the field: OpenAI's param
            error = self.error_of(exc)
            error.param = handler_refusal_param(exc) or error.param
            raise error from None
        return web.Response(body=payload, content_type="application/json")

    async def rerank(self, request: web.Request) -> web.Response:
        """``POST /v1/rerank`` (also ``/rerank``, ``/v2/rerank``): answers and errors in docs/rerank.md."""
        return await rerank_route(self, request, "rerank", OpenAIError)

    async def score(self, request: web.Request) -> web.Response:
        """``POST /v1/score``, vLLM's: answers and errors in docs/rerank.md."""
        return await rerank_route(self, request, "score", OpenAIError)

    async def _parse(self, request: web.Request, schema: type[_R]) -> _R:
        """The validated request body; OpenAIError 400 (``param`` names the field) if invalid."""
        raw = await request.read()
        try:
            refuse_form(request.content_type, raw)
        except InvalidArgument as exc:
            raise OpenAIError(400, exc.message, code=exc.reason.lower()) from None
        try:  # parsed and validated in a thread when large (pydantic's parser holds no loop then)
            check_json_nodes(raw, self.core.settings.max_json_nodes)  # nor one long call: bounded first
            parsed = await off_loop(schema.model_validate_json, raw, size=len(raw))
        except InvalidArgument as exc:
            raise OpenAIError(400, exc.message) from None
        except ValidationError as exc:
            param, message = validation_error_param(exc)
            raise OpenAIError(400, message, param=param) from None
        fields_of = getattr(parsed, "ignored_fields", None)
        ignored: list[str] = fields_of() if callable(fields_of) else []
        if ignored:  # served, as vLLM serves it; the client learns of them from the header
            names = [n[:64] if n.isascii() and n.isprintable() else ascii(n[:64]) for n in ignored[:_SHOWN_IGNORED]]
            shown = ", ".join(names) + (", ..." if len(ignored) > _SHOWN_IGNORED else "")
            log.warning("HTTP %s %s: ignored unknown field(s) %s", request.method, request.path, shown)
            request[IGNORED_HEADERS] = {IGNORED_FIELDS_HEADER: shown}
        return parsed

    async def _run(self, request: web.Request, openai_request: ChatCompletionRequest | CompletionRequest,
                   fmt: AnswerFormat) -> web.StreamResponse:
        """Run the request's choices on the core and answer in ``fmt``'s shape.

        A failure before every choice's first message is an error answer with its own status;
        closing the merged streams (always) aborts the requests still running in the worker.
        """
        request[ACCESS_MODEL] = openai_request.model  # the access line names the body's model
        name, version = self._resolve(openai_request.model)
        try:  # tools and schemas are checked in a thread when the body is large
            requests = await off_loop(_generation_requests, openai_request, size=request.content_length or 0)
            plan = ChoicePlan.of(requests, bool(openai_request.stream), self.core.settings.max_engine_requests)
        except InvalidRequest as exc:  # the message names the LLM's field, param the OpenAI one
            raise OpenAIError(400, str(exc), param=openai_param(openai_request, exc.field)) from None
        except ChoiceError as exc:
            raise OpenAIError(400, str(exc), param=exc.param) from None
        headers = handler_headers(request.headers.items(), request.get("request_id") or request_id(None))
        if openai_request.priority is not None:  # vLLM's body field, the x-request-priority header's sense
            headers[PRIORITY_HEADER] = str(openai_request.priority)
        group = secrets.token_hex(8) if len(plan.bodies) > 1 else None  # the choices share the queue's fairness
        streams = [self.core.stream(name, version, {"body": body}, headers, group=group) for body in plan.bodies]
        candidates = [Candidate() for _ in plan.bodies]
        try:
            async with contextlib.aclosing(merged(streams)) as messages:
                if openai_request.stream:
                    return await self._stream(request, messages, plan, fmt, openai_request.include_usage)
                async for index, payload, final in messages:
                    candidate = candidates[index]
                    if final:
                        candidate.outcome = final_outcome(payload)
                        candidate.texts.append(candidate.outcome.text)
                        candidate.logprobs += candidate.outcome.logprobs or ()
                    else:
                        piece = piece_of(payload, plan.logprobs or plan.best_of > plan.n)
                        candidate.texts.append(piece.text)
                        candidate.logprobs += piece.logprobs
        except InferenceError as exc:  # before any answer: the handler's 400 names the LLM's field first
            error = self.error_of(exc)
            named = NAMED_FIELD.match(exc.message) if exc.http_status == 400 else None
            error.param = openai_param(openai_request, named[1]) if named else error.param
            raise error from None
        outcomes = [c.outcome for c in candidates if c.outcome is not None]
        answer = fmt.whole(whole_choices(plan, candidates), total_usage(plan, outcomes))
        return web.Response(text=answer.model_dump_json(), content_type="application/json",
                            headers=request.get(IGNORED_HEADERS))

    async def _stream(self, request: web.Request, messages: AsyncGenerator[tuple[int, bytes, bool], None],
                      plan: ChoicePlan, fmt: AnswerFormat, include_usage: bool) -> web.StreamResponse:
        """Send the server-sent events of a streamed answer, once every choice has its first message."""
        exclude = None if include_usage else {"usage"}
        held: list[tuple[int, bytes, bool]] = []
        waiting = set(range(len(plan.bodies)))
        while waiting:  # a failure before this raises: the answer is an error status
            item = await anext(messages)
            held.append(item)
            waiting.discard(item[0])
        response = web.StreamResponse(headers={**SSE_HEADERS, **(request.get(IGNORED_HEADERS) or {})})
        events = [event for index in range(len(plan.bodies)) for event in fmt.opening(index)]
        outcomes: list[Outcome | None] = [None] * len(plan.bodies)

        def add(index: int, payload: bytes, final: bool) -> None:
            if final:
                outcome = outcomes[index] = final_outcome(payload)
                outcome.logprobs = outcome.logprobs if plan.logprobs else None
                events.extend(fmt.closing(index, outcome))
                return
            piece = piece_of(payload, plan.logprobs)
            if piece.text or piece.logprobs:
                event = fmt.piece(index, piece.text, piece.logprobs if plan.logprobs else None)
                if event is not None:  # None: held (a tool call read so far)
                    events.append(event)

        try:
            await response.prepare(request)
            for item in held:
                add(*item)
            while not all(outcomes):
                if events:
                    await response.write(b"".join(sse_event(event, exclude) for event in events))
                    events.clear()
                add(*await anext(messages))
            usage = total_usage(plan, [o for o in outcomes if o is not None])
            if include_usage and usage is not None:
                events.append(fmt.usage(usage))
            await response.write(b"".join(sse_event(event, exclude) for event in events) + _DONE)
            await response.write_eof()
        except InferenceError as exc:  # the status line is gone: end with an error event
            log.warning("HTTP stream of %s failed after its first chunk: %s", request.path, exc.message)
            with contextlib.suppress(ConnectionResetError):
                await response.write(self.error_of(exc).event())
                await response.write_eof()
        except ConnectionResetError:  # the client went away while we wrote; the caller closes the streams
            log.info("client of HTTP %s went away mid-stream", request.path)
        return response
