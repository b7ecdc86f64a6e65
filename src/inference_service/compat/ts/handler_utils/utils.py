"""``ts.handler_utils.utils``: ``send_intermediate_predict_response`` for streaming handlers."""

from inference_service.handler.streaming import RequestCancelled, send_intermediate_predict_response

__all__ = ["RequestCancelled", "send_intermediate_predict_response"]
