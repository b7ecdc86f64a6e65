"""The wire shapes of the OpenAI-compatible API: pydantic models of its requests and responses.

Requests (validated from the JSON body; a failure is a 400 ``invalid_request_error`` whose
``param`` names the field, see :func:`validation_error_param`):

- :class:`ChatCompletionRequest` (``POST /v1/chat/completions``) and
  :class:`CompletionRequest` (``POST /v1/completions``), with the fields of OpenAI's API that
  the bundled LLM handler can honour (``model``, ``messages`` / ``prompt`` (completions: a string
  or a list of them), ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``,
  ``seed``, ``stop``, ``n``, ``best_of`` and ``echo`` (completions), ``logprobs`` /
  ``top_logprobs``, ``stream``, ``stream_options.include_usage``, ``frequency_penalty``,
  ``presence_penalty``, ``response_format``; on chat ``tools``, ``tool_choice``,
  ``parallel_tool_calls``) plus vLLM's ``ignore_eos``, ``top_k``, ``repetition_penalty``,
  ``stop_token_ids``, ``structured_outputs`` and ``cache_salt`` extensions. Fields asking for
  something the handler cannot do (``logit_bias``, ``suffix``) are refused with their name as
  ``param``, unless they hold their neutral value. OpenAI's fields that change nothing here
  (``user``, ``metadata``, ``store``, ``service_tier``) are accepted; any other field is ignored,
  as vLLM does, and named by :meth:`~_Request.ignored_fields` (the door logs a warning and answers
  ``x-ignored-fields``). Types are strict, as OpenAI's: ``"1"`` is not a number.

Responses (serialized with ``model_dump_json``): :class:`ChatCompletion` /
:class:`ChatCompletionChunk`, :class:`Completion` / :class:`CompletionChunk`,
:class:`ModelList` / :class:`ModelCard`, :class:`ErrorResponse`.

A request becomes the one typed LLM request (``to_generation_request``, vLLM's
``to_sampling_params``), checked against the same limits as every other door.
:mod:`inference_service.frontends.openai.api` uses these models.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from inference_service.contracts.sampling import GenerationRequest, InvalidRequest
from inference_service.contracts.structured import MAX_TOOLS
from inference_service.frontends.openai.logprobs import ChatLogprobs, CompletionLogprobs
from inference_service.frontends.openai.tool_schemas import ToolCall, ToolCallDelta
from inference_service.frontends.openai.tools import ToolPlan, tool_plan

__all__ = [
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatMessage",
    "Completion",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionRequest",
    "Delta",
    "ErrorBody",
    "ErrorResponse",
    "FinishReason",
    "ModelCard",
    "ModelList",
    "ResponseMessage",
    "StreamOptions",
    "Usage",
    "validation_error_param",
]

#: Why a choice ended: ``stop`` (end of sequence or a stop string), ``length`` (the token limit),
#: ``tool_calls`` (the answer called tools).
FinishReason = Literal["stop", "length", "tool_calls"]


def _unsupported(what: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", "{what} is not supported by this server", {"what": what})


def _text_of_parts(parts: list[Any]) -> str:
    """The text of OpenAI content parts ``[{"type": "text", "text": "..."}, ...]``, joined.

    Raises:
        PydanticCustomError: a part that is not an object of type ``text`` with a string ``text``.
    """
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            # pydantic fills {name} placeholders from the context: no conversions such as !r
            raise PydanticCustomError("unsupported", "only text content parts are supported, got {kind}",
                                      {"kind": repr(kind)})
        text = part.get("text")
        if not isinstance(text, str):
            raise PydanticCustomError("string_type", "a text content part needs a string 'text'")
        texts.append(text)
    return "".join(texts)


class _Response(BaseModel):
    """Base of the response shapes: validators are built by :func:`build_shapes` (``defer_build``),
    which the server calls in a thread before it serves, so no request builds one on the loop."""

    model_config = ConfigDict(defer_build=True)


class _Request(BaseModel):
    """Common settings: strict types, unknown fields kept aside (``model_extra``) and ignored."""

    model_config = ConfigDict(strict=True, extra="allow", defer_build=True)

    def ignored_fields(self) -> list[str]:
        """The fields this request carried that no model declares, with their paths
        (``temprature``, ``messages[0].name``), sorted."""
        names = list(self.model_extra or ())
        for name in type(self).model_fields:
            value = getattr(self, name)
            items = enumerate(value) if isinstance(value, list) else [(None, value)]
            for i, item in items:
                if isinstance(item, _Request):
                    where = name if i is None else f"{name}[{i}]"
                    names += [f"{where}.{inner}" for inner in item.ignored_fields()]
        return sorted(names)


#: The base of every OpenAI request body (strict types, unknown fields named by ``ignored_fields``).
OpenAIRequest = _Request


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and no choices."""

    include_usage: bool | None = None


