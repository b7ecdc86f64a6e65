"""``POST /v1/responses``: OpenAI's Responses request, validated, and its translation into the chat
completion request every other door builds (one request model behind every door).

``input`` (a string, or message / ``function_call`` / ``function_call_output`` items) becomes chat
messages after ``instructions`` (a system message) and the stored conversation of
``previous_response_id``; function ``tools`` become chat tools, ``text.format`` the
``response_format``, ``max_output_tokens`` the ``max_completion_tokens``. Fields asking for what
runs only on OpenAI's servers (built-in tools, ``reasoning``, ``background``, ``conversation``,
``prompt``) are refused with their name as ``param``; a refusal of the chat request is answered
with the Responses field that set the chat field (:meth:`Translation.param`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, field_validator

from inference_service.contracts.request_error import InvalidRequest
from inference_service.contracts.structured import MAX_TOOLS
from inference_service.frontends.openai.schemas import OpenAIRequest

#: Input message roles (OpenAI's); ``developer`` reaches the chat template as ``system``.
ROLES = ("user", "assistant", "system", "developer")
#: Content parts read as text: the input's, and an earlier answer's passed back.
TEXT_PARTS = ("input_text", "output_text", "text")
#: ``include`` values that ask for nothing this server produces (no reasoning, no built-in tools).
_NOTHING_TO_INCLUDE = re.compile(r"reasoning\..*|.*_call\..*|.*_call_output\..*")


class ContentPart(OpenAIRequest):
    """One part of a message's or a function output's ``content``: text (``input_text``,
    ``output_text``); an earlier answer's ``annotations`` and ``logprobs`` are accepted as they come."""

    type: str
    text: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputItem(OpenAIRequest):
    """One item of ``input``: a message (``type`` ``message`` or absent), a ``function_call`` the
    model made, or the ``function_call_output`` answering it. ``id``, ``status`` and ``phase`` of an
    item passed back from an earlier answer are accepted without effect."""

    type: str | None = None
    role: str | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionTool(OpenAIRequest):
    """One of ``tools``: ``{"type": "function", "name", "description", "parameters", "strict"}``; the
    other types are OpenAI's built-in tools, refused by name."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def echoed(self) -> dict[str, Any]:
        """The tool as a response object lists it."""
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": self.strict}


class TextFormat(OpenAIRequest):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``, ``strict``,
    ``description``); ``strict`` is always honoured, as on ``/v1/chat/completions``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    def response_format(self) -> dict[str, Any]:
        """The chat ``response_format`` of this format (InvalidRequest naming the missing field)."""
        if self.type != "json_schema":
            return {"type": self.type}
        if not self.name:
            raise InvalidRequest("'text.format.name' is required for a json_schema format", "text.format.name")
        if self.schema_ is None:
            raise InvalidRequest("'text.format.schema' is required: the JSON schema of the answer",
                                 "text.format.schema")
        spec = {"name": self.name, "schema": self.schema_, "strict": self.strict, "description": self.description}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}

    def echoed(self) -> dict[str, Any]:
        shown = {"type": self.type, "name": self.name, "schema": self.schema_, "strict": self.strict,
                 "description": self.description}
        return {k: v for k, v in shown.items() if v is not None}


class TextConfig(OpenAIRequest):
    """``text``: its ``format`` (``verbosity`` is not declared: ignored and named)."""

    format: TextFormat | None = None


class ResponsesRequest(OpenAIRequest):
    """``POST /v1/responses`` (fields: the module docstring; ``store`` defaults to true, as OpenAI's)."""

    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1)
    stream: bool | None = None
    store: bool | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    metadata: dict[str, str] | None = None
    priority: int | None = None  # vLLM's: lower first in the job queue (contracts/controls.py)
    # refused unless neutral (:meth:`refusal`)
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    conversation: Any = None
    prompt: Any = None
    # OpenAI's, accepted and without effect here
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    max_tool_calls: int | None = None

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list[InputItem]) -> str | list[InputItem]:
        if isinstance(value, list) and not value:
            raise ValueError("must hold at least one item")
        return value

    def refusal(self) -> InvalidRequest | None:
        """What this server cannot do that the request asks for, naming the field (``None``: nothing)."""
        checks = (
            (self.background is True, "background", "background mode is not supported: send the request and wait"),
            (self.conversation is not None, "conversation", "conversations are not supported: chain responses "
                                                            "with previous_response_id"),
            (self.prompt is not None, "prompt", "stored prompt templates are not supported: send input"),
            (self.truncation == "auto", "truncation", "'auto' is not supported: a conversation beyond the "
                                                      "context is refused"),
            (bool(self.top_logprobs), "top_logprobs", "log probabilities are not supported on this API: "
                                                      "use /v1/chat/completions"),
        )
        for refused, name, message in checks:
            if refused:
                return InvalidRequest(f"'{name}': {message}", name)
        for key, value in (self.reasoning or {}).items():
            if value is not None:
                return InvalidRequest(f"'reasoning.{key}' is not supported: the models here do not reason "
                                      "apart from their answer", f"reasoning.{key}")
        for i, wanted in enumerate(self.include or ()):
            if not _NOTHING_TO_INCLUDE.fullmatch(wanted):
                return InvalidRequest(f"'include[{i}]': {wanted[:64]!r} is not supported", f"include[{i}]")
        return None


