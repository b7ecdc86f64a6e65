"""The handler API: what handler code sees inside a worker process (TorchServe's, plus :class:`RequestCancelled`)."""

from inference_service.handler.base_handler import BaseHandler
from inference_service.handler.context import Context, RequestProcessor
from inference_service.handler.encoding import encode_response
from inference_service.handler.metrics import Metrics
from inference_service.handler.streaming import RequestCancelled, send_intermediate_predict_response
from inference_service.handler.util import PredictionException

__all__ = [
    "BaseHandler",
    "Context",
    "Metrics",
    "PredictionException",
    "RequestCancelled",
    "RequestProcessor",
    "encode_response",
    "send_intermediate_predict_response",
]
