"""``timed``: per-stage handler timings, as TorchServe's ``ts.handler_utils.timer.timed``."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def timed(func: F) -> F:
    """Record a handler method's duration as ``ts_handler_<name>`` (ms), as TorchServe's: only with
    ``handler: {profile: true}``; on CUDA after ``torch.cuda.synchronize()`` (queued GPU work)."""

    @functools.wraps(func)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        context = getattr(self, "context", None)
        config = getattr(context, "model_yaml_config", None) or {}
        handler_config = config.get("handler") if isinstance(config, dict) else None
        if context is None or not (isinstance(handler_config, dict) and handler_config.get("profile")):
            return func(self, *args, **kwargs)
        start = time.perf_counter()
        result = func(self, *args, **kwargs)
        device = getattr(self, "device", None)
        if getattr(device, "type", None) == "cuda":
            import torch

            torch.cuda.synchronize(device)
        duration_ms = (time.perf_counter() - start) * 1000.0
        context.metrics.add_time(f"ts_handler_{func.__name__}", round(duration_ms, 3), None, "ms")
        return result

    return wrapper  # type: ignore[return-value]
