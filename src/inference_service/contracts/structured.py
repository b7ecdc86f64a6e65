"""Structured outputs and tools of one LLM request, typed: vLLM's ``structured_outputs`` (exactly one
of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``), OpenAI's ``response_format``
read into it, and the ``tools`` and chat messages with tool calls a chat template renders.

Every check is bounded before it walks a value (sizes in characters, nesting depth), and every
problem raises :class:`~inference_service.contracts.sampling.InvalidRequest` naming the field.
Whether a constraint compiles is checked in the worker, by the grammar library the engines use
(docs/llm.md, "Structured outputs").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from inference_service.contracts.request_error import InvalidRequest

#: Longest JSON schema (compact JSON), regular expression or grammar a request may give (characters).
MAX_CONSTRAINT_CHARS = 65_536
#: Deepest nesting of objects and arrays in a JSON schema.
MAX_SCHEMA_DEPTH = 32
#: Most entries of a ``choice`` list.
MAX_CHOICES = 256
#: Most tools one request may list (OpenAI's own limit).
MAX_TOOLS = 128
#: Most tool calls one assistant message may carry.
MAX_TOOL_CALLS = 128
#: A function name as OpenAI accepts it.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: The keys of vLLM's ``structured_outputs`` we honour; one must be set.
CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
#: vLLM's other ``structured_outputs`` keys: refused by name.
_UNSUPPORTED_KEYS = ("structural_tag", "whitespace_pattern", "disable_any_whitespace",
                     "disable_additional_properties", "disable_fallback")
#: What ``json_object`` stands for: any JSON object.
ANY_OBJECT_SCHEMA = '{"type":"object","additionalProperties":true}'


def _refuse(field: str, problem: str) -> InvalidRequest:
    """The error ``'field' problem``, naming ``field`` (a path such as ``messages[2].tool_call_id``)."""
    return InvalidRequest(f"'{field}' {problem}", field)


@dataclass(frozen=True)
class StructuredOutputs:
    """One constraint on the generated text (vLLM's ``StructuredOutputsParams``): ``json`` (a JSON
    schema as compact JSON text), ``regex``, ``choice`` (the text is one of them), ``grammar``
    (XGrammar's EBNF) or ``json_object`` (any JSON object); exactly one is set."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    @property
    def kind(self) -> str:
        """The name of the constraint that is set (one of :data:`CONSTRAINT_KEYS`)."""
        return next(k for k in CONSTRAINT_KEYS if getattr(self, k) not in (None, False))

    def schema(self) -> str | None:
        """The JSON schema text of ``json`` or ``json_object``, else ``None``."""
        return ANY_OBJECT_SCHEMA if self.json_object else self.json

    def to_json(self) -> dict[str, Any]:
        """vLLM's JSON form: ``{"json": {...}}``, ``{"choice": [...]}``, ..."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            return {"json": json.loads(value)}
        return {kind: list(value) if isinstance(value, tuple) else value}


def _depth_within(value: Any, limit: int) -> bool:
    """Whether ``value``'s objects and arrays nest at most ``limit`` deep (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return False
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return True


def check_schema(name: str, value: Any) -> str:
    """A JSON schema (an object, or its JSON text) as compact JSON text.

    Raises:
        InvalidRequest: not an object, invalid JSON text, nested deeper than :data:`MAX_SCHEMA_DEPTH`
            or longer than :data:`MAX_CONSTRAINT_CHARS`.
    """
    if isinstance(value, str):
        if len(value) > MAX_CONSTRAINT_CHARS:
            raise _refuse(name, f"must be at most {MAX_CONSTRAINT_CHARS} characters, got {len(value)}")
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise _refuse(name, "is not valid JSON") from None
    if not isinstance(value, dict):
        raise _refuse(name, f"must be a JSON schema object, got {type(value).__name__}")
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)  # C speed: bounds the walk below
    except RecursionError:
        raise _refuse(name, f"nests deeper than {MAX_SCHEMA_DEPTH} objects and arrays") from None
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise _refuse(name, f"must be at most {MAX_CONSTRAINT_CHARS} characters as JSON, got {len(text)}")
    if not _depth_within(value, MAX_SCHEMA_DEPTH):
        raise _refuse(name, f"nests deeper than {MAX_SCHEMA_DEPTH} objects and arrays")
    return text


