"""Structured outputs on the engines, through XGrammar: the ``xgrammar`` package at the version
OpenVINO GenAI builds in (so a constraint that compiles here compiles in the OpenVINO engine),
imported on the first constrained request (it imports torch: about 200 MB and 4 s in a worker
that had none).

:func:`check_constraint` refuses a constraint that does not compile (before it reaches an engine,
whose step would fail on it); :class:`GrammarMasks` masks the torch engine's logits;
:func:`openvino_config` is the OpenVINO engine's ``StructuredOutputConfig``. A ``choice`` list is
the grammar ``root ::= "a" | "b" ...`` on both engines (docs/llm.md, "Structured outputs").
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from inference_service.contracts.request_error import InvalidRequest
from inference_service.contracts.structured import StructuredOutputs


def choice_grammar(choices: Collection[str]) -> str:
    """XGrammar's EBNF for "exactly one of ``choices``"."""
    return "root ::= " + " | ".join(_literal(choice) for choice in choices)


def _literal(text: str) -> str:
    """``text`` as an EBNF string literal: quotes and backslashes escaped, other unprintable
    characters as ``\\u`` with 4 hex digits (``\\U`` with 8 beyond the Basic Multilingual Plane)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}")
    return '"' + "".join(out) + '"'


#: JSON under a schema is written without free whitespace (XGrammar's ``any_whitespace=False``: one
#: space after ``,`` and ``:``), as vLLM's ``disable_any_whitespace``: a small model let free to
#: add whitespace writes newlines until ``max_tokens`` (5 of the 20 committed tool cases did).
JSON_OPTIONS: dict[str, Any] = {"any_whitespace": False}
#: Bytes of compiled constraints the torch engine keeps for reuse (XGrammar's compiler cache, the least
#: recently used evicted first): distinct constraints cost the worker at most this much.
COMPILED_CACHE_BYTES = 64 << 20


def _grammar(spec: StructuredOutputs) -> Any:
    """The XGrammar grammar of a constraint (``json``: :data:`JSON_OPTIONS`, strict: no properties
    beyond the schema's)."""
    import xgrammar

    schema = spec.schema()
    if schema is not None:
        return xgrammar.Grammar.from_json_schema(schema, **JSON_OPTIONS)
    if spec.regex is not None:
        return xgrammar.Grammar.from_regex(spec.regex)
    return xgrammar.Grammar.from_ebnf(spec.grammar if spec.grammar is not None else choice_grammar(spec.choice or ()))


def refusal_reason(spec: StructuredOutputs, exc: Exception) -> str:
    """Why XGrammar cannot compile ``spec`` (its own reason without its source path), as the end of a
    message that begins with the field's name."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    reason = reason.split(": ", 1)[1] if reason.startswith("[") and ": " in reason else reason
    what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regular expression",
            "grammar": "grammar", "choice": "choice list"}[spec.kind]
    return f"the {what} does not compile: {reason[:500]}"


def _refused(spec: StructuredOutputs, exc: Exception) -> InvalidRequest:
    """The 400 of a constraint XGrammar cannot compile."""
    return InvalidRequest(f"'structured_outputs.{spec.kind}': {refusal_reason(spec, exc)}", "structured_outputs")


def check_constraint(spec: StructuredOutputs) -> None:
    """Compile ``spec``'s grammar (no tokenizer needed); InvalidRequest naming the field if it fails."""
    try:
        _grammar(spec)
    except (RuntimeError, ValueError) as exc:
        raise _refused(spec, exc) from None


def openvino_config(spec: StructuredOutputs) -> Any:
    """``openvino_genai.StructuredOutputConfig`` of ``spec``; a JSON schema goes as the EBNF XGrammar
    converts it to under :data:`JSON_OPTIONS` (the pipeline's own conversion allows any whitespace)."""
    import openvino_genai

    if spec.schema() is not None:
        return openvino_genai.StructuredOutputConfig(grammar=str(_grammar(spec)))
    if spec.regex is not None:
        return openvino_genai.StructuredOutputConfig(regex=spec.regex)
    grammar = spec.grammar if spec.grammar is not None else choice_grammar(spec.choice or ())
    return openvino_genai.StructuredOutputConfig(grammar=grammar)


def tokenizer_info(tokenizer: Any, vocab_size: int, eos_ids: Collection[int]) -> Any:
    """XGrammar's ``TokenizerInfo`` of a transformers tokenizer over ``vocab_size`` logits. A
    tokenizer whose decoder has a ``ByteLevel`` step is byte-level whatever else it holds (the
    GGUF reader writes SmolLM2's as ``ByteFallback``, ``Fuse``, ``Replace``, ``ByteLevel``, which
    XGrammar would read as byte-fallback, its ``Ġ`` a literal character)."""
    import xgrammar

    stop = sorted(int(i) for i in eos_ids) or None
    own = getattr(tokenizer, "xgrammar_info", None)  # a tokenizer that is not transformers' (a GGUF's, llama.cpp)
    if own is not None:
        return own(vocab_size, stop)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
    if info.vocab_type != xgrammar.VocabType.BYTE_LEVEL and '"ByteLevel"' in json.dumps(decoder):
        vocab = [""] * vocab_size
        for piece, index in tokenizer.get_vocab().items():
            if index < vocab_size:
                vocab[index] = piece
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                      stop_token_ids=stop, add_prefix_space=False)
    return info


class GrammarMasks:
    """The torch engine's constraints: compiled once per distinct constraint (XGrammar's compiler
    cache), one matcher per request. Thread-safe: :meth:`compile` may run beside the step loop."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Collection[int]) -> None:
        import xgrammar

        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(tokenizer_info(tokenizer, vocab_size, eos_ids), max_threads=1,
                                                   cache_limit_bytes=COMPILED_CACHE_BYTES)

    def compile(self, spec: StructuredOutputs) -> Any:
        """The compiled grammar of ``spec``; InvalidRequest naming the field if it does not compile."""
        try:
            schema = spec.schema()
            if schema is not None:
                return self._compiler.compile_json_schema(schema, **JSON_OPTIONS)
            if spec.regex is not None:
                return self._compiler.compile_regex(spec.regex)
            return self._compiler.compile_grammar(spec.grammar if spec.grammar is not None
                                                  else choice_grammar(spec.choice or ()))
        except (RuntimeError, ValueError) as exc:
            raise _refused(spec, exc) from None

    def matcher(self, spec: StructuredOutputs) -> TokenMask:
        """A new request's matcher of ``spec``."""
        return TokenMask(self.compile(spec), self.vocab_size)


class TokenMask:
    """One request's grammar state: :meth:`apply` masks its next token's logits, :meth:`accept`
    advances it by the sampled token."""

    __slots__ = ("_matcher", "_bitmask")

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def apply(self, logits: Any) -> None:
        """Set the logits (``[vocab]``, float) of tokens the grammar forbids now to -inf (off the CPU with
        XGrammar's plain-torch kernel: its default one on a GPU needs triton, which is not installed)."""
        import xgrammar

        if not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(self._bitmask)
            on_cpu = logits.device.type == "cpu"
            xgrammar.apply_token_bitmask_inplace(logits.unsqueeze(0), self._bitmask.to(logits.device),
                                                 backend="cpu" if on_cpu else "torch_native")

    def accept(self, token: int) -> None:
        """Advance by the sampled ``token`` (the mask allowed it)."""
        if not self._matcher.is_terminated():
            self._matcher.accept_token(int(token))
