"""The wire shapes of the OpenAI-compatible API: pydantic models of its requests and responses.

Requests (validated from the JSON body; a failure is a 400 ``invalid_request_error`` whose
``param`` names the field, see :func:`validation_error_param`):

- :class:`ChatCompletionRequest` (``POST /v1/chat/completions``) and
  :class:`CompletionRequest` (``POST /v1/completions``), with the fields of OpenAI's API that
  the bundled LLM handler can honour (``model``, ``messages`` / ``prompt``, ``max_tokens`` /
  ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``n``, ``stream``,
  ``stream_options.include_usage``, ``frequency_penalty``, ``presence_penalty``,
  ``response_format``; on chat ``tools``, ``tool_choice``, ``parallel_tool_calls``) plus vLLM's
  ``ignore_eos``, ``top_k``, ``repetition_penalty``, ``stop_token_ids`` and ``structured_outputs``
  extensions. Fields asking for something the handler cannot do (``n`` > 1, ``logprobs``, ...)
  are refused with their name as ``param``, unless they hold their neutral value (``n: 1``,
  ``logprobs: false``, ...). Other unknown
  fields (``user``, ``metadata``, ``store``, ...) are ignored, as vLLM does, so clients that
  always send them work. Types are strict, as OpenAI's: ``"1"`` is not a number.

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
    """Base of the response shapes: validators are built on first use (``defer_build``), not
    at import, so a server that never answers ``/v1`` does not hold them (about 10 MiB)."""

    model_config = ConfigDict(defer_build=True)


class _Request(BaseModel):
    """Common settings: strict types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", defer_build=True)


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
    response_format: dict[str, Any] | None = None  # OpenAI's; checked by the LLM request
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension
    # accepted only at its neutral value
    logit_bias: dict[str, float] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise _unsupported(f"n={value} (only n=1)")
        return value

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
                "response_format": self.response_format, "structured_outputs": self.structured_outputs,
                "include_usage": True}


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

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise _unsupported("logprobs")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise _unsupported("top_logprobs")
        return value

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
        values = {"messages": [m.to_llm() for m in self.messages], **self._sampling(self.token_limit)}
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
    template); a list holding one string is that string. ``max_tokens`` defaults to 16, as
    OpenAI's."""

    prompt: str = Field(min_length=1)
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list):
            if len(value) != 1 or not isinstance(value[0], str):
                raise _unsupported("a prompt other than one string (a batch of prompts or token ids)")
            return value[0]
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool | None) -> bool | None:
        if value:
            raise _unsupported("echo")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise _unsupported("logprobs")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise _unsupported("best_of > 1")
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

    def to_generation_request(self) -> GenerationRequest:
        """The LLM request (raises ``InvalidRequest`` as the chat's does)."""
        return GenerationRequest.build({"prompt": self.prompt, **self._sampling(self.token_limit)})


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
    """The one choice of a :class:`ChatCompletion`."""

    index: int = 0
    message: ResponseMessage
    finish_reason: FinishReason
    logprobs: None = None


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
    """The one choice of a :class:`ChatCompletionChunk`; ``finish_reason`` only on the last."""

    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: None = None


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
    """The one choice of a :class:`Completion` or :class:`CompletionChunk` (``text`` is the
    whole text, or a chunk's new text)."""

    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: None = None


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