@dataclass
class Translation:
    """A Responses request as a chat completion request body, and where each chat message came
    from (``origins[k]``: ``instructions``, ``previous_response_id``, ``input`` or ``input[i]``;
    ``call_origins[k][j]``: the item of tool call ``j`` of message ``k``)."""

    chat: dict[str, Any]
    origins: list[str] = field(default_factory=list)
    call_origins: dict[int, list[str]] = field(default_factory=dict)
    history: int = 0  # messages before the request's own input (instructions, previous conversation)

    def param(self, chat_param: str | None) -> str | None:
        """The Responses field that set ``chat_param`` (a chat request field or an LLM field path)."""
        if chat_param is None:
            return None
        if chat_param in ("max_tokens", "max_completion_tokens", "max_new_tokens"):
            return "max_output_tokens"
        if chat_param.startswith("response_format"):
            rest = chat_param.removeprefix("response_format").removeprefix(".json_schema")
            return "text.format" + rest
        if chat_param.startswith("tools["):
            return chat_param.replace(".function.", ".", 1).replace(".function", "", 1)
        found = re.fullmatch(r"messages\[(\d+)\](.*)", chat_param)
        if found is None:
            return chat_param
        k, rest = int(found[1]), found[2]
        if k >= len(self.origins):
            return "input"
        calls = re.fullmatch(r"\.tool_calls\[(\d+)\](.*)", rest)
        if calls is not None and int(calls[1]) < len(self.call_origins.get(k, ())):
            inner = {".id": ".call_id", ".function.name": ".name", ".function.arguments": ".arguments"}
            return self.call_origins[k][int(calls[1])] + inner.get(calls[2], "")
        origin = self.origins[k]
        if not origin.startswith("input["):
            return origin
        return origin + {".tool_call_id": ".call_id", ".content": ".content", ".role": ".role"}.get(rest, "")


def _text(parts: str | list[ContentPart] | None, where: str) -> str:
    """The text of a ``content`` or ``output``: a string, or text parts joined."""
    if parts is None:
        raise InvalidRequest(f"'{where}' is required", where)
    if isinstance(parts, str):
        return parts
    texts = []
    for j, part in enumerate(parts):
        if part.type not in TEXT_PARTS:
            raise InvalidRequest(f"'{where}[{j}].type': only text parts ({', '.join(TEXT_PARTS[:2])}) are "
                                 f"supported, got {part.type[:64]!r}", f"{where}[{j}].type")
        if part.text is None:
            raise InvalidRequest(f"'{where}[{j}].text' is required", f"{where}[{j}].text")
        texts.append(part.text)
    return "".join(texts)


