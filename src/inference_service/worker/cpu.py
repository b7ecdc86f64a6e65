"""CPU budget of a worker: the cores it may use, its intra-op threads and their wait policy.

A descheduled intra-op thread makes the others wait at every operator, and with OpenMP's active
wait they spin on the cores it needs (8 streams fell from 65 to 2 tokens/s with one core of two
busy; ``benchmarks/RESULTS.md``). So: threads no more than :func:`usable_cpus` (affinity mask and
cgroup quota), ``OMP_WAIT_POLICY=PASSIVE`` set before torch is first imported
(:func:`apply_cpu_settings`), optional ``cpu_affinity``. Nothing here imports torch.
See docs/configuration.md.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from inference_service.contracts.cpu import (
    DEFAULT_SPIN_COUNT,
    DEFAULT_WAIT_POLICY,
    MAX_CPU,
    WAIT_POLICIES,
    cgroup_cpu_limit,
    default_threads,
    parse_affinity,
    usable_cpus,
)
from inference_service.contracts.handler_config import HandlerConfig

__all__ = [
    "DEFAULT_SPIN_COUNT", "DEFAULT_WAIT_POLICY", "MAX_CPU", "WAIT_POLICIES", "apply_cpu_settings",
    "cgroup_cpu_limit", "default_threads", "parse_affinity", "usable_cpus",
]

log = logging.getLogger(__name__)


def apply_cpu_settings(handler_config: HandlerConfig, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Apply a model's ``handler`` CPU keys to this worker process, before torch is imported, and
    return ``{"threads", "wait_policy", "affinity"}`` as applied. ``torch_threads`` defaults to the
    inherited ``OMP_NUM_THREADS`` (set by the server) and is capped at the CPUs of ``cpu_affinity``;
    ``omp_wait_policy`` to the inherited ``OMP_WAIT_POLICY``, else ``passive``.

    Raises:
        ValueError: a malformed value, or ``cpu_affinity`` naming CPUs this process may not use.
    """
    env = os.environ if environ is None else environ
    affinity = parse_affinity(handler_config.cpu_affinity)
    if affinity is not None:
        allowed = os.sched_getaffinity(0)
        if not affinity <= allowed:
            raise ValueError(
                f"handler config: 'cpu_affinity' names CPUs {sorted(affinity - allowed)} outside this "
                f"worker's allowed CPUs {sorted(allowed)}"
            )
        os.sched_setaffinity(0, affinity)
    threads = handler_config.torch_threads
    if threads is not None and threads > (cap := math.floor(usable_cpus())):
        log.warning("handler config: torch_threads %d is more than the %d usable CPUs; using %d",
                    threads, cap, cap)
        threads = cap
    if threads is None:
        try:
            threads = max(1, int(env.get("OMP_NUM_THREADS", "")))
        except ValueError:
            threads = default_threads(1)
    if affinity is not None:
        threads = min(threads, len(affinity))
    policy = handler_config.omp_wait_policy
    if policy is None:
        policy = env.get("OMP_WAIT_POLICY") or DEFAULT_WAIT_POLICY
    if policy.lower() not in WAIT_POLICIES:
        raise ValueError(f"OMP_WAIT_POLICY must be one of {WAIT_POLICIES}, got {policy!r}")
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    if policy.lower() == "bounded":
        spins = handler_config.omp_spin_count
        env.pop("OMP_WAIT_POLICY", None)
        env["GOMP_SPINCOUNT"] = str(spins)
    else:
        env["OMP_WAIT_POLICY"] = policy.upper()
    return {"threads": threads, "wait_policy": policy.lower(),
            "affinity": sorted(affinity) if affinity is not None else None}
