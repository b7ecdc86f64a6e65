"""llm_concurrency.py's load plan and figures: the scenarios (N streams arriving together or
staggered), the request body and the figures of one scenario from per-request records."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from common import BENCH, percentile

PROMPTS_FILE = BENCH / "prompts_concurrency.json"
MODEL = "smollm2"
#: Continuous-batching settings of the served archive (issue 13).
CB_CONFIG = {"continuousBatching": True, "batchSize": 8, "maxBatchDelay": 0}
#: transformers' ContinuousBatchingConfig for ``hf_cb``: a cache sized for 8 requests of
#: < 256 tokens (pages of 256 tokens); left to its defaults it reserves 60 % of the RAM (5.6 GB here).
HF_CB_CONFIG = {"num_blocks": 24, "max_batch_tokens": 512}


@dataclass
class Scenario:
    """One load: ``n`` requests; ``offsets[i]`` = seconds after the start at which request i is sent."""

    arrival: str
    n: int
    offsets: list[float]
    prompts: list[str]

    @property
    def key(self) -> str:
        """``together/8``-style identifier."""
        return f"{self.arrival}/{self.n}"


def load_prompts() -> list[str]:
    """The committed prompts (30-60 tokens each with SmolLM2's tokenizer)."""
    prompts = json.loads(PROMPTS_FILE.read_text())
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise SystemExit(f"{PROMPTS_FILE}: expected a JSON list of strings")
    return prompts


def plan(concurrency: list[int], mean_gap_s: float, seed: int, prompts: list[str]) -> list[Scenario]:
    """Together scenarios for every N, then staggered ones for N > 1 (Poisson arrivals, seeded per N)."""
    if max(concurrency) > len(prompts):
        raise SystemExit(f"at most {len(prompts)} concurrent streams (one distinct prompt each)")
    out = [Scenario("together", n, [0.0] * n, prompts[:n]) for n in concurrency]
    for n in concurrency:
        if n < 2:
            continue
        rng = random.Random(seed * 1000 + n)
        offsets, t = [], 0.0
        for _ in range(n):
            offsets.append(round(t, 4))
            t += rng.expovariate(1.0 / mean_gap_s)
        out.append(Scenario("staggered", n, offsets, prompts[:n]))
    return out


def request_body(prompt: str, max_new_tokens: int) -> bytes:
    """The JSON body every server-side system gets."""
    return json.dumps({"prompt": prompt, "max_new_tokens": max_new_tokens, "ignore_eos": True,
                       "include_usage": True}).encode()


def token_count(messages: list[bytes]) -> tuple[int, str]:
    """Completion tokens of one stream: ``usage.completion_tokens`` of its last message, else its message count."""
    if messages:
        try:
            last = json.loads(messages[-1])
            if isinstance(last, dict) and isinstance(last.get("usage"), dict):
                return int(last["usage"]["completion_tokens"]), "usage"
        except (ValueError, KeyError, TypeError):
            pass
    return len(messages), "messages"


def figures(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Scenario figures from per-request records ``{"sent", "times", "tokens", "error"}`` (seconds).

    Returns:
        ``agg_tokens_per_s``, ``ttft_p50_s``, ``ttft_p90_s``, ``itl_p50_ms``, ``itl_p99_ms``,
        ``tokens`` (total), ``errors`` (failed requests), ``wall_s``.
    """
    ok = [r for r in requests if r["times"]]
    errors = sum(1 for r in requests if r.get("error"))
    tokens = sum(r["tokens"] for r in requests)
    start = min((r["sent"] for r in requests), default=0.0)
    end = max((r["times"][-1] for r in ok), default=start)
    wall = end - start
    ttfts = [r["times"][0] - r["sent"] for r in ok]
    gaps = [(b - a) * 1000 for r in ok for a, b in zip(r["times"], r["times"][1:], strict=False)]

    def rnd(value: float | None, digits: int) -> float | None:
        return None if value is None else round(value, digits)

    return {
        "agg_tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "ttft_p50_s": rnd(percentile(ttfts, 50), 3), "ttft_p90_s": rnd(percentile(ttfts, 90), 3),
        "itl_p50_ms": rnd(percentile(gaps, 50), 1), "itl_p99_ms": rnd(percentile(gaps, 99), 1),
        "tokens": tokens, "errors": errors, "wall_s": round(wall, 3),
    }
