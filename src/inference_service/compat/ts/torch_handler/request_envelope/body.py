"""``ts.torch_handler.request_envelope.body``: the ``service_envelope=body`` envelope
(:class:`inference_service.handler.envelopes.BodyEnvelope`)."""

from inference_service.handler.envelopes import BodyEnvelope

__all__ = ["BodyEnvelope"]
