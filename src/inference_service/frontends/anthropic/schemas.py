"""Anthropic's Messages API request bodies (``POST /v1/messages``, ``/v1/messages/count_tokens``),
checked as the OpenAI door checks its own: strict types, unknown fields served and named
(``x-ignored-fields``), a refusal naming the field (``messages[1].content[0].type``).

What this server cannot honour is refused with a 400 naming it: image, document and search
result blocks, server tools (``web_search_...``). ``thinking`` blocks of earlier turns are dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from inference_service.contracts.structured import MAX_TOOLS
from inference_service.frontends.openai.schemas import OpenAIRequest

#: Block types a message may hold here (``thinking`` ones are read and dropped).
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _unsupported(what: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", "{what} is not supported by this server", {"what": what})


def _as_blocks(value: Any) -> Any:
    """A string as the one text block it stands for (so a refusal names the block at fault)."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class TextBlock(OpenAIRequest):
    """``{"type": "text", "text"}`` (``cache_control`` and ``citations`` are accepted, without effect)."""

    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class ContentBlock(OpenAIRequest):
    """One block of a message: ``text``; an assistant's ``tool_use`` (``id``, ``name``, ``input``); a
    user's ``tool_result`` (``tool_use_id``, ``content`` text or text blocks, ``is_error``); or an
    earlier turn's ``thinking``."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: list[TextBlock] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None

    _content_blocks = field_validator("content", mode="before")(_as_blocks)

    @field_validator("type")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in BLOCK_TYPES:
            raise _unsupported(f"a {value[:40]!r} block")
        return value

    def result_text(self) -> str:
        """A ``tool_result``'s content as text (blocks joined)."""
        return "".join(block.text for block in self.content or ())


class Message(OpenAIRequest):
    """``{"role": "user" | "assistant", "content": str | [blocks]}`` (a string is one text block)."""

    role: Literal["user", "assistant"]
    content: list[ContentBlock]

    _content_blocks = field_validator("content", mode="before")(_as_blocks)


class Tool(OpenAIRequest):
    """A client tool: ``name``, ``description``, ``input_schema`` (a JSON schema of its input)."""

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):  # a server tool has no input_schema: refused by its type first
            raise PydanticCustomError("unsupported", "tools[].type: the server tool {kind} is not supported by this "
                                      "server", {"kind": repr(str(kind)[:40])})
        return value


class ToolChoice(OpenAIRequest):
    """``auto`` (the default with tools), ``any`` (at least one call), ``tool`` (``name``'s), ``none``."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(OpenAIRequest):
    """``{"type": "json_schema", "schema"}``: the answer is JSON valid under ``schema``."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIRequest):
    """``output_config``: ``format`` constrains the answer (``effort`` is accepted, without effect)."""

    format: OutputFormat | None = None
    effort: str | None = None


class Conversation(OpenAIRequest):
    """What ``count_tokens`` and ``messages`` share: the model, the chat and its tools."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    # Anthropic's, accepted and without effect here
    thinking: dict[str, Any] | None = None

    _system_blocks = field_validator("system", mode="before")(_as_blocks)

    def system_text(self) -> str | None:
        """The system prompt as text (blocks joined), ``None`` when absent."""
        return None if self.system is None else "".join(block.text for block in self.system)


class MessagesRequest(Conversation):
    """``POST /v1/messages``: ``max_tokens`` is required, as Anthropic's; ``temperature`` is 0 to 1."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    output_config: OutputConfig | None = None
    # Anthropic's, accepted and without effect here
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


class CountTokensRequest(Conversation):
    """``POST /v1/messages/count_tokens``: a request's prompt, counted as the model's tokenizer counts it."""


def build_shapes() -> None:
    """Build the validators ``defer_build`` put off (the server does it before it serves)."""
    for shape in (TextBlock, ContentBlock, Message, Tool, ToolChoice, OutputFormat, OutputConfig, Conversation,
                  MessagesRequest, CountTokensRequest):
        shape.model_rebuild()
