"""The Open Inference Protocol's ``GRPCInferenceService`` over :class:`InferenceCore`.

Served twice on the inference port, with the same behaviour: as ``inference.GRPCInferenceService``
(KServe's ``grpc_predict_v2.proto``, what tritonclient and KServe clients call) and as
``org.pytorch.serve.grpc.openinference.GRPCInferenceService`` (TorchServe 0.12's
``open_inference_grpc.proto``). Each RPC needs the inference key, as ``Predictions`` does.

- ``ServerLive``: true while the server runs. ``ServerReady``: see
  :func:`~inference_service.frontends.oip.protocol.server_ready`.
- ``ModelReady`` / ``ModelMetadata``: NOT_FOUND for an unknown model or version (as TorchServe),
  INVALID_ARGUMENT without a name (TorchServe: INTERNAL).
- ``ServerMetadata``: name, version and extensions (TorchServe: UNIMPLEMENTED).
- ``ModelInfer``: inputs from typed ``contents`` or from ``raw_input_contents`` (decoded per data
  type, :mod:`inference_service.frontends.oip.tensors`; TorchServe ignores raw contents), handed to the
  handler as TorchServe's JSON body (:mod:`inference_service.frontends.oip.protocol`). The answer's
  outputs come back in ``raw_output_contents`` when the request used raw inputs (tritonclient
  does, and reads only raw outputs) or an output is FP16/BF16 (no typed field exists), else in
  typed ``contents`` as TorchServe sends them. Statuses: INVALID_ARGUMENT (no model name,
  unknown data type, a shape the data do not fill, raw and typed contents mixed, an element out
  of range, a requested output not produced), NOT_FOUND (unknown model or version), the core's
  UNAVAILABLE / RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED, INTERNAL for a handler error or an answer
  that is not a v2 response (TorchServe answers INTERNAL for an unknown model too).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import grpc

from inference_service.errors import HandlerError, InvalidArgument
from inference_service.frontends.grpc.base import unary
from inference_service.frontends.grpc.inference import request_headers
from inference_service.frontends.oip.generation import infer_any
from inference_service.frontends.oip.protocol import (
    InferRequest,
    InferResponse,
    RequestedOutput,
    convert,
    element_total,
    make_input,
    model_metadata,
    model_ready,
    server_metadata,
    server_ready,
)
from inference_service.frontends.oip.tensors import (
    DATATYPES,
    PACK_SLICE,
    datatype,
    element_count,
    encode_raw,
    raw_elements,
)
from inference_service.observability.metrics import Telemetry
from inference_service.serving.core import InferenceCore


def parameters_from_proto(parameters: Any) -> dict[str, Any]:
    """A ``map<string, InferParameter>`` as plain values (bool, int or str; ``None`` when unset)."""
    out: dict[str, Any] = {}
    for key, value in parameters.items():
        choice = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, choice) if choice else None
    return out


def _parameters_to_proto(target: Any, parameters: dict[str, Any]) -> None:
    """Fill a ``map<string, InferParameter>``: bool, int (64-bit) and str as such, anything else as text."""
    for key, value in parameters.items():
        if isinstance(value, bool):
            target[key].bool_param = value
        elif isinstance(value, int) and -(1 << 63) <= value < (1 << 63):
            target[key].int64_param = value
        else:
            target[key].string_param = value if isinstance(value, str) else str(value)


def infer_request(request: Any) -> InferRequest:
    """A ``ModelInferRequest`` as an :class:`InferRequest`, checked.

    Raises:
        InvalidArgument: ``raw_input_contents`` not one per input, raw and typed contents both
            set, FP16/BF16 sent typed, or an input that :func:`make_input` refuses.
    """
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InvalidArgument(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs")
    inputs = []
    for index, tensor in enumerate(request.inputs):
        what = f"input {tensor.name or index!r}"
        dtype = datatype(tensor.datatype, InvalidArgument, what)
        shape = list(tensor.shape)
        if raw:
            if tensor.contents.ByteSize():
                raise InvalidArgument(f"{what} sets contents while the request uses raw_input_contents")
            data = raw_elements(dtype, raw[index], element_count(shape, InvalidArgument, what), what, InvalidArgument)
        elif not dtype.field:
            raise InvalidArgument(f"{what}: {dtype.name} data can only be sent in raw_input_contents")
        else:
            data = getattr(tensor.contents, dtype.field)  # the repeated field itself: sliced when written
        inputs.append(make_input(tensor.name, tensor.datatype, shape, data, typed=True,
                                 parameters=parameters_from_proto(tensor.parameters), index=index))
    outputs = [RequestedOutput(o.name, parameters_from_proto(o.parameters)) for o in request.outputs]
    return InferRequest(request.model_name, request.model_version, request.id, inputs, outputs,
                        parameters_from_proto(request.parameters))


def infer_response(pb2: ModuleType, response: InferResponse, raw: bool) -> Any:
    """An :class:`InferResponse` as ``pb2.ModelInferResponse``: raw outputs when ``raw`` or when an
    output has no typed field (FP16, BF16), typed ``contents`` otherwise (BYTES ``str`` as UTF-8).

    Raises:
        HandlerError: a value that does not fit its data type in raw form.
    """
    message = pb2.ModelInferResponse(model_name=response.model_name, model_version=response.model_version,
                                     id=response.id)
    _parameters_to_proto(message.parameters, response.parameters)
    raw = raw or any(not DATATYPES[t.datatype].field for t in response.outputs)
    for tensor in response.outputs:
        out = message.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        _parameters_to_proto(out.parameters, tensor.parameters)
        dtype = DATATYPES[tensor.datatype]
        if raw:
            message.raw_output_contents.append(
                encode_raw(dtype, tensor.data, f"the handler's output {tensor.name!r}", HandlerError))
        elif dtype.kind == "bytes":
            out.contents.bytes_contents.extend(v.encode("utf-8") if isinstance(v, str) else v for v in tensor.data)
        else:
            field = getattr(out.contents, dtype.field)
            for start in range(0, len(tensor.data), PACK_SLICE):  # a slice per call: the loop is let in between
                field.extend(tensor.data[start:start + PACK_SLICE])
    return message


class OpenInferenceServicer:
    """``GRPCInferenceService`` of one proto package (see the module docstring).

    Args:
        core: the serving core.
        pb2: the generated messages of the package it serves (``grpc_predict_v2_pb2`` or
            ``open_inference_grpc_pb2``).
        telemetry: where RPCs are counted and access-logged (``None``: nowhere).
        status_codes: ``grpc_status_codes`` (``"torchserve"``: TorchServe 0.12's codes, see
            :func:`~inference_service.frontends.grpc.base.refusal`).
    """

    def __init__(self, core: InferenceCore, pb2: ModuleType, telemetry: Telemetry | None = None,
                 status_codes: str = "default") -> None:
        self.core = core
        self.pb2 = pb2
        self.telemetry = telemetry
        self.status_codes = status_codes

    @unary
    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """``live`` true: the server answers."""
        return self.pb2.ServerLiveResponse(live=True)

    @unary
    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """``ready`` once the startup models are ready, false while shutting down."""
        return self.pb2.ServerReadyResponse(ready=server_ready(self.core))

    @unary
    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """``ready`` while the version has a ready worker; NOT_FOUND for an unknown model or version."""
        return self.pb2.ModelReadyResponse(ready=model_ready(self.core, request.name, request.version))

    @unary
    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """The server's name, version and protocol extensions."""
        return self.pb2.ServerMetadataResponse(**server_metadata())

    @unary
    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """The model's versions (platform and tensors empty, as TorchServe); NOT_FOUND when unknown."""
        return self.pb2.ModelMetadataResponse(**model_metadata(self.core, request.name, request.version))

    @unary
    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Run the request on the model: proto to :class:`InferRequest`, the core, answer to proto."""
        self.core.get(request.model_name, request.model_version)  # an unknown model is NOT_FOUND, whatever it holds
        infer_req = await convert(infer_request, request, size=request.ByteSize())
        response = await infer_any(self.core, infer_req, request_headers(context), context.time_remaining())
        return await convert(infer_response, self.pb2, response, bool(request.raw_input_contents),
                             size=element_total(response.outputs))

