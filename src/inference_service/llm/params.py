"""The options of one generation and how it ended.

:class:`GenerationParams` (what a request asks for: length, sampling, stop strings) and
:class:`GenerationResult` (finish reason, token counts, the sampled ids): the plain data
shared by request parsing (:mod:`inference_service.llm.requests`), the per-request state
(:mod:`inference_service.llm.request_state`), the batched engine
(:mod:`inference_service.llm.engine`) and the one-request helpers
(:mod:`inference_service.llm.generation`). Imports nothing beyond the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GenerationParams:
    """Options of one generation.

    Attributes:
        max_new_tokens: most tokens to generate (1..4096).
        temperature: sampling temperature, 0 (greedy) to 5.
        top_p: nucleus mass in (0, 1]; 1 disables the cut.
        seed: seed of the sampling ``torch.Generator``; ``None`` draws a random one.
        stop: stop strings; generation ends when the text contains one, which
            is not emitted.
        ignore_eos: if true, the end-of-sequence token does not end generation.
        include_usage: if true, the handler's final message is a JSON object
            with finish reason and token counts.
        top_k: sample among the ``top_k`` most likely tokens (0: all).
        repetition_penalty: > 1 discourages tokens of the prompt and output (1: off).
        presence_penalty, frequency_penalty: subtracted from the logit of a token already
            generated, once / per occurrence (0: off).
        stop_token_ids: token ids that end generation (finish reason ``stop``; the token is
            counted, not emitted), even with ``ignore_eos``.
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    include_usage: bool = False
    top_k: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class GenerationResult:
    """How a generation ended (:attr:`~inference_service.llm.engine.StepOutput.result`; the
    return value of :func:`~inference_service.llm.generation.generate_pieces`).

    Attributes:
        remaining_text: text released only at the end (a held-back tail that
            turned out not to be a stop string, or an incomplete character);
            not yielded as a piece. May be empty.
        finish_reason: ``"stop"`` (end-of-sequence token or stop string),
            ``"length"`` (``max_new_tokens`` reached) or ``"cancelled"``
            (``should_stop`` returned true).
        prompt_tokens: number of prompt tokens.
        completion_tokens: number of tokens sampled (an end-of-sequence token
            that ended generation counts).
        token_ids: the sampled token ids, in order (including such an
            end-of-sequence token).
        stop_string: the stop string that ended generation, if any.
    """

    remaining_text: str = ""
    finish_reason: str = "length"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    stop_string: str | None = None