def _check_text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _refuse(name, "must be a non-empty string")
    if len(value) > MAX_CONSTRAINT_CHARS:
        raise _refuse(name, f"must be at most {MAX_CONSTRAINT_CHARS} characters, got {len(value)}")
    return value


def _check_choice(name: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise _refuse(name, "must be a non-empty list of strings")
    if len(value) > MAX_CHOICES:
        raise _refuse(name, f"may hold at most {MAX_CHOICES} strings, got {len(value)}")
    if not all(isinstance(item, str) and item for item in value):
        raise _refuse(name, "entries must be non-empty strings")
    if sum(map(len, value)) > MAX_CONSTRAINT_CHARS:
        raise _refuse(name, f"must hold at most {MAX_CONSTRAINT_CHARS} characters in all")
    return tuple(dict.fromkeys(value))


def check_structured_outputs(name: str, value: Any) -> StructuredOutputs:
    """vLLM's ``structured_outputs`` object (or a :class:`StructuredOutputs`) checked and typed.

    Raises:
        InvalidRequest: not an object, an unknown or unsupported key, not exactly one constraint,
            or a constraint its own check refuses (the message names ``name.key``).
    """
    if isinstance(value, StructuredOutputs):
        return value
    if not isinstance(value, dict):
        raise _refuse(name, f"must be an object with one of: {', '.join(CONSTRAINT_KEYS)}")
    for key in value:
        if key in _UNSUPPORTED_KEYS:
            raise _refuse(f"{name}.{key}", "is not supported by this server")
        if key not in CONSTRAINT_KEYS:
            raise _refuse(name, f"has an unknown key {str(key)[:64]!r}; allowed: {', '.join(CONSTRAINT_KEYS)}")
    given = [k for k in CONSTRAINT_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise _refuse(name, f"must set exactly one of: {', '.join(CONSTRAINT_KEYS)}")
    key = given[0]
    where = f"{name}.{key}"
    if key == "json":
        return StructuredOutputs(json=check_schema(where, value[key]))
    if key == "json_object":
        if value[key] is not True:
            raise _refuse(where, "must be true or false")
        return StructuredOutputs(json_object=True)
    if key == "choice":
        return StructuredOutputs(choice=_check_choice(where, value[key]))
    text = _check_text(where, value[key])
    return StructuredOutputs(regex=text) if key == "regex" else StructuredOutputs(grammar=text)


def from_response_format(value: Any) -> StructuredOutputs | None:
    """OpenAI's ``response_format`` as a constraint: ``{"type": "text"}`` none,
    ``{"type": "json_object"}`` any object, ``{"type": "json_schema", "json_schema": {"name",
    "schema", "strict", "description"}}`` the schema (``strict`` is always honoured).

    Raises:
        InvalidRequest: another shape (the message names the field under ``response_format``).
    """
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _refuse("response_format", "must be an object with a 'type': text, json_object or json_schema")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise _refuse("response_format.type", f"must be text, json_object or json_schema, got {kind[:64]!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _refuse("response_format.json_schema", "must be an object with 'name' and 'schema'")
    if "schema" not in spec:
        raise _refuse("response_format.json_schema.schema", "is required: the JSON schema of the answer")
    return StructuredOutputs(json=check_schema("response_format.json_schema.schema", spec["schema"]))


# ---------------------------------------------------------------------------------- tools
def check_tools(value: Any) -> tuple[dict[str, Any], ...]:
    """OpenAI's ``tools``: up to :data:`MAX_TOOLS` ``{"type": "function", "function": {"name",
    "description", "parameters"}}``, names unique, each ``parameters`` a JSON schema (default: no
    arguments). Returns them normalized (``parameters`` always set).

    Raises:
        InvalidRequest: names the field (``tools[3].function.name``).
    """
    if not isinstance(value, (list, tuple)):
        raise _refuse("tools", f"must be a list of tools, got {type(value).__name__}")
    if len(value) > MAX_TOOLS:
        raise _refuse("tools", f"may hold at most {MAX_TOOLS} tools, got {len(value)}")
    tools: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise _refuse(where, 'must be {"type": "function", "function": {...}}')
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise _refuse(f"{where}.function.name", "must be 1 to 64 letters, digits, '_' or '-'")
        if name in names:
            raise _refuse(f"{where}.function.name", f"repeats the name {name!r}")
        names.add(name)
        description = function.get("description")
        if description is not None and (not isinstance(description, str) or len(description) > MAX_CONSTRAINT_CHARS):
            raise _refuse(f"{where}.function.description", f"must be a string of at most "
                                 f"{MAX_CONSTRAINT_CHARS} characters")
        parameters = function.get("parameters")
        schema = '{"type":"object","properties":{}}' if parameters is None else \
            check_schema(f"{where}.function.parameters", parameters)
        entry: dict[str, Any] = {"name": name, "parameters": json.loads(schema)}
        if description is not None:
            entry["description"] = description
        tools.append({"type": "function", "function": entry})
    return tuple(tools)


def _check_tool_calls(where: str, value: Any, ids: set[str]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` (their ids added to ``ids``)."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_TOOL_CALLS:
        raise _refuse(where, f"must be a list of at most {MAX_TOOL_CALLS} tool calls")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise _refuse(at, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise _refuse(f"{at}.id", "must be a non-empty string")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise _refuse(f"{at}.function.name", "must be a non-empty string")
        if not isinstance(function.get("arguments"), str):
            raise _refuse(f"{at}.function.arguments", "must be a string (the arguments as JSON)")
        ids.add(call["id"])
        calls.append({"id": call["id"], "type": "function",
                      "function": {"name": function["name"], "arguments": function["arguments"]}})
    return calls


#: The chat roles a request may use, on every door (OpenAI's; ``developer`` reaches the chat
#: template as ``system``, which templates know).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(value: Any) -> tuple[dict[str, Any], ...]:
    """A chat: ``{"role", "content"}`` objects; an assistant message may carry ``tool_calls``
    (then ``content`` may be ``null``), a ``tool`` message needs the ``tool_call_id`` of an
    earlier call, any message may carry a ``name``.

    Raises:
        InvalidRequest: names the field (``messages[2].tool_call_id``).
    """
    if not isinstance(value, (list, tuple)) or not value:
        raise _refuse("messages", 'must be a non-empty list of {"role", "content"} objects')
    messages = []
    call_ids: set[str] = set()
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise _refuse(f"messages[{i}]", "must be an object with 'role' and 'content'")
        extra = set(message) - {"role", "content", "tool_calls", "tool_call_id", "name"}
        if extra:
            raise _refuse(f"messages[{i}]", f"has unknown field(s): {', '.join(sorted(map(str, extra)))}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            shown = repr(role)[:40] if isinstance(role, str) else type(role).__name__
            raise _refuse(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {shown}")
        out: dict[str, Any] = {"role": "system" if role == "developer" else role}
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise _refuse(f"messages[{i}].tool_calls", "is allowed on assistant messages only")
            out["tool_calls"] = _check_tool_calls(f"messages[{i}].tool_calls", message["tool_calls"], call_ids)
        if not isinstance(content, str) and not (content is None and "tool_calls" in out):
            raise _refuse(f"messages[{i}].content", "must be a string")
        out["content"] = content or ""
        call_id = message.get("tool_call_id")
        if role == "tool":
            if not isinstance(call_id, str) or call_id not in call_ids:
                raise _refuse(f"messages[{i}].tool_call_id", f"must be the id of a tool call of an earlier "
                                     f"assistant message, got {str(call_id)[:64]!r}")
            out["tool_call_id"] = call_id
        elif call_id is not None:
            raise _refuse(f"messages[{i}].tool_call_id", "is allowed on tool messages only")
        if message.get("name") is not None:
            if not isinstance(message["name"], str):
                raise _refuse(f"messages[{i}].name", "must be a string")
            out["name"] = message["name"]
        messages.append(out)
    return tuple(messages)
