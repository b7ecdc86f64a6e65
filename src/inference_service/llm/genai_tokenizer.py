"""OpenVINO GenAI's own tokenizer (``openvino_genai.Tokenizer``, read from a GGUF file with its
model) behind the part of transformers' tokenizer interface the LLM handler uses, so a GGUF is
served as it is, without a transformers tokenizer (whose GGUF reader needs torch and half a minute).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class GenAITokenizer:
    """``tokenizer(text)["input_ids"]``, ``decode``, ``apply_chat_template(..., tokenize=False)``,
    ``chat_template``, ``get_vocab``, ``eos_token_id``, ``pad_token_id`` and ``bos_token_id`` over an
    ``openvino_genai.Tokenizer``. Chat template errors raise jinja2's ``TemplateError``, as
    transformers' do."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.chat_template: str | None = tokenizer.chat_template or None
        self.eos_token_id: int | None = _token_id(tokenizer.get_eos_token_id())
        self.bos_token_id: int | None = _token_id(tokenizer.get_bos_token_id())
        self.pad_token_id: int | None = _token_id(tokenizer.get_pad_token_id())

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        encoded = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": [int(i) for i in encoded.input_ids.data[0]]}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True,
               clean_up_tokenization_spaces: bool = False) -> str:
        """``clean_up_tokenization_spaces`` is accepted as transformers' is; OpenVINO's decoder does no such rewrite."""
        return str(self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, tools: Sequence[dict[str, Any]] | None = None) -> str:
        from jinja2 import TemplateError

        if tokenize:
            raise ValueError("GenAITokenizer.apply_chat_template renders text only (tokenize=False)")
        try:
            return str(self._tokenizer.apply_chat_template(list(messages), add_generation_prompt, tools=tools))
        except RuntimeError as exc:  # the template itself failed (e.g. an unsupported role order)
            raise TemplateError(str(exc).strip().splitlines()[-1] if str(exc).strip() else "template error") from None

    def get_vocab(self) -> dict[str, int]:
        return {piece.decode("utf-8", "replace"): int(index) for piece, index in self._tokenizer.get_vocab().items()}


def _token_id(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and value >= 0 else None
