"""A transformers folder's OpenVINO IR, checked against transformers before it is kept (issue 47
item 2): a conversion that changes what the model says is never served.

Run by :func:`inference_service.llm.openvino_ir.convert` in a process of its own
(``python -m inference_service.llm.ir_check SOURCE IR_DIR WEIGHT_FORMAT``: it loads torch, which
an OpenVINO worker never imports), on the exporter's output before it enters the cache. Two checks,
on :mod:`~inference_service.llm.conversion_check`'s committed texts and prompts:

- the IR's tokenizer files give the source's token ids for every text;
- greedy decoding on the OpenVINO engine, as served (the format's precision settings), against
  transformers' eager fp32: for ``fp32`` the first :data:`TOKENS` tokens of
  every prompt are equal (or part where transformers' choice is a near-tie, :data:`TIE_NATS`); for
  a quantized format each prompt's first token is transformers' most
  likely one or within :data:`MAX_GAP_NATS` of it (a quantized model may flip a near-tie; a broken
  conversion answers tokens transformers finds unlikely).

The verdict is the last line of the process's output: ``ok <figures>`` (exit 0), or the mismatch
with its figures (exit 3).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from inference_service.llm.conversion_check import PROMPTS, TEXTS
from inference_service.llm.model import ModelPreparationError

log = logging.getLogger(__name__)

#: The check's version, in the IR cache's key: a new check converts (and checks) again.
VERSION = 1
#: Greedy tokens compared for an unquantized IR.
TOKENS = 16
#: Most a quantized IR's first greedy token may lie below transformers' most likely one, in
#: transformers' log probabilities (nats).
MAX_GAP_NATS = 1.0
#: An unquantized IR may part from transformers' greedy tokens where transformers' two most likely
#: differ by at most this much (nats): float rounding in another order flips such a near-tie (a
#: random test model has many), and the tokens after it follow another prefix.
TIE_NATS = 1e-3
#: Exit status of a conversion that differs.
MISMATCH = 3
NEXT_STEP = "set 'engine: torch' in the handler config (scripts/build_llm_archive --engine torch) to serve the folder"


class IRMismatch(ValueError):
    """The IR differs from transformers; the message gives the figures and the next step."""


def check(source: Path, ir_dir: Path, weight_format: str) -> str:
    """Hold ``ir_dir`` (``weight_format``) to transformers on ``source``; the figures of a pass.

    Raises:
        IRMismatch: the tokenizer or the greedy tokens differ (see the module docstring).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    served = AutoTokenizer.from_pretrained(str(ir_dir))
    differing = [text for text in TEXTS if tokenizer(text, add_special_tokens=False)["input_ids"]
                 != served(text, add_special_tokens=False)["input_ids"]]
    if differing:
        raise IRMismatch(f"its tokenizer gives other token ids than {source.name}'s on {len(differing)} of "
                         f"{len(TEXTS)} committed texts (first: {differing[0]!r})")
    model = AutoModelForCausalLM.from_pretrained(str(source), torch_dtype=torch.float32, attn_implementation="eager")
    prompts = [list(tokenizer(prompt)["input_ids"]) for prompt in PROMPTS]
    got = _served(ir_dir, weight_format, tokenizer, prompts)
    exact = weight_format == "fp32"
    equal = ties = 0
    for prompt, ids, tokens in zip(PROMPTS, prompts, got, strict=True):
        expected, steps = _greedy(model, ids, TOKENS if exact else 1)
        if exact and tokens != expected:
            at = next(i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b)
            if float(steps[at][expected[at]] - steps[at][tokens[at]]) > TIE_NATS:
                raise IRMismatch(f"its {TOKENS} greedy tokens of {prompt!r} are {tokenizer.decode(tokens)!r}, "
                                 f"transformers' (fp32) {tokenizer.decode(expected)!r}")
            ties += 1  # a near-tie that float rounding flips: the rest follows another prefix
        logprobs = steps[0]
        gap = float(logprobs[expected[0]] - logprobs[tokens[0]])
        if gap > MAX_GAP_NATS:
            raise IRMismatch(f"its first greedy token of {prompt!r} is {tokenizer.decode(tokens[:1])!r}, "
                             f"{gap:.2f} nats below transformers' (fp32) {tokenizer.decode(expected[:1])!r} "
                             f"(at most {MAX_GAP_NATS:g})")
        equal += tokens[0] == expected[0]
    what = (f"all {TOKENS} greedy tokens of {len(PROMPTS)} prompts equal"
            + (f" ({ties} up to a near-tie within {TIE_NATS:g} nats)" if ties else "") if exact else
            f"the first greedy token of {len(PROMPTS)} prompts within {MAX_GAP_NATS:g} nats "
            f"({equal} equal)")
    return (f"tokenization equal on {len(TEXTS)} texts; {what} (transformers fp32 eager on the folder); "
            f"checked in {time.perf_counter() - start:.1f} s")


