"""A GGUF converted to a transformers folder, checked against llama.cpp on the same file before the
folder is kept (issue 47 item 2): transformers once read Gemma 3's GGUF tokenizer with a wrong
pattern and the server answered "What is the ciphertal of France?".

Two checks, on committed texts and prompts: the converted tokenizer gives llama.cpp's token ids for
every text; and the converted model's greedy tokens (transformers, fp32) equal llama.cpp's for
:data:`TOKENS` tokens of every prompt when the file holds F32/F16/BF16 weights, or, for a quantized
file (llama.cpp computes with the quantized weights, the folder holds them dequantized), the first
token of every prompt. Without llama.cpp installed the conversion is kept unchecked, with a warning.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Tokenized by both sides: words, code, digits, accents, CJK, runs of spaces, tabs and newlines.
TEXTS = (
    "Hello, world! The capital of France is Paris.",
    "def add(a, b):\n    return a + b\n",
    "Größe, naïve café, 東京 and 12345.678%",
    "  two  spaces\tand a tab\n\nnew paragraph",
)
PROMPTS = ("The capital of France is", "Water boils at a temperature of", "def fibonacci(n):",
           "Once upon a time")
TOKENS = 8
#: ``general.file_type`` of unquantized files (llama.cpp's ``ALL_F32``, ``MOSTLY_F16``, ``MOSTLY_BF16``)
EXACT_FILE_TYPES = {"0", "1", "32"}


class ConversionMismatch(ValueError):
    """A conversion that differs from llama.cpp on the same file (the model module's loader makes it
    a ``ModelPreparationError``)."""


def check_gguf_conversion(gguf: Path, tokenizer: Any, model: Any) -> str | None:
    """Hold a GGUF's conversion (its transformers ``tokenizer`` and ``model``) to llama.cpp on ``gguf``.

    Returns:
        The figures of a passed check (one line), or ``None`` when llama.cpp is not installed.

    Raises:
        ConversionMismatch: the conversion differs; the message gives the figures and the next step.
    """
    if importlib.util.find_spec("llama_cpp") is None:
        log.warning("the conversion of %s is not checked: llama.cpp is not installed (scripts/install --engine "
                    "llamacpp)", gguf.name)
        return None
    from inference_service.llm.llamacpp_engine import LlamaCppEngine
    from inference_service.llm.llamacpp_model import GGUFModel, GGUFTokenizer
    from inference_service.llm.params import GenerationParams

    reference = GGUFModel(gguf)
    engine = None
    try:
        ref_tokenizer = GGUFTokenizer(reference)
        differing = [text for text in TEXTS if list(tokenizer(text, add_special_tokens=False)["input_ids"])
                     != ref_tokenizer.encode(text, add_special_tokens=False)]
        next_step = ("serve the file as it is with --engine llamacpp (handler config 'engine: llamacpp')")
        if differing:
            raise ConversionMismatch(
                f"the conversion of {gguf.name} tokenizes {len(differing)} of {len(TEXTS)} committed texts unlike "
                f"llama.cpp (first: {differing[0]!r}); it is not served: {next_step}")
        exact = reference.meta("general.file_type") in EXACT_FILE_TYPES
        engine = LlamaCppEngine(reference, ref_tokenizer, max_num_seqs=1, max_num_batched_tokens=256,
                                kv_cache_tokens=512, threads=None)
        agree = 0
        for prompt in PROMPTS:
            ids = ref_tokenizer.encode(prompt)
            engine.add("check", ids, GenerationParams(max_new_tokens=TOKENS, ignore_eos=True))
            expected: list[int] = []
            while engine.has("check"):
                for out in engine.step().values():
                    if out.finished and out.result is not None:
                        expected = list(out.result.token_ids)
            got = _greedy(model, ids)
            same = got == expected if exact else got[:1] == expected[:1]
            agree += same
            if not same:
                what = f"{TOKENS} greedy tokens" if exact else "the first greedy token"
                raise ConversionMismatch(
                    f"the conversion of {gguf.name} differs from llama.cpp on {what} of {prompt!r}: "
                    f"{tokenizer.decode(got)!r} against {ref_tokenizer.decode(expected)!r}; it is not served: "
                    f"{next_step}")
    finally:
        if engine is not None:
            engine.close()  # the model with it
        else:
            reference.close()
    figures = (f"tokenization equal on {len(TEXTS)} texts; {'all ' + str(TOKENS) if exact else 'the first'} greedy "
               f"tokens equal on {agree} of {len(PROMPTS)} prompts (llama.cpp on the same file)")
    log.info("conversion of %s checked: %s", gguf.name, figures)
    return figures


def _greedy(model: Any, ids: list[int]) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False,
                             pad_token_id=0)
    return [int(t) for t in out[0, len(ids):]]
