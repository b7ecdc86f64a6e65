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
    """How a generation ended (:attr:`~inference_service.llm.engine.StepOutput.result`).

    Attributes:
        remaining_text: text released only at the end (a held-back tail that was no stop string, or
            an incomplete character); not yielded as a piece.
        finish_reason: ``"stop"`` (end-of-sequence or stop string), ``"length"`` or ``"cancelled"``.
        completion_tokens: tokens sampled, an end-of-sequence token that ended it included (also in
            ``token_ids``).
    """

    remaining_text: str = ""
    finish_reason: str = "length"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    stop_string: str | None = None
