"""A GGUF file opened by llama.cpp (``llama-cpp-python``'s C API), and its tokenizer as the handler
reads tokenizers (transformers' methods the handler calls), so that the file is served as it is:
llama.cpp's own vocabulary, tokenization and chat template from the file, no conversion.

``llama_cpp`` is imported only here and in :mod:`inference_service.llm.llamacpp_engine`, when a model
on ``engine: llamacpp`` loads (``scripts/install --engine llamacpp`` compiles it for the CPU).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: llama.cpp's vocabulary types (``enum llama_vocab_type``) by value.
VOCAB_TYPES = {0: "none", 1: "spm", 2: "bpe", 3: "wpm", 4: "ugm", 5: "rwkv", 6: "plamo2"}


def import_llama_cpp() -> Any:
    """The ``llama_cpp`` module, its backend initialised once.

    Raises:
        ImportError: llama-cpp-python is not installed (the message names the install command).
    """
    try:
        import llama_cpp
    except ImportError as exc:
        raise ImportError("'engine: llamacpp' needs llama.cpp's binding in the worker's Python; install it with "
                          f"scripts/install --engine llamacpp ({exc})") from None
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = llama_cpp.llama_log_callback(_relay_log)
        llama_cpp.llama_log_set(_LOG_CALLBACK, None)
        llama_cpp.llama_backend_init()
    return llama_cpp


#: ggml's log levels (``enum ggml_log_level``) to ours: its debug and info lines (hundreds per load)
#: are dropped, warnings and errors logged.
_LEVELS = {3: logging.WARNING, 4: logging.ERROR}
_LOG_CALLBACK: Any = None  # kept referenced: llama.cpp calls it for as long as the process lives


#: llama.cpp's warnings about what the engine does on purpose, logged at DEBUG: one context for all
#: sequences (``kv_unified``: each request is held to the trained context by the engine) and the
#: full-size sliding-window cache that goes with it.
_EXPECTED = ("possible training context overflow", "using full-size SWA cache")


def _relay_log(level: int, text: bytes | None, _user_data: Any) -> None:
    if level in _LEVELS and text:
        line = text.decode("utf-8", "replace").rstrip()
        log.log(logging.DEBUG if any(e in line for e in _EXPECTED) else _LEVELS[level], "llama.cpp: %s", line)


class GGUFModel:
    """A GGUF file's weights and vocabulary, loaded by llama.cpp into memory (mmap).

    Raises:
        ValueError: llama.cpp cannot load the file (not a GGUF, an architecture it lacks).
    """

    def __init__(self, path: Path) -> None:
        ll = import_llama_cpp()
        self.ll = ll
        self.path = path
        params = ll.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = ll.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise ValueError(f"llama.cpp cannot load {path} (not a GGUF file, or an architecture this llama.cpp lacks)")
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.n_vocab = int(ll.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(ll.llama_model_n_ctx_train(self.model))
        self.n_embd = int(ll.llama_model_n_embd(self.model))
        self.size_bytes = int(ll.llama_model_size(self.model))
        self.n_params = int(ll.llama_model_n_params(self.model))
        n_head = max(1, int(ll.llama_model_n_head(self.model)))
        #: bytes of KV cache one token position takes (keys and values, F16, every layer)
        self.kv_bytes_per_token = (2 * int(ll.llama_model_n_layer(self.model)) * 2
                                   * (self.n_embd // n_head) * max(1, int(ll.llama_model_n_head_kv(self.model))))

    def meta(self, key: str) -> str | None:
        """The GGUF metadata value of ``key`` as text (``None``: absent)."""
        buf = ctypes.create_string_buffer(1 << 16)
        n = self.ll.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            self.ll.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def description(self) -> str:
        """llama.cpp's one-line description (architecture, size, quantization)."""
        buf = ctypes.create_string_buffer(256)
        self.ll.llama_model_desc(self.model, buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def close(self) -> None:
        if self.model:
            self.ll.llama_model_free(self.model)
            self.model = None


class GGUFTokenizer:
    """llama.cpp's tokenizer of a GGUF behind the transformers methods the handler calls
    (``__call__``, ``encode``, ``decode``, ``convert_ids_to_tokens``, ``get_vocab``,
    ``apply_chat_template``, ``chat_template``, ``eos_token_id``). Thread-safe: llama.cpp's
    vocabulary is read-only once loaded."""

    def __init__(self, model: GGUFModel) -> None:
        ll = self._ll = model.ll
        self._vocab = model.vocab
        self._n_vocab = model.n_vocab
        self.vocab_type = VOCAB_TYPES.get(int(ll.llama_vocab_type(model.vocab)), "unknown")
        self.bos_token_id = _token_or_none(ll.llama_vocab_bos(model.vocab))
        self.eos_token_id = _token_or_none(ll.llama_vocab_eos(model.vocab))
        self.eos_ids = frozenset(i for i in range(self._n_vocab) if ll.llama_vocab_is_eog(model.vocab, i))
        self.bos_token = self._text(self.bos_token_id) if self.bos_token_id is not None else None
        self.eos_token = self._text(self.eos_token_id) if self.eos_token_id is not None else None
        self.add_bos_token = bool(ll.llama_vocab_get_add_bos(model.vocab))
        self.chat_template: str | None = model.meta("tokenizer.chat_template") or None
        self._pieces: list[str] | None = None

    def __len__(self) -> int:
        return self._n_vocab

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """llama.cpp's tokenization (special tokens written in the text are parsed as such, as
        transformers does); ``add_special_tokens``: the BOS the model asks for."""
        data = text.encode("utf-8", "surrogatepass")
        size = len(data) + 8
        while True:
            out = (self._ll.llama_token * size)()
            n = self._ll.llama_tokenize(self._vocab, data, len(data), out, size, add_special_tokens, True)
            if n >= 0:
                return list(out[:n])
            size = -n

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False) -> str:
        """llama.cpp's detokenization; an incomplete UTF-8 sequence ends in U+FFFD (as transformers)."""
        ids = [int(i) for i in ids]
        tokens = (self._ll.llama_token * max(1, len(ids)))(*ids)
        size = 16 * len(ids) + 16
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self._ll.llama_detokenize(self._vocab, tokens, len(ids), buf, size, False, not skip_special_tokens)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", "replace")
            size = -n + 1

    def piece_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for in text (b"" for a control token)."""
        buf = ctypes.create_string_buffer(256)
        n = self._ll.llama_token_to_piece(self._vocab, int(token_id), buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._ll.llama_token_to_piece(self._vocab, int(token_id), buf, len(buf), 0, False)
        return buf.raw[:max(n, 0)]

    def _text(self, token_id: int) -> str:
        raw = self._ll.llama_vocab_get_text(self._vocab, int(token_id))
        return raw.decode("utf-8", "replace") if raw else ""

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        """The vocabulary entries (llama.cpp's token texts) of ``ids``."""
        if isinstance(ids, int):
            return self._text(ids)
        return [self._text(i) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        """``{token text: id}`` (the first id of a text that appears twice)."""
        if self._pieces is None:
            self._pieces = [self._text(i) for i in range(self._n_vocab)]
        vocab: dict[str, int] = {}
        for index, piece in enumerate(self._pieces):
            vocab.setdefault(piece, index)
        return vocab

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = False, tools: list[dict[str, Any]] | None = None,
                            **kwargs: Any) -> str | list[int]:
        """The chat rendered by the model's Jinja template (transformers' renderer, its variables:
        ``messages``, ``tools``, ``add_generation_prompt``, ``bos_token``, ``eos_token``).

        Raises:
            ValueError: the model has no chat template.
            jinja2.TemplateError: the template itself refused the chat.
        """
        from transformers.utils.chat_template_utils import render_jinja_template

        if not self.chat_template:
            raise ValueError("this model has no chat template")
        rendered = render_jinja_template(
            conversations=[messages], tools=list(tools) if tools else None, chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
            eos_token=self.eos_token or "", **kwargs)
        text = str(rendered[0][0])
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def xgrammar_info(self, vocab_size: int, stop_ids: Sequence[int] | None) -> Any:
        """XGrammar's ``TokenizerInfo``: each token's bytes as llama.cpp writes them (``RAW``), so
        that a constraint reads the vocabulary as llama.cpp decodes it, whatever its type."""
        import xgrammar

        vocab = [self.piece_bytes(i) for i in range(min(vocab_size, self._n_vocab))]
        vocab += [b""] * (vocab_size - len(vocab))
        return xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=vocab_size,
                                      stop_token_ids=list(stop_ids) if stop_ids else sorted(self.eos_ids),
                                      add_prefix_space=False)


def _token_or_none(token: int) -> int | None:
    return int(token) if token is not None and int(token) >= 0 else None
