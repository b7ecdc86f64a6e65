"""``ts.torch_handler.request_envelope`` (TorchServe import path): the request envelopes of
:mod:`inference_service.handler.envelopes`, one module per ``service_envelope`` name."""
