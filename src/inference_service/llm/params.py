"""The options of one generation and how it ended.

:class:`GenerationParams` (what a request asks for; declared in
:mod:`inference_service.contracts.sampling`, re-exported here) and :class:`GenerationResult`
(finish reason, token counts, the sampled ids), shared by the per-request state, the engine
and the one-request helpers. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inference_service.contracts.sampling import GenerationParams, SamplingParams

__all__ = ["GenerationParams", "GenerationResult", "SamplingParams"]


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
