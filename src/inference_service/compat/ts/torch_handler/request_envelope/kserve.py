"""``ts.torch_handler.request_envelope.kserve``: the ``service_envelope=kserve`` envelope
(:class:`inference_service.handler.envelopes.KServeEnvelope`)."""

from inference_service.handler.envelopes import KServeEnvelope

__all__ = ["KServeEnvelope"]
