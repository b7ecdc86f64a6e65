"""``ts.protocol.otf_message_handler``: TorchServe's deprecated home of
``send_intermediate_predict_response``, kept for old handlers."""

from inference_service.handler.streaming import send_intermediate_predict_response

__all__ = ["send_intermediate_predict_response"]
