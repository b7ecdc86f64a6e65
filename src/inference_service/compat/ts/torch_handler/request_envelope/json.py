"""``ts.torch_handler.request_envelope.json``: the ``service_envelope=json`` envelope
(:class:`inference_service.handler.envelopes.JSONEnvelope`)."""

from inference_service.handler.envelopes import JSONEnvelope

__all__ = ["JSONEnvelope"]
