"""Choosing the next token: greedy, or temperature / top-p sampling with a seeded generator.

:func:`make_generator` makes the per-request CPU ``torch.Generator``; :func:`sample_next_token`
picks one token id from one row of logits.

torch is imported inside the functions; this module imports without it.
"""

from __future__ import annotations

import secrets
from typing import Any


def make_generator(seed: int | None) -> Any:
    """Return a CPU ``torch.Generator`` seeded with ``seed`` (a random seed if ``None``)."""
    import torch

    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator


def sample_next_token(logits: Any, temperature: float, top_p: float, generator: Any | None = None) -> int:
    """Choose the next token id from one row of logits.

    Args:
        logits: float tensor of shape ``[vocab]`` (unnormalized scores).
        temperature: 0 -> greedy (``argmax``); otherwise logits are divided by it.
        top_p: keep the smallest set of most likely tokens whose probability
            mass reaches ``top_p`` (at least one token), renormalize, sample.
        generator: CPU ``torch.Generator`` used for sampling (ignored when greedy).

    Returns:
        The chosen token id.
    """
    import torch

    if temperature <= 0.0:
        return int(torch.argmax(logits).item())
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
