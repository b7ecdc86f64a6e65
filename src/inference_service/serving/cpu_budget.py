"""The warning when the workers of all models ask for more threads than the machine has CPUs.

Each model's default is ``floor(usable CPUs / its own workers)``, so two one-worker models on
2 CPUs get 4 threads in all, which wait for each other at every operator. Counted: the workers
that are ready and whose handler loaded a library with a thread pool (worker/main.py,
``THREADED_LIBRARIES``). The server warns once, again only after the sum has fit, and
``--start`` repeats it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from inference_service.contracts.cpu import usable_cpus
from inference_service.serving.registration import ModelEntry

log = logging.getLogger("inference_service.serving.cpu_budget")
#: The words ``--start`` looks for in the log to repeat the warning (launch/launcher.py).
MARK = "usable CPUs: they slow each other down"


class CpuBudget:
    """Warns when the running workers' threads exceed the usable CPUs (once per new total)."""

    def __init__(self) -> None:
        self._total = 0  # the sum at the last check
        self._warned = False  # since the sum last fit

    def check(self, models: Mapping[str, ModelEntry]) -> None:
        """Sum workers x threads over every registered version; warn when above the CPUs (called
        at each worker state change: nothing more is done while the sum stays the same)."""
        parts, total = [], 0
        for name, entry in sorted(models.items()):
            for version in entry.versions.values():
                workers, threads = version.cpu_demand()
                if workers:
                    parts.append(f"{name} {workers}x{threads}")
                    total += workers * threads
        if total == self._total:
            return
        self._total = total
        cpus = usable_cpus()
        if total <= cpus:
            self._warned = False
        elif not self._warned:
            self._warned = True
            log.warning("workers x threads = %d (%s) exceeds the %g %s; set worker_threads "
                        "(--worker-threads) or the handler's torch_threads so that the sum fits",
                        total, ", ".join(parts), cpus, MARK)
