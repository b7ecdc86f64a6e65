"""Statistics, declared once: engine statistics as dataclasses (vLLM's ``SchedulerStats`` and
``IterationStats``) and one model version's serving state (:class:`VersionStats`).

METRIC frames, the ``inference_service_llm_*`` families and the log metrics line are all derived
from the fields (:func:`stat`): a new statistic is one field here. See docs/observability.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

#: Name prefix of an engine statistic in a worker's ``METRIC`` frame (``serving:<field>``).
SERVING_PREFIX = "serving:"
#: ``counter``: an increment (what one step added); ``total``: a monotonic total the engine
#: keeps (the worker sends its increments); ``gauge``: the engine's current value.
StatKind = Literal["counter", "total", "gauge"]


@dataclass(frozen=True, slots=True)
class StatSpec:
    """One statistic as every consumer reads it: METRIC-frame name ``serving:<name>``; Prometheus
    family ``inference_service_llm_<family>`` (``_total`` added for a counter or total)."""

    name: str
    kind: StatKind
    family: str
    help: str

    @property
    def counter(self) -> bool:
        """Exported as a Prometheus counter (``counter`` and ``total``)."""
        return self.kind != "gauge"


def stat(kind: StatKind, family: str, help: str) -> Any:  # noqa: A002 - Prometheus' word
    """Declare a statistic field (default 0)."""
    return field(default=0, metadata={"stat": (kind, family, help)})


@dataclass(slots=True)
class SchedulerStats:
    """An engine's state at one instant (what ``engine.stats()`` returns)."""

    running: int = stat("gauge", "num_requests_running",
                        "LLM: requests in the workers' engines holding a KV cache row.")
    waiting: int = stat("gauge", "num_requests_waiting",
                        "LLM: requests in the workers' engines waiting for their prefill (new or preempted).")
    preempted_total: int = stat("total", "num_preemptions",
                                "LLM: requests whose KV cache was dropped to be recomputed (preemption).")
    kv_cache_used_tokens: int = stat("gauge", "kv_cache_used_tokens",
                                     "LLM: token positions the workers' KV caches hold.")
    kv_cache_allocated_tokens: int = stat("gauge", "kv_cache_allocated_tokens",
                                          "LLM: token positions the workers' KV caches take, padding included.")
    kv_cache_capacity_tokens: int = stat("gauge", "kv_cache_capacity_tokens",
                                         "LLM: the most token positions the workers' KV caches may hold.")
    prefix_cache_queries_total: int = stat("total", "prefix_cache_queries",
                                           "LLM: prompt tokens looked up in the prefix cache (each request's "
                                           "prompt, once).")
    prefix_cache_hits_total: int = stat("total", "prefix_cache_hits",
                                        "LLM: prompt tokens found in the prefix cache (not computed again).")


@dataclass(slots=True)
class IterationStats:
    """What engine steps added since the last report (increments)."""

    prompt_tokens: int = stat("counter", "prompt_tokens",
                              "LLM: prompt tokens, counted when a request's first token is sampled "
                              "(or when it is cancelled before).")
    generation_tokens: int = stat("counter", "generation_tokens",
                                  "LLM: tokens generated, counted at each engine step.")


#: The kinds of engine statistics a worker reports.
STAT_TYPES: tuple[type, ...] = (SchedulerStats, IterationStats)


def specs(types: Iterable[type] = STAT_TYPES) -> dict[str, StatSpec]:
    """Every statistic of ``types`` by field name, in declaration order."""
    out: dict[str, StatSpec] = {}
    for cls in types:
        for f in fields(cls):
            kind, family, help_text = f.metadata["stat"]
            out[f.name] = StatSpec(f.name, kind, family, help_text)
    return out


def stat_values(stats: Any) -> list[tuple[StatSpec, float]]:
    """``(spec, value)`` of every field of an engine statistic instance."""
    return [(StatSpec(f.name, *f.metadata["stat"]), float(getattr(stats, f.name))) for f in fields(stats)]


@dataclass(frozen=True, slots=True)
class VersionStats:
    """One model version's serving state at one instant (``InferenceCore.stats()``, read at scrape
    time). ``workers`` counts every DescribeModel state (zeros too); ``restarts`` is monotonic across
    scale-downs; ``worker_pids`` keys a worker's forwarded gauges (a gone worker's are left out);
    ``state``: READY, SLEEPING or WAKING; ``wakes``, ``wake_seconds`` and ``woken_requests`` are
    monotonic; ``rss_bytes`` and ``threads`` sum its worker processes and their descendants."""

    model_name: str
    model_version: str
    queue_depth: int
    workers: Mapping[str, int]
    restarts: int
    worker_pids: frozenset[int] = frozenset()
    state: str = "READY"
    wakes: int = 0
    wake_seconds: float = 0.0
    woken_requests: int = 0
    rss_bytes: int = 0
    threads: int = 0
