"""The tokenizer requests an LLM handler answers beside generation (vLLM's ``/tokenize`` and
``/detokenize``), typed: built by the OpenAI door, sent to the worker as the JSON body
``{"tokenize": {...}}`` or ``{"detokenize": {...}}``, answered by the handler with the model's own
tokenizer in vLLM's shapes (``{"count", "max_model_len", "tokens", "token_strs"}``, ``{"prompt"}``).
Every problem raises :class:`~inference_service.contracts.sampling.InvalidRequest` naming the field.
See docs/llm.md, "Prefix caching".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inference_service.contracts.sampling import InvalidRequest, parse_messages
from inference_service.contracts.structured import check_tools

#: Most token ids one ``/detokenize`` request may give.
MAX_DETOKENIZE_TOKENS = 1 << 17
_KINDS = (b'{"tokenize"', b'{"detokenize"')

#: The 400 of ``messages`` for a model without a chat template (docs/own-model.md).
NO_CHAT_TEMPLATE = ("this model has no chat template; send 'prompt' instead of 'messages', or give the model one: "
                    "'chat_template' in its handler config (scripts/build_llm_archive --chat-template FILE)")


def _flag(values: Mapping[str, Any], name: str, default: bool) -> bool:
    value = values.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be true or false, got {type(value).__name__}", name)
    return value


@dataclass(frozen=True)
class TokenizeRequest:
    """``/tokenize``: a ``prompt`` (with the tokenizer's special tokens unless ``add_special_tokens``
    is false) or ``messages`` (through the chat template, with its generation prompt unless
    ``add_generation_prompt`` is false or ``continue_final_message``, and the ``tools`` the template
    renders: then the count equals a generation's prompt tokens); ``return_token_strs`` adds the
    tokens' vocabulary strings."""

    prompt: str | None
    messages: tuple[dict[str, Any], ...] | None
    add_special_tokens: bool
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: tuple[dict[str, Any], ...] = ()

    @classmethod
    def build(cls, values: Mapping[str, Any]) -> TokenizeRequest:
        """Raises InvalidRequest: both or neither of ``prompt``/``messages``, a wrong type."""
        if ("prompt" in values) == ("messages" in values):
            raise InvalidRequest("exactly one of 'prompt' and 'messages' must be given")
        continued = _flag(values, "continue_final_message", False)
        generation = _flag(values, "add_generation_prompt", not continued)
        if continued and generation:
            raise InvalidRequest("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                                 "continue_final_message")
        tokens_strs = _flag(values, "return_token_strs", False)
        if "prompt" in values:
            prompt = values["prompt"]
            if not isinstance(prompt, str):
                raise InvalidRequest(f"'prompt' must be a string, got {type(prompt).__name__}", "prompt")
            return cls(prompt, None, _flag(values, "add_special_tokens", True), return_token_strs=tokens_strs)
        tools = check_tools(values["tools"]) if values.get("tools") is not None else ()
        return cls(None, parse_messages(values["messages"]), _flag(values, "add_special_tokens", False),
                   generation, continued, tokens_strs, tools)

    def to_body(self) -> bytes:
        fields: dict[str, Any] = ({"prompt": self.prompt} if self.prompt is not None
                                  else {"messages": list(self.messages or ()),
                                        "add_generation_prompt": self.add_generation_prompt,
                                        "continue_final_message": self.continue_final_message,
                                        **({"tools": list(self.tools)} if self.tools else {})})
        fields.update(add_special_tokens=self.add_special_tokens, return_token_strs=self.return_token_strs)
        return json.dumps({"tokenize": fields}).encode()


@dataclass(frozen=True)
class DetokenizeRequest:
    """``/detokenize``: the text of token ids (special tokens included, as vLLM's)."""

    tokens: tuple[int, ...]

    @classmethod
    def build(cls, values: Mapping[str, Any]) -> DetokenizeRequest:
        """Raises InvalidRequest: ``tokens`` not a list of up to :data:`MAX_DETOKENIZE_TOKENS` ids."""
        tokens = values.get("tokens")
        if not isinstance(tokens, list) or len(tokens) > MAX_DETOKENIZE_TOKENS:
            raise InvalidRequest(f"'tokens' must be a list of at most {MAX_DETOKENIZE_TOKENS} token ids", "tokens")
        for token in tokens:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 2**31:
                raise InvalidRequest(f"'tokens' entries must be token ids (integers from 0), got {token!r:.40}",
                                     "tokens")
        return cls(tuple(tokens))

    def to_body(self) -> bytes:
        return json.dumps({"detokenize": {"tokens": list(self.tokens)}}).encode()


def parse_tokenizer_request(body: Any) -> TokenizeRequest | DetokenizeRequest | None:
    """The tokenizer request a body holds (bytes or a decoded JSON object), ``None`` for any other
    body (a generation request).

    Raises:
        InvalidRequest: a tokenizer request with a bad field.
    """
    if isinstance(body, (bytes, bytearray)):
        if not bytes(body[:14]).startswith(_KINDS):
            return None
        try:
            body = json.loads(body)
        except ValueError:
            return None
    if not isinstance(body, dict) or len(body) != 1:
        return None
    kind, values = next(iter(body.items()))
    if kind not in ("tokenize", "detokenize") or not isinstance(values, dict):
        return None
    return TokenizeRequest.build(values) if kind == "tokenize" else DetokenizeRequest.build(values)
