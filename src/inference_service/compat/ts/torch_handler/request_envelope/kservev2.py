"""``ts.torch_handler.request_envelope.kservev2``: the ``service_envelope=kservev2`` envelope
(:class:`inference_service.handler.envelopes.KServev2Envelope`)."""

from inference_service.handler.envelopes import KServev2Envelope

__all__ = ["KServev2Envelope"]
