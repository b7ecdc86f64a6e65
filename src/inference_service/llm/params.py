"""The options of one generation (:class:`GenerationParams`, re-exported from
:mod:`inference_service.contracts.sampling`) and how it ended (:class:`GenerationResult`). No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from inference_service.contracts.sampling import GenerationParams, SamplingParams

__all__ = ["GenerationParams", "GenerationResult", "SamplingParams"]


@dataclass
class GenerationResult:
    """How a generation ended (:attr:`~inference_service.llm.engine.StepOutput.result`).
    ``remaining_text`` is released only at the end (a held-back tail that was no stop string, or an
    incomplete character); ``completion_tokens`` and ``token_ids`` include an end-of-sequence token
    that ended it."""

    remaining_text: str = ""
    finish_reason: str = "length"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    stop_string: str | None = None
