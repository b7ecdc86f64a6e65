"""Tool calls on chat completions: how ``tools``, ``tool_choice`` and ``parallel_tool_calls``
become the LLM request's tools (rendered by the model's chat template) and constraint.

- ``none``: no call is looked for; ``auto`` (the default with tools): the answer is read for the
  Hermes format ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as vLLM's ``hermes``
  parser reads it;
- ``required``: the answer is constrained (by grammar) to a JSON array of
  ``{"name": <a tool's name>, "arguments": <its parameters>}``, at least one, at most one without
  ``parallel_tool_calls``;
- a named function: the answer is constrained to that function's ``parameters``: it is the arguments.

So under ``required`` or a named function the arguments always parse and validate against the
function's ``parameters`` (unless ``max_tokens`` cuts them). See docs/llm.md, "Tool calls".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from inference_service.contracts.request_error import InvalidRequest
from inference_service.contracts.structured import MAX_CONSTRAINT_CHARS, check_tools

ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """How one chat completion uses its tools: ``mode``, the function a named choice names, the
    checked tools, and the constraint (vLLM's ``structured_outputs``) of ``required`` / named."""

    mode: ToolMode = "none"
    name: str | None = None
    tools: tuple[dict[str, Any], ...] = ()
    constraint: dict[str, Any] | None = None


def _choice(value: Any, names: list[str]) -> tuple[ToolMode, str | None]:
    """``(mode, function name)`` of ``tool_choice``; InvalidRequest naming it when malformed or
    naming no tool of ``names``."""
    if value is None:
        return ("auto" if names else "none"), None
    if value in ("none", "auto", "required"):
        if value == "required" and not names:
            raise InvalidRequest("'tool_choice' is 'required' but 'tools' lists none", "tool_choice")
        return value, None
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidRequest("'tool_choice' must be none, auto, required or "
                             '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in names:
        raise InvalidRequest(f"'tool_choice' names the function {name[:64]!r}, which 'tools' does not list"
                             + (f"; it lists: {', '.join(names[:16])}" if names else ""), "tool_choice")
    return "named", name


def tool_plan(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan:
    """The plan of a request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (OpenAI's
    defaults: ``auto`` with tools, parallel calls allowed).

    Raises:
        InvalidRequest: a malformed tool (field ``tools[i]...``), a ``tool_choice`` that is not one
            of OpenAI's or names no listed function (``tool_choice``), or a constraint longer than
            :data:`MAX_CONSTRAINT_CHARS` (``tools``).
    """
    checked = check_tools(tools) if tools is not None else ()
    functions = {tool["function"]["name"]: tool["function"] for tool in checked}
    mode, name = _choice(tool_choice, list(functions))
    schema: dict[str, Any] | None = None
    if mode == "named" and name is not None:
        schema = functions[name]["parameters"]
    elif mode == "required":
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"enum": [function["name"]]},
                                              "arguments": function["parameters"]},
             "required": ["name", "arguments"]} for function in functions.values()]}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
    if schema is not None and len(json.dumps(schema)) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequest(f"'tools': the parameters of the tools to call exceed {MAX_CONSTRAINT_CHARS} "
                             "characters together, the most a constraint may hold", "tools")
    return ToolPlan(mode, name, checked, None if schema is None else {"json": schema})


def constraint_param(field: str | None, *, tools_constrain: bool, response_format: bool) -> str | None:
    """The OpenAI field at fault when the LLM request's ``structured_outputs`` is refused: ``tools``
    when the tool choice made it, else ``response_format`` when that set it, else the field as is."""
    if field is None or not field.startswith("structured_outputs"):
        return field
    if tools_constrain:
        return "tools"
    return "response_format" if response_format else field
