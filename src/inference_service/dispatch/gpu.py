"""GPU placement of workers: how many GPUs the machine has and which one a new worker gets."""

from __future__ import annotations

import itertools


class GpuAllocator:
    """Hands out GPU ids round-robin across all workers of the server, as TorchServe (``count`` 0: all on CPU)."""

    def __init__(self, count: int) -> None:
        self.count = max(0, count)
        self._next = itertools.count()

    def next(self) -> int | None:
        """The next GPU id, or ``None`` without GPUs."""
        return next(self._next) % self.count if self.count else None


def detect_gpus() -> int:
    """Number of NVIDIA GPUs from ``nvidia-smi --list-gpus`` (0 when it is missing or fails)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
