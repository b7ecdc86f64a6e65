"""What a worker process costs, read from Linux's ``/proc``: resident memory and threads of the
process and its descendants (the ranks of a torchrun worker, a handler's own subprocesses)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class Usage:
    """``rss_bytes``: VmRSS summed over the processes; ``threads``: their threads; ``processes``:
    how many were read (0: the process is gone, or no ``/proc``)."""

    rss_bytes: int = 0
    threads: int = 0
    processes: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.rss_bytes + other.rss_bytes, self.threads + other.threads,
                     self.processes + other.processes)


def _status(pid: int, proc: Path) -> Usage:
    try:
        text = (proc / str(pid) / "status").read_text()
    except OSError:
        return Usage()
    rss = threads = 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "VmRSS":  # "12345 kB"; absent for a zombie
            rss = int(value.split()[0]) * 1024
        elif key == "Threads":
            threads = int(value)
    return Usage(rss, threads, 1)


def _children(pid: int, proc: Path) -> list[int]:
    found: list[int] = []
    try:
        tasks = list((proc / str(pid) / "task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            found.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError):
            continue
    return found


def process_tree_usage(pid: int | None, proc: Path = PROC) -> Usage:
    """The :class:`Usage` of ``pid`` and its descendants (``None`` or gone: zeros)."""
    total = Usage()
    if pid is None:
        return total
    seen: set[int] = set()
    todo = [pid]
    while todo and len(seen) < 1024:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        usage = _status(current, proc)
        if usage.processes:
            total = total + usage
            todo.extend(_children(current, proc))
    return total
