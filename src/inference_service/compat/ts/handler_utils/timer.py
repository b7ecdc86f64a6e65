"""``ts.handler_utils.timer``: the ``timed`` decorator for handler stages."""

from inference_service.handler.timer import timed

__all__ = ["timed"]
