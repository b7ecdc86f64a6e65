"""``ts.metrics.dimension``: the ``Dimension`` handlers pass to ``context.metrics``."""

from inference_service.handler.metrics import Dimension

__all__ = ["Dimension"]
