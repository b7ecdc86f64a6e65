"""Choosing the next token: greedy, or temperature / top-k / top-p sampling with a seeded
generator, after the repetition, presence and frequency penalties.

:func:`make_generator` makes the per-request CPU ``torch.Generator``; :func:`penalize` applies
the penalties to one row of logits; :func:`sample_next_token` picks one token id from it.

torch is imported inside the functions; this module imports without it.
"""

from __future__ import annotations

import secrets
from typing import Any

from inference_service.llm.engine_protocol import SampledLogprob


def make_generator(seed: int | None) -> Any:
    """Return a CPU ``torch.Generator`` seeded with ``seed`` (a random seed if ``None``)."""
    import torch

    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator


def needs_logit_processing(params: Any) -> bool:
    """Whether a request's sampling options go beyond temperature and top-p (top-k, penalties)."""
    return bool(getattr(params, "top_k", 0) or getattr(params, "repetition_penalty", 1.0) != 1.0
                or getattr(params, "presence_penalty", 0.0) or getattr(params, "frequency_penalty", 0.0))


def penalize(logits: Any, params: Any, prompt_ids: list[int], generated_ids: list[int]) -> Any:
    """One row of logits ``[vocab]`` after the penalties (a new tensor).

    ``repetition_penalty`` (as transformers' and OpenVINO GenAI's): the logit of every token of
    the prompt and the generated text is divided by it where positive, multiplied where
    negative. ``presence_penalty`` and ``frequency_penalty`` (as OpenAI's and vLLM's, over the
    generated tokens only): minus ``presence`` for a token generated at least once, minus
    ``frequency`` times its count.
    """
    import torch

    row = logits.float().clone()
    repetition = getattr(params, "repetition_penalty", 1.0)
    if repetition != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(generated_ids)), dtype=torch.long)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / repetition, values * repetition)
    presence, frequency = getattr(params, "presence_penalty", 0.0), getattr(params, "frequency_penalty", 0.0)
    if (presence or frequency) and generated_ids:
        ids, counts = torch.unique(torch.tensor(generated_ids, dtype=torch.long), return_counts=True)
        row[ids] -= presence + frequency * counts.float()
    return row


def sample_next_token(logits: Any, temperature: float, top_p: float, generator: Any | None = None,
                      top_k: int = 0) -> int:
    """Choose the next token id from one row of logits.

    Args:
        logits: float tensor of shape ``[vocab]`` (unnormalized scores).
        temperature: 0 -> greedy (``argmax``); otherwise logits are divided by it.
        top_k: keep the ``top_k`` most likely tokens first (0: all).
        top_p: keep the smallest set of most likely tokens whose probability
            mass reaches ``top_p`` (at least one token), renormalize, sample.
        generator: CPU ``torch.Generator`` used for sampling (ignored when greedy).

    Returns:
        The chosen token id.
    """
    import torch

    if temperature <= 0.0:
        return int(torch.argmax(logits).item())
    if 0 < top_k < logits.shape[-1]:
        cut = torch.topk(logits, top_k).values[-1]
        logits = torch.where(logits < cut, torch.full_like(logits, float("-inf")), logits)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, sorted_ids = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep tokens whose preceding mass is < top_p (so the first one is always kept)
        keep = (cumulative - sorted_probs) < top_p
        kept_probs = sorted_probs[keep]
        choice = torch.multinomial(kept_probs / kept_probs.sum(), 1, generator=generator)
        return int(sorted_ids[keep][choice].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sampled_logprob(logits: Any, token: int, top: int) -> SampledLogprob:
    """``token``'s log probability in one row of raw logits ``[vocab]`` (the model's distribution,
    before penalties and temperature, as vLLM's default) and the ``top`` most likely tokens."""
    import torch

    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
        best = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return SampledLogprob(token, float(logprobs[token]), best)
