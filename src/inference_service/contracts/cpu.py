"""The CPUs a process can count on, the default intra-op threads of a worker, and the CPU
settings the server checks at registration and the worker applies (docs/configuration.md).

Read by the server and by the worker, so it lives below both. Nothing here imports torch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Accepted wait policies: OpenMP's ``OMP_WAIT_POLICY`` values, and ``bounded`` (no
#: ``OMP_WAIT_POLICY``; threads spin ``GOMP_SPINCOUNT`` = ``omp_spin_count`` times, then sleep).
WAIT_POLICIES = ("passive", "active", "bounded")
#: ``GOMP_SPINCOUNT`` of the ``bounded`` policy by default (libgomp's own default is 300,000).
DEFAULT_SPIN_COUNT = 10000
#: The server's default wait policy of a worker (``config.properties`` ``worker_omp_wait_policy``).
DEFAULT_WAIT_POLICY = "passive"

#: The highest CPU number Linux can have (``NR_CPUS`` is at most 8192).
MAX_CPU = 8191

_CGROUP = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = _CGROUP) -> float | None:
    """This cgroup's CPU quota in CPUs (``2.5`` = 250 ms per 100 ms), or ``None``: v2 ``cpu.max``, else
    v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; a missing or unreadable file is no quota."""
    try:
        quota, _, period = (root / "cpu.max").read_text().partition(" ")
        if quota.strip() != "max":
            return int(quota) / int(period)
        return None
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def usable_cpus(root: Path = _CGROUP) -> float:
    """CPUs this process can count on: the smaller of its affinity mask's size and its cgroup
    quota (:func:`cgroup_cpu_limit`); at least 1."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit(root)
    cpus = float(affinity) if limit is None else min(float(affinity), limit)
    return max(1.0, cpus)


def default_threads(workers: int, root: Path = _CGROUP) -> int:
    """Intra-op threads per worker when none is configured: ``floor(usable CPUs / workers)``,
    at least 1 (2 workers under ``limits.cpu: 3`` get 1 thread each)."""
    return max(1, math.floor(usable_cpus(root) / max(1, workers)))


def parse_affinity(value: Any, highest: int | None = None) -> set[int] | None:
    """``cpu_affinity``: a list of CPU numbers or a string such as ``"0-3,6"`` (``None`` / ``""``: unset).
    ``highest`` is checked before a range is expanded, so ``"0-3000000"`` costs nothing.

    Raises:
        ValueError: malformed, or a CPU above ``highest`` (quotes at most 60 characters).
    """
    if value is None or value == "":
        return None
    highest = MAX_CPU if highest is None else highest
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:60] + "..."
    cpus: set[int] = set()
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        if any(v > highest for v in value):
            raise ValueError(f"handler config: 'cpu_affinity' must name CPUs from 0 to {highest}, got {shown}")
        cpus.update(value)
    elif isinstance(value, str) and len(value) <= 4096:
        try:
            for part in value.split(","):
                first, dash, last = part.strip().partition("-")
                low, high = int(first), int(last if dash else first)
                if low < 0 or high < low:
                    raise ValueError(part)
                if high > highest:
                    raise ValueError(
                        f"handler config: 'cpu_affinity' must name CPUs from 0 to {highest}, got {shown}")
                cpus.update(range(low, high + 1))
        except ValueError as exc:
            if str(exc).startswith("handler config"):
                raise
            raise ValueError(f"handler config: 'cpu_affinity' must look like \"0-3,6\", got {shown}") from None
    else:
        raise ValueError(f"handler config: 'cpu_affinity' must be a list of CPU numbers or \"0-3,6\", got {shown}")
    if not cpus:
        raise ValueError("handler config: 'cpu_affinity' names no CPU")
    return cpus


def positive_int(config: Mapping[str, Any], key: str, default: int | None = None) -> int | None:
    """A ``handler:`` section count (``torch_threads``, ``max_num_batched_tokens``, ...), ``default``
    when absent; ValueError naming the key when it is not a positive integer."""
    value = config.get(key, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"handler config: {key!r} must be a positive integer, got {value!r}")
    return value
