"""Text out of generated tokens: streaming decoding and stop strings.

Neither imports torch or transformers; the decoder only calls ``tokenizer.decode``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Turn a growing list of token ids into text pieces that never need retracting.

    :meth:`push` decodes a suffix window (so the cost per token stays bounded) and holds text back
    while it ends in U+FFFD (a split multi-byte character) or does not extend what was released.
    It decodes without transformers' ``clean_up_tokenization_spaces`` (as vLLM's detokenizer):
    that rewrite (``" ,"`` to ``","``) reaches back into text already released, so a stream
    would lose characters (a JSON answer its commas). Invariant: ``"".join(pushes) + flush() ==
    tokenizer.decode(all_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)`` for
    prefix-stable decoders (byte-level BPE such as SmolLM2's, and SentencePiece).
    """

    #: window start is moved forward once the stable text is this many tokens behind
    _WINDOW = 32

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._start = 0  # window start (token index)
        self._released = ""  # text released since the window start
        self._released_ids = 0  # token count whose text is fully released (window end of stable text)

    @property
    def token_ids(self) -> list[int]:
        """All ids pushed so far (a copy)."""
        return list(self._ids)

    def _decode_window(self) -> str:
        return self._decode(self._ids[self._start :])

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False))

    def push(self, token_id: int) -> str:
        """Add one token id and return the newly stable text (possibly ``""``)."""
        self._ids.append(int(token_id))
        text = self._decode_window()
        if text.endswith(_REPLACEMENT) or not text.startswith(self._released):
            return ""
        piece = text[len(self._released) :]
        self._released = text
        self._released_ids = len(self._ids)
        self._advance_window()
        return piece

    def _advance_window(self) -> None:
        """Move the window start to a token boundary ``s`` where decoding ``ids[s:]`` gives exactly the
        released text after ``decode(ids[start:s])``, so decoding stays equivalent."""
        if self._released_ids - self._start < 2 * self._WINDOW:
            return
        new_start = self._released_ids - self._WINDOW
        head = self._decode(self._ids[self._start : new_start])
        tail = self._decode(self._ids[new_start : self._released_ids])
        if head + tail == self._released and _REPLACEMENT not in head[-1:] + tail[:1]:
            self._start = new_start
            self._released = tail

    def flush(self) -> str:
        """All text not yet released (may end in U+FFFD if generation stopped mid-character)."""
        text = self._decode_window()
        # for a decoder that is not prefix-stable the released text cannot be
        # taken back; release what lies past its length (best effort)
        piece = text[len(self._released) :]
        self._released = text
        self._released_ids = len(self._ids)
        return piece


class StopStringFilter:
    """Cut a text stream at the first occurrence of any stop string (none: pass-through).

    :meth:`push` releases everything up to a complete stop string, otherwise all but the longest
    tail that is a proper prefix of one; :meth:`flush` releases a held tail at the end.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None  #: the stop string found, once one was

    @property
    def stopped(self) -> bool:
        """Whether a stop string was found (later pushes return ``""``)."""
        return self.matched is not None

    def push(self, text: str) -> str:
        """Add text; return what may be released now (possibly ``""``)."""
        if self.matched is not None:
            return ""
        if not self._stops:
            return text
        buffer = self._held + text
        best: tuple[int, str] | None = None
        for stop in self._stops:
            pos = buffer.find(stop)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is not None:
            self.matched = best[1]
            self._held = ""
            return buffer[: best[0]]
        hold = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buffer)), hold, -1):
                if buffer.endswith(stop[:k]):
                    hold = k
                    break
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        """Release the held-back tail (``""`` after a stop string was found)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held
