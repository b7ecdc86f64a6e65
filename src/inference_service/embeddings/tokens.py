"""Inputs to token ids with the model's own ``tokenizer.json`` (the ``tokenizers`` library: no
torch), checked against the model's ``max_length`` and vocabulary.

Token ids from a request are read as the tokenizer writes them, with the special tokens around
the text (``[CLS] ... [SEP]``); ids without that frame get it added, so ``[7592, 2088]`` and
``[101, 7592, 2088, 102]`` are the same input. The OpenVINO pipeline tokenizes text itself: it
gets the ids decoded, which must tokenize back to the same ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from inference_service.contracts.embeddings import Input, InvalidEmbeddingRequest
from inference_service.contracts.text import lone_surrogate, lone_surrogate_message
from inference_service.embeddings.engines import Encoded


class InputEncoder:
    """Tokenizes a request's inputs (``max_length``: most tokens of one input, frame included).

    Raises (``encode``):
        InvalidEmbeddingRequest: a text with a lone surrogate, an input longer than ``max_length``
            tokens, a token id outside the vocabulary, or (``need_text``) ids that do not decode to
            a text giving them back.
    """

    def __init__(self, tokenizer_file: Path, max_length: int, need_text: bool) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.tokenizer.no_truncation()  # sentence-transformers' files cut at 128 and pad to it: we check
        self.tokenizer.no_padding()
        self.max_length = max_length
        self.need_text = need_text
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        probe = self.tokenizer.encode("a").ids
        inner = self.tokenizer.encode("a", add_special_tokens=False).ids
        start = next(i for i in range(len(probe)) if probe[i:i + len(inner)] == inner)
        self.prefix, self.suffix = probe[:start], probe[start + len(inner):]
        pad = self.tokenizer.token_to_id("[PAD]")
        self.pad_id = pad if pad is not None else 0

    def encode(self, inputs: Sequence[Input], fields: Sequence[str]) -> list[Encoded]:
        """One :class:`Encoded` per input, in order; ``fields[i]`` names input ``i`` in errors."""
        texts = [(i, text) for i, text in enumerate(inputs) if isinstance(text, str)]
        for index, text in texts:
            found = lone_surrogate(text, fields[index])
            if found is not None:
                raise InvalidEmbeddingRequest(fields[index], lone_surrogate_message(None, found[1]))
        out: list[Encoded | None] = [None] * len(inputs)
        for (index, text), encoding in zip(texts, self.tokenizer.encode_batch([t for _, t in texts]), strict=True):
            out[index] = Encoded(list(encoding.ids), text)
        for index, value in enumerate(inputs):
            if not isinstance(value, str):
                out[index] = self._from_ids(value, fields[index])
        for index, item in enumerate(out):
            assert item is not None
            if len(item.ids) > self.max_length:
                raise InvalidEmbeddingRequest(fields[index],
                                              f"{len(item.ids)} tokens, more than this model takes "
                                              f"({self.max_length}, special tokens included)")
        return [item for item in out if item is not None]

    def _from_ids(self, ids: list[int], field: str) -> Encoded:
        for position, token in enumerate(ids):
            if token >= self.vocab_size:
                raise InvalidEmbeddingRequest(f"{field}[{position}]", f"token id {token} is not in the model's "
                                                                      f"vocabulary (0 to {self.vocab_size - 1})")
        frame = len(self.prefix) + len(self.suffix)
        framed = (len(ids) >= frame and ids[:len(self.prefix)] == self.prefix
                  and ids[len(ids) - len(self.suffix):] == self.suffix)
        full = list(ids) if framed else [*self.prefix, *ids, *self.suffix]
        if not self.need_text:
            return Encoded(full, "")
        inner = full[len(self.prefix):len(full) - len(self.suffix)]
        text = self.tokenizer.decode(inner, skip_special_tokens=False)
        if self.tokenizer.encode(text).ids != full:
            raise InvalidEmbeddingRequest(field, "these token ids are not what the model's tokenizer writes for "
                                                 "any text, and the openvino engine reads text; send the text, or "
                                                 "serve the model with 'engine: torch'")
        return Encoded(full, text)
