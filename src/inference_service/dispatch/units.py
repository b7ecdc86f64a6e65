"""The shared jobs of a concurrent job queue taken in turn by unit of fairness: a client request,
whose engine requests (an OpenAI request's choices) share one unit."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar


class Unit(Protocol):
    """A job as the turns see it."""

    @property
    def unit(self) -> str:
        """Its unit of fairness."""

    @property
    def priority(self) -> int:
        """Lower first (0: the default)."""


J = TypeVar("J", bound=Unit)


class UnitQueue(Generic[J]):
    """The shared jobs of a concurrent queue by unit, taken in turn: one job of the first unit,
    which then goes to the back. ``len`` counts units: a unit's jobs hold one place of
    ``job_queue_size``, as the client request they are."""

    __slots__ = ("_units", "_ranked")

    def __init__(self) -> None:
        self._units: dict[str, deque[J]] = {}  # in turn order: by priority of their first job, then turn
        self._ranked = 0  # jobs of a priority other than 0 waiting (none: the turn is plain order)

    def __len__(self) -> int:
        return len(self._units)

    def __contains__(self, unit: str) -> bool:
        return unit in self._units

    def append(self, job: J) -> None:
        """Queue ``job`` behind its unit's others (a new unit goes to the back of its priority's turn)."""
        self._ranked += job.priority != 0
        queue = self._units.get(job.unit)
        if queue is not None:
            queue.append(job)
        else:
            self._place(job.unit, deque([job]))

    def _place(self, unit: str, queue: deque[J]) -> None:
        """Put ``unit`` at the back of the turn of its first job's priority."""
        if not self._ranked:
            self._units[unit] = queue
            return
        items = list(self._units.items())
        at = next((i for i, (_, q) in enumerate(items) if q[0].priority > queue[0].priority), len(items))
        items.insert(at, (unit, queue))
        self._units = dict(items)

    def extendleft(self, jobs: Iterable[J]) -> None:
        """Put ``jobs`` back in front (``deque.extendleft``'s order), their units first in turn."""
        for job in jobs:
            self._ranked += job.priority != 0
            queue = self._units.pop(job.unit, None) or deque()
            queue.appendleft(job)
            self._units = {job.unit: queue, **self._units}

    def popleft(self, allowed: Callable[[str], bool] | None = None) -> J:
        """The first job of the first unit in turn (that ``allowed`` accepts); IndexError if none."""
        for unit in self._units:
            if allowed is None or allowed(unit):
                queue = self._units.pop(unit)
                job = queue.popleft()
                self._ranked -= job.priority != 0
                if queue:
                    self._place(unit, queue)
                return job
        raise IndexError("no job")