def _required(value: str | None, where: str) -> str:
    if not value:
        raise InvalidRequest(f"'{where}' is required: a non-empty string", where)
    return value


def items_to_messages(items: list[InputItem], where: str, out: Translation) -> None:
    """Append the chat messages of ``items`` (``input`` or a stored output) to ``out.chat["messages"]``:
    consecutive function calls join the assistant message before them, as one turn's calls do."""
    messages: list[dict[str, Any]] = out.chat["messages"]
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        kind = item.type or "message"
        if kind == "message":
            if item.role not in ROLES:
                raise InvalidRequest(f"'{at}.role' must be one of {', '.join(ROLES)}, got {str(item.role)[:40]!r}",
                                     f"{at}.role")
            messages.append({"role": item.role, "content": _text(item.content, f"{at}.content")})
            out.origins.append(at)
        elif kind == "function_call":
            call = {"id": _required(item.call_id, f"{at}.call_id"), "type": "function",
                    "function": {"name": _required(item.name, f"{at}.name"),
                                 "arguments": item.arguments if item.arguments is not None else ""}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or len(messages) <= out.history:
                last = {"role": "assistant", "content": None}
                messages.append(last)
                out.origins.append(at)
            last.setdefault("tool_calls", []).append(call)
            out.call_origins.setdefault(len(messages) - 1, []).append(at)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _required(item.call_id, f"{at}.call_id"),
                             "content": _text(item.output, f"{at}.output")})
            out.origins.append(at)
        else:
            raise InvalidRequest(f"'{at}.type': items of type {kind[:64]!r} are not supported here (messages, "
                                 "function_call and function_call_output are)", f"{at}.type")


def _tool_choice(value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """The chat ``tool_choice`` of a Responses one (``{"type": "function", "name"}``)."""
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise InvalidRequest("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"name\": ...}: "
                         "built-in tools run on OpenAI's servers only", "tool_choice")


def translate(request: ResponsesRequest, history: list[dict[str, Any]]) -> Translation:
    """The chat completion body of ``request`` after ``history`` (the stored conversation of
    ``previous_response_id``, chat messages). Raises InvalidRequest naming the Responses field."""
    refused = request.refusal()
    if refused is not None:
        raise refused
    out = Translation({"model": request.model, "messages": []})
    if request.instructions is not None:
        out.chat["messages"].append({"role": "system", "content": request.instructions})
        out.origins.append("instructions")
    out.chat["messages"] += history
    out.origins += ["previous_response_id"] * len(history)
    out.history = len(out.chat["messages"])
    if isinstance(request.input, str):
        out.chat["messages"].append({"role": "user", "content": request.input})
        out.origins.append("input")
    else:
        items_to_messages(request.input, "input", out)
    tools = []
    for i, tool in enumerate(request.tools or ()):
        if tool.type != "function":
            raise InvalidRequest(f"'tools[{i}].type': {tool.type[:64]!r} is one of OpenAI's built-in tools, which "
                                 "run on its servers: only function tools are supported here", f"tools[{i}].type")
        spec = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
        tools.append({"type": "function", "function": {k: v for k, v in spec.items() if v is not None}})
    fmt = request.text.format if request.text is not None else None
    values = {"tools": tools or None, "tool_choice": _tool_choice(request.tool_choice),
              "parallel_tool_calls": request.parallel_tool_calls, "max_completion_tokens": request.max_output_tokens,
              "temperature": request.temperature, "top_p": request.top_p,
              "response_format": fmt.response_format() if fmt is not None else None}
    out.chat.update({k: v for k, v in values.items() if v is not None})
    return out


def build_shapes() -> None:
    """Build the validators ``defer_build`` put off (called before the server serves)."""
    ResponsesRequest.model_rebuild()