def _greedy(model: Any, ids: list[int], count: int) -> tuple[list[int], list[Any]]:
    """``count`` greedy tokens of transformers after ``ids`` (no end of sequence: as ``ignore_eos``),
    and the log probabilities at each of them."""
    import torch

    tokens: list[int] = []
    steps: list[Any] = []
    past, step = None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(count):
            out = model(step, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1].float()
            steps.append(torch.log_softmax(logits, -1))
            tokens.append(int(logits.argmax()))
            step = torch.tensor([[tokens[-1]]])
    return tokens, steps


def _served(ir_dir: Path, weight_format: str, tokenizer: Any, prompts: list[list[int]]) -> list[list[int]]:
    """The greedy tokens of ``prompts`` on the OpenVINO engine with the format's precision settings
    (those a worker serves with; the CPU rows of :mod:`~inference_service.llm.cpu_defaults` add none)."""
    from inference_service.llm.engine_protocol import run_to_the_end
    from inference_service.llm.openvino_engine import OpenVINOEngine
    from inference_service.llm.params import GenerationParams

    engine = OpenVINOEngine(ir_dir, tokenizer, (), max_num_seqs=len(prompts), max_model_len=4096,
                            weight_format=weight_format)
    try:
        return run_to_the_end(engine, prompts, GenerationParams(max_new_tokens=TOKENS, ignore_eos=True), 20 * TOKENS)
    except RuntimeError as exc:
        raise IRMismatch(f"the OpenVINO engine did not finish its greedy requests: {exc}") from None
    finally:
        engine.close()


def checked(source: Path, ir_dir: Path, weight_format: str, env: dict[str, str], timeout_s: float) -> str:
    """Run :func:`check` in a process of its own (environment ``env``); the figures of a pass.

    Raises:
        ModelPreparationError: the IR differs (the figures and :data:`NEXT_STEP`), or the check
            could not run (its last lines).
    """
    command = [sys.executable, "-m", __name__, str(source), str(ir_dir), weight_format]
    try:
        done = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              errors="replace", timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ModelPreparationError(f"checking the OpenVINO IR of {source} took over {timeout_s:.0f} s") from None
    lines = done.stdout.strip().splitlines()
    verdict = lines[-1] if lines else ""
    if done.returncode == 0 and verdict.startswith("ok "):
        log.info("the OpenVINO IR of %s (%s) holds to transformers: %s", source, weight_format, verdict[3:])
        return verdict[3:]
    if done.returncode == MISMATCH:
        raise ModelPreparationError(f"the conversion of {source} to OpenVINO IR ({weight_format}) differs from "
                                    f"transformers: {verdict}; it is not served: {NEXT_STEP}")
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
    raise ModelPreparationError(f"cannot check the OpenVINO IR of {source} against transformers (exit status "
                                f"{done.returncode}): {tail}")


def main(argv: list[str]) -> int:
    """``SOURCE IR_DIR WEIGHT_FORMAT``: print the verdict line; 0 when it passes, :data:`MISMATCH` else."""
    source, ir_dir, weight_format = Path(argv[0]), Path(argv[1]), argv[2]
    try:
        print("ok " + check(source, ir_dir, weight_format), flush=True)
    except IRMismatch as exc:
        print(str(exc), flush=True)
        return MISMATCH
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
