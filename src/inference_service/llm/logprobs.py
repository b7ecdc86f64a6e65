"""Log probabilities as the LLM handler sends them: the engines' sampled token ids turned into
OpenAI's entries (token text, log probability, UTF-8 bytes, alternatives) with the model's tokenizer.

A token of a byte-level BPE vocabulary (GPT-2's, SmolLM2's) may hold part of a character: its
``bytes`` are its own bytes, its ``token`` their text with U+FFFD for the incomplete character, as
vLLM shows it. See docs/llm.md, "The stream's messages".
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from inference_service.contracts.outputs import Piece, TokenLogprob, TopLogprob
from inference_service.llm.engine_protocol import SampledLogprob


def _byte_of_character() -> dict[str, int]:
    """Byte-level BPE's alphabet: each byte's stand-in character (printable bytes stand for
    themselves; the others are the characters from U+0100 on, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for byte in range(256):
        if byte not in printable:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


_BYTE_OF = _byte_of_character()


def _is_byte_level(tokenizer: Any) -> bool:
    """Whether a fast tokenizer's decoder is (or holds) byte-level BPE's."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        decoder = json.loads(backend.to_str())["decoder"] if backend is not None else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return False
    pending = [decoder]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            if node.get("type") == "ByteLevel":
                return True
            pending.extend(node.get("decoders") or [])
    return False


class TokenTexts:
    """Token ids to OpenAI's log probability entries, with ``tokenizer`` (each id's text cached)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._cache: dict[int, tuple[str, tuple[int, ...]]] = {}

    def text(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        """``(token text, its UTF-8 bytes)``."""
        cached = self._cache.get(token_id)
        if cached is None:
            raw = None
            if self._byte_level:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if isinstance(piece, str) and all(c in _BYTE_OF for c in piece):
                    raw = bytes(_BYTE_OF[c] for c in piece)
            if raw is None:
                raw = self.tokenizer.decode([token_id]).encode("utf-8")
            cached = self._cache[token_id] = (raw.decode("utf-8", "replace"), tuple(raw))
        return cached

    def entries(self, sampled: Iterable[SampledLogprob]) -> tuple[TokenLogprob, ...]:
        """OpenAI's entries of the engine's sampled tokens."""
        out = []
        for item in sampled:
            tops = []
            for token_id, logprob in item.top:
                text, raw = self.text(token_id)
                tops.append(TopLogprob(text, logprob, raw))
            token, raw = self.text(item.token_id)
            out.append(TokenLogprob(token, item.logprob, raw, tuple(tops)))
        return tuple(out)

    def piece(self, text: str, sampled: Sequence[SampledLogprob]) -> dict[str, Any] | None:
        """The intermediate message of a request with ``logprobs`` (``None``: nothing new)."""
        if not text and not sampled:
            return None
        return Piece(text, self.entries(sampled)).to_json()


def held_messages(messages: Sequence[str | dict[str, Any]]) -> tuple[str, list[TokenLogprob]]:
    """The text and entries of messages that could not be sent (outside a worker), in order."""
    texts: list[str] = []
    entries: list[TokenLogprob] = []
    for message in messages:
        if isinstance(message, str):
            texts.append(message)
            continue
        texts.append(message["text"])
        entries.extend(TokenLogprob.from_json(entry) for entry in message["logprobs"])
    return "".join(texts), entries
