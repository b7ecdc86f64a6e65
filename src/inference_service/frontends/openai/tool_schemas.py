"""OpenAI's wire shapes of the tool calls in an answer: whole (:class:`ToolCall`, in a chat
completion's message) and streamed (:class:`ToolCallDelta`, in a chunk's delta: the first of a
call carries its ``id``, ``type`` and ``function.name``, the next ones pieces of its
``function.arguments``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Response(BaseModel):
    model_config = ConfigDict(defer_build=True)


class FunctionCall(_Response):
    """The function a tool call calls: its ``name`` and its ``arguments`` as JSON text."""

    name: str
    arguments: str


class ToolCall(_Response):
    """One tool call of a chat completion's message (``id``: ``call_`` and 24 hex digits)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDelta(_Response):
    """A piece of a streamed call's function (fields that are ``None`` are left out)."""

    name: str | None = Field(default=None, exclude_if=lambda v: v is None)
    arguments: str | None = Field(default=None, exclude_if=lambda v: v is None)


class ToolCallDelta(_Response):
    """A piece of the ``index``-th tool call of a streamed chat completion."""

    index: int
    id: str | None = Field(default=None, exclude_if=lambda v: v is None)
    type: Literal["function"] | None = Field(default=None, exclude_if=lambda v: v is None)
    function: FunctionDelta
