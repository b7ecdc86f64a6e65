"""An Anthropic Messages request as the typed LLM request every engine takes: its chat, tools and
sampling become the OpenAI chat completion request the ``/v1`` door checks (so both doors refuse
alike), which becomes the :class:`~inference_service.contracts.sampling.GenerationRequest`.

- ``system`` is the first message; a ``tool_use`` block is an assistant's tool call (``input`` as
  its JSON arguments), a ``tool_result`` block a ``tool`` message answering it;
- ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` is OpenAI's ``auto`` / ``required`` /
  a named function / ``none``; ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``;
- ``stop_sequences`` are stop strings, ``top_k`` vLLM's; ``output_config.format`` (a JSON schema) is
  ``response_format``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from inference_service.contracts.request_error import InvalidRequest
from inference_service.contracts.sampling import GenerationRequest
from inference_service.frontends.anthropic.schemas import Conversation, MessagesRequest
from inference_service.frontends.openai.schemas import ChatCompletionRequest, validation_error_param
from inference_service.frontends.openai.tools import ToolPlan

#: An OpenAI or LLM field named in a refusal, and the Anthropic one a client sent.
_FIELDS = (
    (re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
    (re.compile(r"^tools\[(\d+)\]\.function\.(name|description)"), r"tools[\1].\2"),
    (re.compile(r"^(max_new_tokens|max_tokens)$"), "max_tokens"),
    (re.compile(r"^stop$"), "stop_sequences"),
    (re.compile(r"^(response_format|structured_outputs).*"), "output_config.format"),
)


def anthropic_field(field: str | None, tools_constrain: bool = False) -> str | None:
    """The Anthropic request field behind an OpenAI or LLM request field (as is when it maps 1:1);
    a refused constraint is ``tools``' when the tool choice made it."""
    if field is None:
        return None
    if tools_constrain and field.startswith("structured_outputs"):
        return "tools"
    for pattern, replacement in _FIELDS:
        if pattern.match(field):
            return pattern.sub(replacement, field)
    return field


def _messages(request: Conversation) -> list[dict[str, Any]]:
    """The chat in OpenAI's message shape.

    Raises:
        InvalidRequest: a block in the wrong role's message (``messages[i].content[j]``).
    """
    out: list[dict[str, Any]] = []
    system = request.system_text()
    if system:
        out.append({"role": "system", "content": system})
    for i, message in enumerate(request.messages):
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            if block.type == "text":
                texts.append(block.text or "")
            elif block.type == "tool_use":
                if message.role != "assistant" or block.id is None or block.name is None:
                    raise InvalidRequest(f"'{where}': a tool_use block belongs to an assistant message and needs "
                                         "'id' and 'name'", where)
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name, "arguments": json.dumps(block.input or {}, ensure_ascii=False)}})
            elif block.type == "tool_result":
                if message.role != "user" or block.tool_use_id is None:
                    raise InvalidRequest(f"'{where}': a tool_result block belongs to a user message and needs "
                                         "'tool_use_id'", where)
                text = block.result_text()
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {text}" if block.is_error else text})
        if message.role == "assistant":
            out.append({"role": "assistant", "content": "".join(texts) or (None if calls else ""),
                        **({"tool_calls": calls} if calls else {})})
        elif texts or not any(block.type == "tool_result" for block in message.content):
            out.append({"role": "user", "content": "".join(texts)})
    return out


def _tool_choice(request: Conversation) -> tuple[Any, bool | None]:
    """OpenAI's ``tool_choice`` and ``parallel_tool_calls`` of the request's ``tool_choice``."""
    choice = request.tool_choice
    if choice is None:
        return None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest("'tool_choice': type 'tool' needs the 'name' of a tool", "tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def chat_request(request: Conversation) -> ChatCompletionRequest:
    """The OpenAI chat completion request of an Anthropic one (``max_tokens`` 1 for a count).

    Raises:
        InvalidRequest: as :func:`_messages` and :func:`_tool_choice`.
    """
    choice, parallel = _tool_choice(request)
    body: dict[str, Any] = {"model": request.model, "messages": _messages(request)}
    if request.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": tool.name, "parameters": tool.input_schema,
            **({"description": tool.description} if tool.description is not None else {})}}
            for tool in request.tools]
    if choice is not None and (request.tools or choice != "none"):
        body["tool_choice"] = choice
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    if isinstance(request, MessagesRequest):
        body.update(max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
                    top_k=request.top_k, stop=request.stop_sequences)
        output = request.output_config.format if request.output_config is not None else None
        if output is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                              "schema": output.schema_}}
    return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


def generation_request(request: Conversation) -> tuple[GenerationRequest, ToolPlan]:
    """The typed LLM request and its tool plan.

    Raises:
        InvalidRequest: the field named is the OpenAI or LLM one (:func:`anthropic_field` maps it).
    """
    try:
        chat = chat_request(request)
    except ValidationError as exc:  # a value the chat request holds to tighter limits
        param, message = validation_error_param(exc)
        raise InvalidRequest(message, param) from None
    plan = chat.tool_plan()
    return chat.to_generation_request(plan), plan
