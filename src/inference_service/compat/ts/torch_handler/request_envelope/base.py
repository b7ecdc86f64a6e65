"""``ts.torch_handler.request_envelope.base``: TorchServe's ``BaseEnvelope``
(:class:`inference_service.handler.envelopes.BaseEnvelope`)."""

from inference_service.handler.envelopes import BaseEnvelope

__all__ = ["BaseEnvelope"]
