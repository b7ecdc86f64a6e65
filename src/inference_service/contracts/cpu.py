"""The CPUs a process can count on, and the default intra-op threads of a worker from them.

Read by the server (the threads it gives each worker) and by the worker (its own default), so
it lives below both; docs/configuration.md explains the settings. Nothing here imports torch.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

_CGROUP = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = _CGROUP) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (``2.5`` = 250 ms per 100 ms), or ``None``.

    Reads cgroup v2 ``<root>/cpu.max`` (``"max 100000"`` = no quota), else cgroup v1
    ``<root>/cpu/cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (quota ``-1`` = none). A file that
    is missing or unreadable counts as no quota.
    """
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
