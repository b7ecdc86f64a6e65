"""One LLM request, typed: its sampling parameters with their limits and defaults, and its prompt.

:class:`GenerationParams` (also :data:`SamplingParams`, vLLM's name) declares each parameter once
in a field's metadata. :class:`GenerationRequest` is what every door builds and what crosses to
the worker as JSON. Every problem raises :class:`InvalidRequest` (400) naming the field.
See docs/llm.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from inference_service.contracts.request_error import InvalidRequest
from inference_service.contracts.structured import (
    CHAT_ROLES,
    StructuredOutputs,
    check_structured_outputs,
    check_tools,
    from_response_format,
    parse_messages,
)
from inference_service.contracts.text import lone_surrogate, lone_surrogate_message

__all__ = ["CHAT_ROLES", "GenerationParams", "GenerationRequest", "InvalidRequest", "SamplingParams",
           "StructuredOutputs", "params_from_config", "parse_request"]

#: Upper bound of ``max_new_tokens`` accepted from a request or config.
MAX_NEW_TOKENS_LIMIT = 4096
#: Upper bound of ``temperature``.
MAX_TEMPERATURE = 5.0
#: Most stop strings one request may give.
MAX_STOP_STRINGS = 16
#: Longest stop string accepted (characters).
MAX_STOP_LENGTH = 256
#: Most stop token ids one request may give.
MAX_STOP_TOKEN_IDS = 64
#: Most choices (``n``) and candidates (``best_of``) of one request.
MAX_CHOICES = 16
#: Most alternatives per token (``top_logprobs``), OpenAI's bound.
MAX_TOP_LOGPROBS = 20
#: A ``temperature`` below this is greedy, as vLLM's ``_SAMPLING_EPS``: the engines compute in
#: float32, where dividing the logits by a tinier one overflows (OpenVINO refuses it outright).
GREEDY_TEMPERATURE = 1e-5
#: The range of ``repetition_penalty``: the engines divide or multiply logits by it in float32.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
#: The smallest normal float32 and the largest float32: the engines see every number in float32,
#: where a smaller non-zero one is a denormal (or 0) and a larger one is inf.
FLOAT32_MIN_NORMAL = 2.0**-126
FLOAT32_MAX = 3.4028234663852886e38


#: The answer to an Open Inference Protocol (v2) body: which body this handler takes, and where.
V2_REFUSAL = (
    'this model is an LLM: here it takes {"prompt": "..."} or {"messages": [...]}, not an Open Inference '
    "Protocol (v2) body with \"inputs\"; send the v2 body to /v2/models/<model>/infer (gRPC: ModelInfer), "
    "or an OpenAI body to /v1/chat/completions or /v1/completions"
)


def _check_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"'{name}' must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be between {low} and {high}, got {value}")
    return value


def _int_in(low: int, high: int) -> Callable[[str, Any], int]:
    return lambda name, value: _check_int(name, value, low, high)


def _check_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"'{name}' must be a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise InvalidRequest(f"'{name}' must be a finite number, got {value}")
    return number


def _check_float32(name: str, value: Any) -> float:
    """A finite number the engines see as itself in float32: 0, or a normal float32."""
    number = _check_number(name, value)
    if number and not FLOAT32_MIN_NORMAL <= abs(number) <= FLOAT32_MAX:
        raise InvalidRequest(f"'{name}' must be 0 or between {FLOAT32_MIN_NORMAL:.4g} and {FLOAT32_MAX:.4g} "
                             f"in magnitude (the engines compute in float32), got {value}")
    return number


def _check_temperature(name: str, value: Any) -> float:
    temperature = _check_number(name, value)
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise InvalidRequest(f"'{name}' must be between 0 and {MAX_TEMPERATURE:g}, got {value}")
    return temperature if temperature >= GREEDY_TEMPERATURE else 0.0


def _check_top_p(name: str, value: Any) -> float:
    top_p = _check_float32(name, value)
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequest(f"'{name}' must be greater than 0 and at most 1, got {value}")
    return top_p


def _check_stop(name: str, value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise InvalidRequest(f"'{name}' must be a string or a list of strings, got {type(value).__name__}")
    if len(items) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"'{name}' may hold at most {MAX_STOP_STRINGS} strings, got {len(items)}")
    for item in items:
        if not isinstance(item, str):
            raise InvalidRequest(f"'{name}' entries must be strings, got {type(item).__name__}")
        if not item:
            raise InvalidRequest(f"'{name}' entries must not be empty")
        if len(item) > MAX_STOP_LENGTH:
            raise InvalidRequest(f"'{name}' entries must be at most {MAX_STOP_LENGTH} characters")
    return tuple(dict.fromkeys(items))  # drop duplicates, keep order


def _check_repetition_penalty(name: str, value: Any) -> float:
    number = _check_number(name, value)
    if not MIN_REPETITION_PENALTY <= number <= MAX_REPETITION_PENALTY:
        raise InvalidRequest(f"'{name}' must be between {MIN_REPETITION_PENALTY:g} and "
                             f"{MAX_REPETITION_PENALTY:g}, got {value}")
    return number


def _check_penalty(name: str, value: Any) -> float:
    number = _check_float32(name, value)
    if not -2.0 <= number <= 2.0:
        raise InvalidRequest(f"'{name}' must be between -2 and 2, got {value}")
    return number


def _check_token_ids(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise InvalidRequest(f"'{name}' must be a list of token ids, got {type(value).__name__}")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"'{name}' may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(value)}")
    return tuple(dict.fromkeys(_check_int(f"{name}[]", item, 0, 2**31 - 1) for item in value))


def _check_salt(name: str, value: Any) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_STOP_LENGTH:
        raise InvalidRequest(f"'{name}' must be a string of 1 to {MAX_STOP_LENGTH} characters")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be true or false, got {type(value).__name__}")
    return value


def param(default: Any, check: Callable[[str, Any], Any], *, config: bool = False, request: bool = True) -> Any:
    """Declare a sampling parameter: its default, its check (``check(name, value)`` returns the
    value to keep or raises :class:`InvalidRequest`), whether the handler config may set its
    default (``config``) and whether a request body may set it (``request``; false: engines
    honour it, no door offers it yet)."""
    return field(default=default, metadata={"check": check, "config": config, "request": request})


@dataclass(frozen=True)
class GenerationParams:
    """The sampling parameters of one generation (vLLM's ``SamplingParams``); ranges and defaults are
    in each field's :func:`param` and in docs/llm.md. An engine that cannot honour a value refuses
    it (``refusal``, a 400 naming the field): the OpenVINO engine refuses non-zero presence and
    frequency penalties."""

    max_new_tokens: int = param(256, _int_in(1, MAX_NEW_TOKENS_LIMIT), config=True)
    temperature: float = param(0.0, _check_temperature, config=True)
    top_p: float = param(1.0, _check_top_p, config=True)
    seed: int | None = param(None, _int_in(0, 2**64 - 1))
    stop: tuple[str, ...] = param((), _check_stop)
    ignore_eos: bool = param(False, _check_bool)
    include_usage: bool = param(False, _check_bool)
    top_k: int = param(0, _int_in(0, 2**31 - 1))
    repetition_penalty: float = param(1.0, _check_repetition_penalty)
    presence_penalty: float = param(0.0, _check_penalty)
    frequency_penalty: float = param(0.0, _check_penalty)
    stop_token_ids: tuple[int, ...] = param((), _check_token_ids)
    cache_salt: str | None = param(None, _check_salt)  # vLLM's: prefix caching shared per salt only
    n: int = param(1, _int_in(1, MAX_CHOICES))  # choices: one engine request each (the OpenAI door's)
    best_of: int | None = param(None, _int_in(1, MAX_CHOICES))  # candidates, the n best kept
    logprobs: bool = param(False, _check_bool)  # each sampled token's log probability
    top_logprobs: int = param(0, _int_in(0, MAX_TOP_LOGPROBS))  # and its most likely alternatives
    structured_outputs: StructuredOutputs | None = param(None, check_structured_outputs)

    def updated(self, values: Mapping[str, Any]) -> GenerationParams:
        """These parameters with the set values of ``values`` (``None``: absent) checked in declaration
        order; other keys are ignored.

        Raises:
            InvalidRequest: a wrong type or out of range, ``best_of`` below ``n``, ``top_logprobs``
                without ``logprobs`` (names the field).
        """
        changes = {}
        for f in fields(self):
            if values.get(f.name) is not None:
                try:
                    changes[f.name] = f.metadata["check"](f.name, values[f.name])
                except InvalidRequest as exc:
                    exc.field = f.name
                    raise
        params = replace(self, **changes) if changes else self
        if params.best_of is not None and params.best_of < params.n:
            raise InvalidRequest(f"'best_of' ({params.best_of}) must be at least 'n' ({params.n})", "best_of")
        if params.top_logprobs and not params.logprobs:
            raise InvalidRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if params.structured_outputs is not None and params.ignore_eos:
            raise InvalidRequest("'ignore_eos' cannot be combined with 'structured_outputs': the constraint ends "
                                 "the answer", field="ignore_eos")
        return params

    def to_json(self, names: frozenset[str] | None = None) -> dict[str, Any]:
        """The parameters (those in ``names`` if given) as JSON values, in declaration order."""
        return {f.name: _json_value(getattr(self, f.name)) for f in fields(self) if names is None or f.name in names}


def _json_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return value.to_json() if isinstance(value, StructuredOutputs) else value


#: vLLM's name for the same type.
SamplingParams = GenerationParams
#: The sampling parameters a request may set, in declaration order.
PARAM_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(GenerationParams) if f.metadata["request"])
#: The handler config keys that set the defaults (``handler:`` section of model-config.yaml).
CONFIG_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(GenerationParams) if f.metadata["config"])
#: Fields a JSON request body may carry: ``response_format`` (OpenAI's) is read into ``structured_outputs``.
REQUEST_FIELDS = frozenset({"prompt", "messages", "tools", "response_format", *PARAM_FIELDS})


def params_from_config(config: Mapping[str, Any]) -> GenerationParams:
    """The defaults every request starts from, from a handler config's :data:`CONFIG_FIELDS`;
    InvalidRequest names the key ("handler config")."""
    try:
        return GenerationParams().updated({name: config.get(name) for name in CONFIG_FIELDS})
    except InvalidRequest as exc:
        raise InvalidRequest(f"handler config: {exc}") from None


@dataclass(frozen=True)
class GenerationRequest:
    """One LLM request: exactly one of ``prompt`` / ``messages`` (a chat,
    :func:`~inference_service.contracts.structured.parse_messages`), the ``tools`` its chat
    template renders, its parameters, and ``given``: the parameters the client set (the others are
    the model's defaults, which the door does not know)."""

    prompt: str | None
    messages: tuple[dict[str, Any], ...] | None
    params: GenerationParams = GenerationParams()
    given: frozenset[str] = frozenset()
    tools: tuple[dict[str, Any], ...] = ()

    @classmethod
    def build(cls, values: Mapping[str, Any], defaults: GenerationParams = GenerationParams()) -> GenerationRequest:
        """The request of a JSON object's fields (``None``: absent).

        Raises:
            InvalidRequest: an unknown field, both or neither of ``prompt``/``messages``, a wrong type
                or an out-of-range value; the message names the field.
        """
        unknown = set(values) - REQUEST_FIELDS
        if "inputs" in unknown and not {"prompt", "messages"} & set(values):
            raise InvalidRequest(V2_REFUSAL)
        if unknown:
            allowed = ", ".join(sorted(REQUEST_FIELDS))
            raise InvalidRequest(f"unknown field(s): {', '.join(sorted(map(str, unknown)))}; allowed: {allowed}")
        given = {k: v for k, v in values.items() if v is not None}
        if "response_format" in given:
            if "structured_outputs" in given:
                raise InvalidRequest("give one of 'response_format' and 'structured_outputs'", field="response_format")
            constraint = from_response_format(given.pop("response_format"))  # names response_format's field
            if constraint is not None:
                given["structured_outputs"] = constraint
        prompt = given.get("prompt")
        messages = None
        if ("prompt" in given) == ("messages" in given):
            raise InvalidRequest("exactly one of 'prompt' and 'messages' must be given")
        if "prompt" in given:
            if not isinstance(prompt, str):
                raise InvalidRequest(f"'prompt' must be a string, got {type(prompt).__name__}")
            if not prompt:
                raise InvalidRequest("'prompt' must not be empty")
        else:
            messages = parse_messages(given["messages"])
        tools = check_tools(given["tools"]) if "tools" in given else ()
        if tools and messages is None:
            raise InvalidRequest("'tools' are rendered by the chat template: send 'messages', not 'prompt'")
        return cls(prompt, messages, defaults.updated(given), frozenset(given) & frozenset(PARAM_FIELDS), tools)

    def choice(self, index: int, *, logprobs: bool = False) -> GenerationRequest:
        """The engine request of choice ``index`` of ``n`` (or of ``best_of`` candidates): one choice,
        seed ``seed + index`` (mod 2**64) when seeded, so a seeded request gives the same choices
        each time; ``logprobs`` asks for them whether or not the client did (``best_of`` ranks by them)."""
        params = replace(self.params, n=1, best_of=None,
                         seed=None if self.params.seed is None else (self.params.seed + index) % 2**64)
        given = self.given - {"n", "best_of"}
        if logprobs and not params.logprobs:
            params, given = replace(params, logprobs=True), given | {"logprobs"}
        return replace(self, params=params, given=given)

    def to_body(self) -> bytes:
        """The JSON body the worker's handler parses back (:func:`parse_request`): the prompt or
        messages and the parameters the client set."""
        obj: dict[str, Any] = ({"prompt": self.prompt} if self.prompt is not None
                               else {"messages": list(self.messages or ())})
        if self.tools:
            obj["tools"] = list(self.tools)
        obj.update(self.params.to_json(self.given))
        return json.dumps(obj).encode()


def _body_text(body: bytes | bytearray | memoryview | str) -> str:
    if isinstance(body, str):
        return body
    try:
        return bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"request body is not valid UTF-8 (byte {exc.start})") from None


def parse_request(body: Any, defaults: GenerationParams = GenerationParams()) -> GenerationRequest:
    """The request of a body (bytes as UTF-8, ``str``, or a decoded ``dict``): a JSON object is
    :meth:`GenerationRequest.build`, any other text the prompt, with ``defaults``.

    Raises:
        InvalidRequest: invalid UTF-8, a string with a lone surrogate, an empty body, a ``{`` body
            that is not valid JSON, or a field :meth:`GenerationRequest.build` refuses.
    """
    if isinstance(body, dict):
        return GenerationRequest.build(_valid_text(body), defaults)
    if not isinstance(body, (bytes, bytearray, memoryview, str)):
        raise InvalidRequest(f"request body must be bytes, text or an object, got {type(body).__name__}")
    text = _body_text(body)
    stripped = text.strip()
    obj = None
    if stripped.startswith("{"):
        try:
            obj = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if isinstance(obj, dict):
        return GenerationRequest.build(_valid_text(obj), defaults)
    if not text:
        raise InvalidRequest("request body is empty; send a prompt")
    return GenerationRequest(prompt=_valid_text(text), messages=None, params=defaults)


def _valid_text(body: Any) -> Any:
    """``body``, unless one of its strings holds a lone surrogate (InvalidRequest naming it)."""
    found = lone_surrogate(body, "prompt" if isinstance(body, str) else "")
    if found is not None:
        raise InvalidRequest(lone_surrogate_message(*found), found[0].split(".")[0].split("[")[0])
    return body
