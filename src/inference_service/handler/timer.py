"""``timed``: per-stage handler timings, as TorchServe's ``ts.handler_utils.timer.timed``."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def timed(func: F) -> F:
    """Decorate a handler method to record its duration as the metric ``ts_handler_<name>`` (ms).

    As TorchServe's: it measures only when the model's ``model-config.yaml``
    says ``handler: {profile: true}`` (read from ``self.context.model_yaml_config``);
    otherwise the method runs untimed. The metric goes through
    ``self.context.metrics.add_time`` (logged by the worker). On CUDA the
    measured interval ends after ``torch.cuda.synchronize()``, so it covers the
    queued GPU work.
    """

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
