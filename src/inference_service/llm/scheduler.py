"""The continuous-batching scheduler: who decodes, which prompt chunks prefill, who is paused or
preempted in one engine step (the shape of vLLM v1's ``Scheduler.schedule() -> SchedulerOutput``).

The scheduler holds no tensors and imports no torch; it counts tokens. Each request it knows
is in one of four states (:data:`WAITING`, :data:`PREFILLING`, :data:`RUNNING`,
:data:`PREEMPTED`), with ``num_tokens`` (prompt plus generated tokens the KV cache must hold
before the request samples its next token) and ``num_computed`` (tokens whose keys/values the
cache holds now). :meth:`Scheduler.schedule` plans one step under a token budget
(``max_num_batched_tokens``, vLLM's name):

1. **decode**: every :data:`RUNNING` request of the step's ``active`` set feeds one token;
   each counts one token of the budget. Running requests outside ``active`` are *paused*:
   they keep their KV cache and produce nothing.
2. **prefill**: what is left of the budget goes to prompt chunks, oldest first: requests
   already part-way through their prefill (:data:`PREFILLING`), then preempted requests
   (their prompt *and* generated tokens are recomputed, vLLM's recompute preemption), then
   new ones (:data:`WAITING`), at most ``max_prefill_seqs`` of them per step. A chunk that
   reaches the end of a request's tokens samples its next token (``PrefillChunk.last``); a
   long prompt is spread over as many steps as the budget needs, so the running requests
   get a token every step.

:meth:`Scheduler.preempt` marks a request for preemption (e.g. its client stopped reading):
the next plan lists it in ``preempted`` (the runner drops its KV cache) and it waits until
it is active again. :meth:`Scheduler.update` applies what a step did (tokens computed,
tokens sampled, requests finished) once it succeeded; a failed step leaves the scheduler as
it was.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

__all__ = ["PREEMPTED", "PREFILLING", "RUNNING", "WAITING", "PrefillChunk", "Scheduler", "SchedulerOutput"]

#: Added, nothing computed yet.
WAITING = "waiting"
#: Part of its tokens are in a KV cache of its own; more chunks to come.
PREFILLING = "prefilling"
#: All its tokens but the last sampled one are in the shared KV cache: it decodes.
RUNNING = "running"
#: Its KV cache was dropped; its prompt and generated tokens are recomputed when it is active.
PREEMPTED = "preempted"


@dataclass(frozen=True)
class PrefillChunk:
    """Tokens ``[start, end)`` of a request's sequence (prompt, then generated tokens) to
    compute in this step; ``last``: the chunk ends the sequence, sample the next token."""

    key: str
    start: int
    end: int
    last: bool


@dataclass
class SchedulerOutput:
    """The plan of one step.

    Attributes:
        decode: requests that feed their last sampled token (one row each), in the order the
            scheduler admitted them.
        prefill: prompt chunks to compute, at most one per request.
        preempted: requests whose KV cache the runner drops before the step.
        paused: running requests left out of the step (not active): they keep their cache.
        num_batched_tokens: ``len(decode)`` plus the chunks' tokens.
    """

    decode: list[str] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    paused: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def empty(self) -> bool:
        """Nothing to run (there may still be KV caches to drop)."""
        return not self.decode and not self.prefill


@dataclass
class _Entry:
    key: str
    num_tokens: int
    status: str = WAITING
    num_computed: int = 0
    order: int = 0  # when it entered its current queue (prefill candidates are taken oldest first)


class Scheduler:
    """Plan engine steps for the requests of one engine (see the module docstring).

    Args:
        max_num_batched_tokens: most tokens (decode rows plus prompt-chunk tokens) in one
            step; ``None``: no bound (whole prompts prefill in one step).
        max_prefill_seqs: most requests with a prompt chunk in one step; ``None``: no bound.

    Raises:
        ValueError: a bound below 1.
    """

    def __init__(self, max_num_batched_tokens: int | None = None, max_prefill_seqs: int | None = None) -> None:
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {max_num_batched_tokens}")
        if max_prefill_seqs is not None and max_prefill_seqs < 1:
            raise ValueError(f"max_prefill_seqs must be at least 1, got {max_prefill_seqs}")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_seqs = max_prefill_seqs
        self._entries: dict[str, _Entry] = {}
        self._clock = 0
        self._to_drop: list[str] = []  # preempted since the last plan: their caches go at the next step
        self.preempted_total = 0

    # --- the requests ------------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def status(self, key: str) -> str | None:
        """The request's state, ``None`` when unknown."""
        entry = self._entries.get(key)
        return entry.status if entry is not None else None

    def num_computed(self, key: str) -> int:
        """Tokens of the request whose keys/values are cached (0 when unknown)."""
        entry = self._entries.get(key)
        return entry.num_computed if entry is not None else 0

    def keys(self, *statuses: str) -> list[str]:
        """The requests in one of ``statuses`` (all when none given), oldest first."""
        entries = [e for e in self._entries.values() if not statuses or e.status in statuses]
        return [e.key for e in sorted(entries, key=lambda e: e.order)]

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def add(self, key: str, num_tokens: int) -> None:
        """A new request of ``num_tokens`` prompt tokens (>= 1) waits for its prefill.

        Raises:
            ValueError: ``key`` is known or ``num_tokens`` < 1.
        """
        if key in self._entries:
            raise ValueError(f"request {key!r} is already scheduled")
        if num_tokens < 1:
            raise ValueError("a request needs at least one prompt token")
        self._entries[key] = _Entry(key, num_tokens, order=self._tick())

    def remove(self, key: str) -> bool:
        """Forget a request (finished or cancelled); False when unknown."""
        return self._entries.pop(key, None) is not None

    def preempt(self, key: str) -> bool:
        """Drop the request's KV cache at the next step (its tokens are recomputed when it is
        active again). False when the request holds no cache (unknown, waiting, preempted)."""
        entry = self._entries.get(key)
        if entry is None or entry.status not in (RUNNING, PREFILLING):
            return False
        entry.status = PREEMPTED
        entry.num_computed = 0
        entry.order = self._tick()  # behind the requests already preempted, ahead of new ones
        self._to_drop.append(key)
        self.preempted_total += 1
        return True

    # --- one step ----------------------------------------------------------------------
    def schedule(self, active: Collection[str] | None = None) -> SchedulerOutput:
        """Plan the next step over the ``active`` requests (``None``: all); see the module
        docstring for the rules. Does not change any request's state (see :meth:`update`),
        except that the caches of requests preempted since the last plan are handed over."""
        selected = None if active is None else set(active)
        out = SchedulerOutput(preempted=self._to_drop)
        self._to_drop = []
        entries = sorted(self._entries.values(), key=lambda e: e.order)
        for entry in entries:
            if entry.status == RUNNING:
                (out.decode if selected is None or entry.key in selected else out.paused).append(entry.key)
        budget = None if self.max_num_batched_tokens is None else self.max_num_batched_tokens - len(out.decode)
        out.num_batched_tokens = len(out.decode)
        rank = {PREFILLING: 0, PREEMPTED: 1, WAITING: 2}
        candidates = sorted(
            (e for e in entries if e.status in rank and (selected is None or e.key in selected)),
            key=lambda e: (rank[e.status], e.order),
        )
        for entry in candidates:
            if budget is not None and budget <= 0:
                break
            if self.max_prefill_seqs is not None and len(out.prefill) >= self.max_prefill_seqs:
                break
            remaining = entry.num_tokens - entry.num_computed
            size = remaining if budget is None else min(remaining, budget)
            end = entry.num_computed + size
            out.prefill.append(PrefillChunk(entry.key, entry.num_computed, end, end == entry.num_tokens))
            out.num_batched_tokens += size
            if budget is not None:
                budget -= size
        return out

    def update(self, out: SchedulerOutput, finished: Iterable[str] = ()) -> None:
        """Apply a step that ran: decoded requests and last chunks sampled one token each,
        chunks are computed; ``finished`` requests leave."""
        for key in finished:
            self._entries.pop(key, None)
        for key in out.decode:
            entry = self._entries.get(key)
            if entry is not None:
                entry.num_computed += 1
                entry.num_tokens += 1
        for chunk in out.prefill:
            entry = self._entries.get(chunk.key)
            if entry is None:
                continue
            entry.num_computed = chunk.end
            if chunk.last:
                entry.status = RUNNING
                entry.num_tokens += 1
            elif entry.status != PREFILLING:
                entry.status = PREFILLING
