"""The state of one request inside the engine, from sampled token ids to released text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inference_service.llm.engine_protocol import SampledLogprob, StepOutput
from inference_service.llm.params import GenerationParams, GenerationResult
from inference_service.llm.sampling import make_generator
from inference_service.llm.text import IncrementalDecoder, StopStringFilter


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """The end-of-sequence token ids: the model's generation config ``eos_token_id``
    (int or list) plus the tokenizer's ``eos_token_id``."""
    ids: set[int] = set()
    for source in (
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        getattr(getattr(model, "config", None), "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return frozenset(ids)


class RequestState:
    """The state of one request: sampling, decoding, stop strings, the tokens so far."""

    __slots__ = ("key", "prompt_ids", "params", "generator", "decoder", "stop_filter", "result", "last_token",
                 "pending", "pending_logprobs", "mask")

    def __init__(self, key: str, prompt_ids: list[int], params: GenerationParams, tokenizer: Any,
                 sampler: bool = True) -> None:
        """``sampler``: make the request's own ``torch.Generator`` (the torch engine samples;
        an engine that samples itself passes False)."""
        self.key = key
        self.prompt_ids = prompt_ids
        self.params = params
        self.generator = make_generator(params.seed) if sampler and params.temperature > 0 else None
        self.pending: list[int] = []  # tokens received from an engine, not yet accepted
        self.pending_logprobs: list[float] = []  # their log probabilities (``params.logprobs``)
        self.decoder = IncrementalDecoder(tokenizer)
        self.stop_filter = StopStringFilter(params.stop)
        self.result = GenerationResult(prompt_tokens=len(prompt_ids))
        self.last_token = 0  # the token the next decode step feeds
        self.mask: Any = None  # a structured output's grammar state (llm.grammar.TokenMask), torch engine only

    def all_tokens(self) -> list[int]:
        """The prompt ids followed by the generated ids: what a recompute after preemption feeds."""
        return self.prompt_ids + self.result.token_ids

    def ends_on(self, token: int, eos: frozenset[int]) -> bool:
        """Whether ``token`` ends the request as a token (end of sequence, a stop token): it counts
        but has no text."""
        return (token in eos and not self.params.ignore_eos) or token in self.params.stop_token_ids

    def accept(self, token: int, eos: frozenset[int]) -> tuple[str, str | None]:
        """Take one sampled token: ``(released text, finish reason or None while running)``."""
        self.result.token_ids.append(token)
        if self.mask is not None:
            self.mask.accept(token)
        if self.ends_on(token, eos):
            return "", "stop"  # the end-of-sequence (or a stop) token counts but is not decoded
        piece = self.stop_filter.push(self.decoder.push(token))
        if self.stop_filter.stopped:
            return piece, "stop"
        if len(self.result.token_ids) >= self.params.max_new_tokens:
            return piece, "length"
        self.last_token = token
        return piece, None

    def finish(self, reason: str) -> GenerationResult:
        """Release the held-back tail and fill in the result (``finish_reason`` = ``reason``,
        or ``"stop"`` if the tail completes a stop string)."""
        result = self.result
        tail = ""
        if not self.stop_filter.stopped:
            tail = self.stop_filter.push(self.decoder.flush())
            tail += self.stop_filter.flush()
            if self.stop_filter.stopped:
                reason = "stop"
        result.remaining_text = tail
        result.finish_reason = reason
        result.completion_tokens = len(result.token_ids)
        result.stop_string = self.stop_filter.matched
        return result


def hand_over(state: RequestState, tokens: Sequence[int], eos: frozenset[int], logprobs: Sequence[SampledLogprob],
              engine_done: bool) -> tuple[StepOutput | None, bool]:
    """Feed the tokens an engine sampled for a request to its state (our text, stop strings and
    end-of-sequence rules), with their ``logprobs`` entries (one per token; a missing one reads 0).

    Returns:
        ``(output, stopped)``: ``output`` is ``None`` while nothing was released and the request
        goes on; ``stopped`` when one of the tokens ended it by our rules (the engine still runs it:
        abort it there). When ``engine_done`` and none did, the engine ended it by its own length or
        stop-token rule: ``length`` once ``max_new_tokens`` are generated, else ``stop``.
    """
    pieces: list[str] = []
    sampled: list[SampledLogprob] = []
    for i, token in enumerate(tokens):
        if state.params.logprobs and not state.ends_on(token, eos):
            sampled.append(logprobs[i] if i < len(logprobs) else SampledLogprob(token, 0.0))
        piece, reason = state.accept(token, eos)
        pieces.append(piece)
        if reason is not None:
            return StepOutput("".join(pieces), True, state.finish(reason), len(pieces), logprobs=sampled), True
    if engine_done:
        reason = "length" if len(state.result.token_ids) >= state.params.max_new_tokens else "stop"
        return StepOutput("".join(pieces), True, state.finish(reason), len(pieces), logprobs=sampled), False
    if not pieces:
        return None, False
    return StepOutput("".join(pieces), tokens=len(pieces), logprobs=sampled), False