class ChatMessage(_Request):
    """One message of a chat. ``content`` is a string or a list of text parts (joined);
    ``developer`` is sent to the chat template as ``system`` (templates predate that role). An
    assistant message may carry ``tool_calls``, a ``tool`` message answers one (``tool_call_id``);
    the LLM request checks them (contracts/structured.py)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def to_llm(self) -> dict[str, Any]:
        """The message as the LLM request takes it: ``developer`` as ``system``, no content as ``""``
        (``None`` beside tool calls), unset fields left out."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self.content if self.content is not None or self.tool_calls else ""}
        for key in ("tool_calls", "tool_call_id", "name"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: Any) -> Any:
        return _text_of_parts(value) if isinstance(value, list) else value


class _SamplingRequest(_Request):
    """The fields both endpoints share (see the module docstring)."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None  # vLLM's extension: keep going past the end-of-sequence token
    top_k: int | None = None  # vLLM's extension, as the next two
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    cache_salt: str | None = None  # vLLM's: requests share cached prompt prefixes only with the same salt
    priority: int | None = None  # vLLM's: lower first in the job queue (contracts/controls.py)
    response_format: dict[str, Any] | None = None  # OpenAI's; checked by the LLM request
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension
    # accepted only at its neutral value
    logit_bias: dict[str, float] | None = None
    # OpenAI's, accepted and without effect here
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise _unsupported("logit_bias")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling(self, token_limit: int | None) -> dict[str, Any]:
        """The sampling parameters this request sets (``None``: the model's default), and always
        ``include_usage``: the final message then carries the finish reason and token counts."""
        return {"max_new_tokens": token_limit, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed, "stop": self.stop, "ignore_eos": self.ignore_eos, "top_k": self.top_k,
                "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "stop_token_ids": self.stop_token_ids,
                "cache_salt": self.cache_salt, "n": self.n, "response_format": self.response_format,
                "structured_outputs": self.structured_outputs, "include_usage": True}


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over ``max_tokens``; with
    neither the model's own default applies (the LLM handler's ``max_new_tokens``, 256)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    @property
    def token_limit(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens``, else ``None`` (the model's default)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def tool_plan(self) -> ToolPlan:
        """How the request uses its tools (InvalidRequest naming the field when they are malformed)."""
        return tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls)

    def to_generation_request(self, plan: ToolPlan | None = None) -> GenerationRequest:
        """The LLM request, with ``plan``'s tools and constraint. InvalidRequest for a value beyond the
        LLM's limits (``max_tokens`` above 4096), or a constraint beside the tool choice's (``tool_choice``)."""
        plan = plan or self.tool_plan()
        values = {"messages": [m.to_llm() for m in self.messages], **self._sampling(self.token_limit),
                  "logprobs": self.logprobs, "top_logprobs": self.top_logprobs}
        if plan.tools:
            values["tools"] = list(plan.tools)
        if plan.constraint is not None:
            if self.response_format not in (None, {"type": "text"}) or self.structured_outputs is not None:
                raise InvalidRequest(f"'tool_choice' {plan.mode!r} constrains the answer to tool calls: it cannot be "
                                     "combined with 'response_format' or 'structured_outputs'", "tool_choice")
            values["structured_outputs"] = plan.constraint
        return GenerationRequest.build(values)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: ``prompt`` is raw text for the model to continue (no chat
    template), or a list of such texts (a batch: each prompt its own ``n`` choices, indexed
    ``prompt index * n + i``, as vLLM's). ``logprobs`` is the number of alternatives per token
    (0: the sampled token's alone). ``max_tokens`` defaults to 16, as OpenAI's."""

    prompt: list[str] = Field(min_length=1)
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        if isinstance(value, list) and value and not all(isinstance(item, str) for item in value):
            raise _unsupported("a prompt of token ids (send text)")
        return [value] if isinstance(value, str) else value

    @field_validator("prompt")
    @classmethod
    def _no_empty_prompt(cls, value: list[str]) -> list[str]:
        if not all(value):
            raise PydanticCustomError("string_too_short", "a prompt must not be empty")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise _unsupported("suffix")
        return value

    @property
    def token_limit(self) -> int:
        """``max_tokens``, 16 when absent (OpenAI's default for completions)."""
        return self.max_tokens if self.max_tokens is not None else 16

    def to_generation_requests(self) -> list[GenerationRequest]:
        """The LLM request of each prompt (raises ``InvalidRequest`` as the chat's does)."""
        logprobs = {"logprobs": self.logprobs is not None or None, "top_logprobs": self.logprobs,
                    "best_of": self.best_of}
        return [GenerationRequest.build({"prompt": prompt, **self._sampling(self.token_limit), **logprobs})
                for prompt in self.prompt]


def validation_error_param(error: ValidationError) -> tuple[str | None, str]:
    """``(param, message)`` of the first problem of a request's :class:`ValidationError`.

    ``param`` is the field's path in OpenAI's style (``messages[0].content``), ``None`` for the
    body as a whole (not JSON, not an object); ``message`` is pydantic's, prefixed with the path.
    """
    first = error.errors(include_url=False)[0]
    param = ""
    for part in first["loc"]:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    if first["type"] == "json_invalid":
        return None, f"We could not parse the JSON body of your request: {first['msg']}"
    return (param or None), (f"{param}: {first['msg']}" if param else first["msg"])


# ---------------------------------------------------------------------------------- responses
class Usage(_Response):
    """Token counts of one request (tokens of the model's tokenizer)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ResponseMessage(_Response):
    """The assistant's message of a non-streamed chat completion (``content`` ``null`` beside tool calls)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatChoice(_Response):
    """One choice of a :class:`ChatCompletion`."""

    index: int = 0
    message: ResponseMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None = None


class ChatCompletion(_Response):
    """A non-streamed chat completion (``object: chat.completion``)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int  # Unix seconds
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class Delta(_Response):
    """What a chunk adds to the message: ``role`` in the first chunk, then ``content``; the
    finishing chunk's delta is empty (fields that are ``None`` are left out)."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=lambda v: v is None)
    content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatChunkChoice(_Response):
    """One choice of a :class:`ChatCompletionChunk`; ``finish_reason`` only on its last."""

    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Response):
    """One server-sent event of a streamed chat completion (``object: chat.completion.chunk``).

    With ``include_usage`` every chunk carries ``usage: null`` except an extra last one whose
    ``choices`` is empty and whose ``usage`` is set; without it the API leaves ``usage`` out
    (``model_dump_json(exclude={"usage"})``).
    """

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(_Response):
    """One choice of a :class:`Completion` or :class:`CompletionChunk` (``text`` is the
    whole text, or a chunk's new text)."""

    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(_Response):
    """A non-streamed completion (``object: text_completion``)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CompletionChunk(Completion):
    """One server-sent event of a streamed completion: same shape as :class:`Completion`, as
    OpenAI's (``object: text_completion``), each chunk with the new text."""


class ModelCard(_Response):
    """One entry of ``GET /v1/models``: ``id`` is what requests put in ``model``."""

    id: str
    object: Literal["model"] = "model"
    created: int  # Unix seconds: when the server started
    owned_by: str = "inference-service"
    chat_template: str | None = None  # an addition: the chat template the model renders messages with
    state: str | None = None  # an addition: READY, SLEEPING or WAKING (serving/sleep.py)


class ModelList(_Response):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(_Response):
    """OpenAI's error object: ``type`` classifies (``invalid_request_error``, ``server_error``, ...),
    ``param`` names the request field at fault, ``code`` is a stable machine-readable reason."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    """The body of every failed /v1 request, and the data of a stream's error event."""

    error: ErrorBody


def build_shapes() -> None:
    """Build the validators and serializers ``defer_build`` put off (20-50 ms in all)."""
    for shape in (ChatCompletionRequest, CompletionRequest, ChatCompletion, ChatCompletionChunk, Completion,
                  CompletionChunk, ModelList, ModelCard, ErrorResponse):
        shape.model_rebuild()
