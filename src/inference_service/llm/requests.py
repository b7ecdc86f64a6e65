"""Generation requests: parsing and validating a request body (or a handler config).

:func:`parse_request` / :func:`parse_input_row` turn a request body into a
:class:`GenerationRequest` (a prompt or chat messages plus its
:class:`~inference_service.llm.params.GenerationParams`); :func:`params_from_config`
builds the defaults from a handler config. Every problem raises :class:`InvalidRequest`,
whose message is meant for the client.

Request body (JSON object, UTF-8)::

    {"prompt": "Once upon a time"}                          # or
    {"messages": [{"role": "user", "content": "Hi"}],       # chat template applied
     "max_new_tokens": 64,      # int, 1..4096 (and prompt + this <= model context)
     "temperature": 0.7,        # number, 0..5; 0 = greedy
     "top_p": 0.9,              # number, 0 < p <= 1
     "seed": 1234,              # int, 0 <= seed < 2**64 (same seed -> same text)
     "stop": ["\\n\\n"],          # string or list of up to 16 non-empty strings
     "ignore_eos": false,       # bool: keep going past the end-of-sequence token
     "include_usage": false}    # bool: final message becomes a JSON object (see handler)

A field set to ``null`` counts as absent. A body that is not a JSON object (plain
text, or JSON such as a bare string or number) is used verbatim as the prompt
with the default options; a body starting with ``{`` that is not valid JSON is
rejected rather than fed to the model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from inference_service.llm.params import GenerationParams

__all__ = [
    "MAX_NEW_TOKENS_LIMIT",
    "MAX_STOP_LENGTH",
    "MAX_STOP_STRINGS",
    "MAX_TEMPERATURE",
    "REQUEST_FIELDS",
    "GenerationRequest",
    "InvalidRequest",
    "check_prompt_size",
    "max_token_chars",
    "params_from_config",
    "parse_input_row",
    "parse_request",
]

#: Upper bound of ``max_new_tokens`` accepted from a request or config.
MAX_NEW_TOKENS_LIMIT = 4096
#: Upper bound of ``temperature``.
MAX_TEMPERATURE = 5.0
#: Most stop strings one request may give.
MAX_STOP_STRINGS = 16
#: Longest stop string accepted (characters).
MAX_STOP_LENGTH = 256
#: Fields a JSON request body may carry.
REQUEST_FIELDS = frozenset(
    {
        "prompt",
        "messages",
        "max_new_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "ignore_eos",
        "include_usage",
    }
)


#: The answer to an Open Inference Protocol (v2) body: which body this handler takes, and where.
V2_REFUSAL = (
    'this model is an LLM: it takes {"prompt": "..."} or {"messages": [...]}, not an Open Inference '
    "Protocol (v2) body with \"inputs\"; send it to /predictions/<model> (gRPC: StreamPredictions), "
    "or an OpenAI body to /v1/chat/completions or /v1/completions"
)


class InvalidRequest(ValueError):
    """A request (or config value) is malformed; the message explains it to the client."""


@dataclass(frozen=True)
class GenerationRequest:
    """A parsed request: exactly one of ``prompt`` / ``messages`` is set, plus its params."""

    prompt: str | None
    messages: tuple[dict[str, str], ...] | None
    params: GenerationParams


def _check_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"'{name}' must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be between {low} and {high}, got {value}")
    return value


def _check_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"'{name}' must be a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise InvalidRequest(f"'{name}' must be a finite number, got {value}")
    return number


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be true or false, got {type(value).__name__}")
    return value


def _check_temperature(value: Any) -> float:
    temperature = _check_number("temperature", value)
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise InvalidRequest(f"'temperature' must be between 0 and {MAX_TEMPERATURE:g}, got {value}")
    return temperature


def _check_top_p(value: Any) -> float:
    top_p = _check_number("top_p", value)
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequest(f"'top_p' must be greater than 0 and at most 1, got {value}")
    return top_p


def _check_stop(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise InvalidRequest(f"'stop' must be a string or a list of strings, got {type(value).__name__}")
    if len(items) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(items)}")
    for item in items:
        if not isinstance(item, str):
            raise InvalidRequest(f"'stop' entries must be strings, got {type(item).__name__}")
        if not item:
            raise InvalidRequest("'stop' entries must not be empty")
        if len(item) > MAX_STOP_LENGTH:
            raise InvalidRequest(f"'stop' entries must be at most {MAX_STOP_LENGTH} characters")
    return tuple(dict.fromkeys(items))  # drop duplicates, keep order


def params_from_config(config: Mapping[str, Any]) -> GenerationParams:
    """Build the default :class:`GenerationParams` from a handler config section.

    Args:
        config: the ``handler`` section of the model YAML config; reads
            ``max_new_tokens`` (default 256), ``temperature`` (default 0) and
            ``top_p`` (default 1.0). Other keys are ignored here.

    Returns:
        The defaults every request starts from.

    Raises:
        InvalidRequest: a value has the wrong type or is out of range (the
            message says "handler config" and names the key).
    """
    params = GenerationParams()
    try:
        if config.get("max_new_tokens") is not None:
            params = replace(
                params,
                max_new_tokens=_check_int("max_new_tokens", config["max_new_tokens"], 1, MAX_NEW_TOKENS_LIMIT),
            )
        if config.get("temperature") is not None:
            params = replace(params, temperature=_check_temperature(config["temperature"]))
        if config.get("top_p") is not None:
            params = replace(params, top_p=_check_top_p(config["top_p"]))
    except InvalidRequest as exc:
        raise InvalidRequest(f"handler config: {exc}") from None
    return params


def _parse_messages(value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest('\'messages\' must be a non-empty list of {"role", "content"} objects')
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise InvalidRequest(f"'messages[{i}]' must be an object with 'role' and 'content'")
        extra = set(message) - {"role", "content"}
        if extra:
            raise InvalidRequest(f"'messages[{i}]' has unknown field(s): {', '.join(sorted(extra))}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"'messages[{i}].role' must be a non-empty string")
        if not isinstance(content, str):
            raise InvalidRequest(f"'messages[{i}].content' must be a string")
        messages.append({"role": role, "content": content})
    return tuple(messages)


def _body_text(body: bytes | bytearray | memoryview | str) -> str:
    if isinstance(body, str):
        return body
    try:
        return bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"request body is not valid UTF-8 (byte {exc.start})") from None


def parse_request(body: Any, defaults: GenerationParams = GenerationParams()) -> GenerationRequest:
    """Parse one request body into a :class:`GenerationRequest`.

    Args:
        body: the request payload: ``bytes``/``bytearray`` (UTF-8), ``str``, or
            an already-decoded ``dict``. See the module docstring for the fields.
        defaults: the params used for fields the request leaves out.

    Returns:
        The request with validated params.

    Raises:
        InvalidRequest: invalid UTF-8, malformed JSON object, unknown field,
            both or neither of ``prompt``/``messages``, a wrong type or an
            out-of-range value; the message names the field.
    """
    if isinstance(body, dict):
        obj: Any = body
    elif isinstance(body, (bytes, bytearray, memoryview, str)):
        text = _body_text(body)
        stripped = text.strip()
        obj = None
        if stripped.startswith("{"):
            try:
                obj = json.loads(stripped)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
        if not isinstance(obj, dict):
            if not text:
                raise InvalidRequest("request body is empty; send a prompt")
            return GenerationRequest(prompt=text, messages=None, params=defaults)
    else:
        raise InvalidRequest(f"request body must be bytes, text or an object, got {type(body).__name__}")

    unknown = set(obj) - REQUEST_FIELDS
    if "inputs" in unknown and not {"prompt", "messages"} & set(obj):
        raise InvalidRequest(V2_REFUSAL)
    if unknown:
        raise InvalidRequest(
            f"unknown field(s): {', '.join(sorted(map(str, unknown)))}; allowed: {', '.join(sorted(REQUEST_FIELDS))}"
        )
    fields = {k: v for k, v in obj.items() if v is not None}
    prompt = fields.get("prompt")
    messages = None
    if ("prompt" in fields) == ("messages" in fields):
        raise InvalidRequest("exactly one of 'prompt' and 'messages' must be given")
    if "prompt" in fields:
        if not isinstance(prompt, str):
            raise InvalidRequest(f"'prompt' must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise InvalidRequest("'prompt' must not be empty")
    else:
        messages = _parse_messages(fields["messages"])

    params = defaults
    if "max_new_tokens" in fields:
        params = replace(
            params,
            max_new_tokens=_check_int("max_new_tokens", fields["max_new_tokens"], 1, MAX_NEW_TOKENS_LIMIT),
        )
    if "temperature" in fields:
        params = replace(params, temperature=_check_temperature(fields["temperature"]))
    if "top_p" in fields:
        params = replace(params, top_p=_check_top_p(fields["top_p"]))
    if "seed" in fields:
        params = replace(params, seed=_check_int("seed", fields["seed"], 0, 2**64 - 1))
    if "stop" in fields:
        params = replace(params, stop=_check_stop(fields["stop"]))
    if "ignore_eos" in fields:
        params = replace(params, ignore_eos=_check_bool("ignore_eos", fields["ignore_eos"]))
    if "include_usage" in fields:
        params = replace(params, include_usage=_check_bool("include_usage", fields["include_usage"]))
    return GenerationRequest(prompt=prompt, messages=messages, params=params)


def parse_input_row(row: Any, defaults: GenerationParams = GenerationParams()) -> GenerationRequest:
    """Parse one entry of a handler's ``data`` batch (the gRPC input map of one request).

    Args:
        row: a dict holding the body under ``"data"`` or ``"body"`` (bytes,
            bytearray, str or an already-decoded dict), or the body itself.
        defaults: see :func:`parse_request`.

    Returns:
        The parsed request.

    Raises:
        InvalidRequest: no ``data``/``body`` entry, or the body is invalid.
    """
    if isinstance(row, Mapping):
        body = row.get("data")
        if body is None:
            body = row.get("body")
        if body is None:
            raise InvalidRequest("request has no 'data' or 'body' input")
    else:
        body = row
    return parse_request(body, defaults)


def max_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token of ``tokenizer`` can stand for: the longest
    entry of its vocabulary (byte-level BPE spells every byte as one character, so the length
    of an entry bounds the characters it decodes to)."""
    vocab = tokenizer.get_vocab()
    return max((len(piece) for piece in vocab), default=1) or 1


def check_prompt_size(request: GenerationRequest, max_chars: int | None) -> None:
    """Refuse, before tokenization, a prompt that cannot fit the model's context.

    Args:
        request: the parsed request; its prompt, or the sum of its messages' contents, is
            measured in characters (a length, no pass over the text).
        max_chars: the model's context length times :func:`max_token_chars`; ``None``
            checks nothing.

    Raises:
        InvalidRequest: the text has more characters than ``max_chars``: even at the longest
            token it would encode to more tokens than the context holds.
    """
    if max_chars is None:
        return
    if request.prompt is not None:
        size = len(request.prompt)
    else:
        size = sum(len(m["content"]) for m in request.messages or ())
    if size > max_chars:
        raise InvalidRequest(
            f"prompt too long: {size} characters cannot fit the model's context "
            f"(at most {max_chars} characters)"
        )
