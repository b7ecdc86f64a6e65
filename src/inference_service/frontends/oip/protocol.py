"""Open Inference Protocol (KServe v2) requests and responses, between the wire and a handler.

Both transports turn what they receive into an :class:`InferRequest` and hand the handler what
TorchServe 0.12 hands it (``OpenInferenceProtocolImpl.modelInfer``): one input ``body`` holding
the request as JSON, elements flattened row-major, ``BYTES`` that arrived as bytes base64-encoded.
Request and input ``parameters`` and the requested ``outputs`` are included (TorchServe drops
them). The handler answers a v2 response as JSON, checked by :func:`parse_answer`.
See docs/open-inference-protocol.md.
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import inference_service
from inference_service.errors import HandlerError, InvalidArgument, ResourceExhausted
from inference_service.frontends.limits import OFFLOAD_BYTES, JsonWriter, loads_sliced, off_loop
from inference_service.frontends.oip.tensors import (
    DATATYPES,
    RawElements,
    check_count,
    check_values,
    datatype,
    element_count,
    flatten,
)
from inference_service.serving.core import InferenceCore

#: Parameters that belong to HTTP's binary tensor data extension, not to the model.
TRANSPORT_PARAMETERS = frozenset({"binary_data", "binary_data_size", "binary_data_output"})
#: Conversions of more than this many bytes (or tensor elements) run in a worker thread.
OFFLOAD_SIZE = OFFLOAD_BYTES
T = TypeVar("T")


@dataclass
class Tensor:
    """One tensor of a request or response; ``data`` flattened row-major: bools, ints, floats, or for
    BYTES ``bytes`` (arrived as bytes) / ``str`` (JSON text); raw fixed-size inputs stay raw until
    written out (:class:`~inference_service.frontends.oip.tensors.RawElements`)."""

    name: str
    datatype: str
    shape: list[int]
    data: list[Any] | RawElements
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestedOutput:
    """An output the client asked for (``outputs`` of the request)."""

    name: str
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class InferRequest:
    """One v2 inference request, checked: ``model_version`` "" is the default version, ``id`` "" when
    the client sent none, ``outputs`` empty means all."""

    model_name: str
    model_version: str
    id: str
    inputs: list[Tensor]
    outputs: list[RequestedOutput] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)

    def handler_body(self, limit: int | None = None) -> bytes:
        """The JSON body the handler gets as input ``body``, written slice by slice.

        Raises:
            ResourceExhausted: (413) as soon as the body passes ``limit`` bytes (``max_request_size``).
        """
        out = JsonWriter(sys.maxsize if limit is None else limit, "the request as the handler's JSON body")
        out.write(b'{"id":')
        out.value(self.id)
        out.write(b',"model_name":')
        out.value(self.model_name)
        out.write(b',"inputs":[')
        for index, tensor in enumerate(self.inputs):
            if index:
                out.write(b",")
            _write_input(out, tensor)
        out.write(b"]")
        parameters = model_parameters(self.parameters)
        if parameters:
            out.write(b',"parameters":')
            out.value(parameters)
        if self.outputs:
            out.write(b',"outputs":')
            out.value([_output_request_json(o) for o in self.outputs])
        out.write(b"}")
        return out.getvalue()


@dataclass
class InferResponse:
    """A handler's v2 answer, checked: ``outputs`` hold flattened elements."""

    model_name: str
    model_version: str
    id: str
    outputs: list[Tensor]
    parameters: dict[str, Any] = field(default_factory=dict)


def model_parameters(parameters: dict[str, Any]) -> dict[str, Any]:
    """``parameters`` without the transport's own (:data:`TRANSPORT_PARAMETERS`)."""
    return {k: v for k, v in parameters.items() if k not in TRANSPORT_PARAMETERS}


async def convert(fn: Callable[..., T], *args: Any, size: int) -> T:
    """``fn(*args)``, in a worker thread when ``size`` (bytes or elements converted) is at least
    :data:`OFFLOAD_SIZE` (:func:`~inference_service.frontends.limits.off_loop`), so that a large
    tensor does not hold the event loop while other requests wait."""
    return await off_loop(fn, *args, size=size)


def element_total(tensors: list[Tensor]) -> int:
    """The number of elements of ``tensors`` (the size of a conversion, for :func:`convert`)."""
    return sum(len(t.data) for t in tensors)


# The fewest JSON bytes one element takes, its comma included ("0.0," "0," "true," '"",').
_JSON_FLOOR = {"float": 4, "int": 2, "bool": 5, "bytes": 3}


def check_json_floor(tensors: list[Tensor], limit: int) -> None:
    """Refuse, before any conversion, tensors whose JSON cannot fit ``limit`` bytes.

    Raises:
        ResourceExhausted: (413) the elements take more than ``limit`` bytes even at their shortest.
    """
    floor = sum(len(t.data) * _JSON_FLOOR[DATATYPES[t.datatype].kind] for t in tensors)
    if floor > limit:
        raise ResourceExhausted(f"{element_total(tensors)} tensor elements take at least {floor} bytes as the "
                                f"handler's JSON body, above max_request_size={limit} bytes",
                                reason="REQUEST_TOO_LARGE")


def elements_json(out: JsonWriter, tensor: Tensor) -> None:
    """Write the elements of ``tensor`` as a JSON array, slice by slice (BYTES elements that
    are ``bytes`` as base64 strings)."""
    data = tensor.data
    if tensor.datatype == "BYTES":
        out.values(len(data), lambda start, stop: [base64.b64encode(v).decode("ascii") if isinstance(v, bytes)
                                                   else v for v in data[start:stop]])
    else:
        out.values(len(data), lambda start, stop: data[start:stop])


def _write_input(out: JsonWriter, tensor: Tensor) -> None:
    out.write(b'{"name":')
    out.value(tensor.name)
    out.write(b',"shape":')
    out.value(tensor.shape)
    out.write(b',"datatype":')
    out.value(tensor.datatype)
    out.write(b',"data":')
    elements_json(out, tensor)
    parameters = model_parameters(tensor.parameters)
    if parameters:
        out.write(b',"parameters":')
        out.value(parameters)
    out.write(b"}")


def _output_request_json(output: RequestedOutput) -> dict[str, Any]:
    out: dict[str, Any] = {"name": output.name}
    parameters = model_parameters(output.parameters)
    if parameters:
        out["parameters"] = parameters
    return out


def make_input(name: Any, dtype_name: Any, shape: Any, data: list[Any] | RawElements, *, typed: bool,
               parameters: dict[str, Any] | None = None, index: int = 0) -> Tensor:
    """An input :class:`Tensor`, checked (``typed``: per-element checks are not needed).

    Raises:
        InvalidArgument: no name, unknown data type, bad shape or count, a bad element.
    """
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"input {index} has no name")
    what = f"input {name!r}"
    if not isinstance(dtype_name, str):
        raise InvalidArgument(f"{what} has no datatype")
    dtype = datatype(dtype_name, InvalidArgument, what)
    if not isinstance(shape, list):
        raise InvalidArgument(f"{what} has no shape")
    count = element_count(shape, InvalidArgument, what)
    check_count(len(data), count, InvalidArgument, what, shape)
    if isinstance(data, RawElements):
        pass  # raw bytes of the declared type always fit it
    elif not typed:
        data = check_values(dtype, data, InvalidArgument, what)
    elif dtype.kind == "int":  # typed int32/uint32 fields carry the narrower types too
        bad = next((v for v in data if not dtype.low <= v <= dtype.high), None)
        if bad is not None:
            raise InvalidArgument(f"{what}: element {bad} is out of range for {dtype.name}")
    return Tensor(name, dtype.name, list(shape), data, parameters or {})


def parse_answer(payload: bytes, request: InferRequest, served_version: str) -> InferResponse:
    """The handler's JSON answer to ``request`` as an :class:`InferResponse`; a missing ``id``,
    ``model_name`` or ``model_version`` is the request's, ``data`` may be nested.

    Raises:
        HandlerError: (INTERNAL, ``HANDLER_ERROR``) not a v2 inference response; the message names
            what is wrong.
    """
    try:
        answer = loads_sliced(payload)  # a tensor's numbers a slice per call: the loop gets the interpreter back
    except RecursionError:
        raise HandlerError("the handler's answer is not a v2 inference response: JSON nested too deep") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise HandlerError(f"the handler's answer is not a v2 inference response: not JSON ({exc})") from exc
    if not isinstance(answer, dict) or not isinstance(answer.get("outputs"), list):
        raise HandlerError('the handler\'s answer is not a v2 inference response: no "outputs" list '
                           f"(got {str(answer)[:200]!r})")
    outputs = [_output(o, i) for i, o in enumerate(answer["outputs"])]
    parameters = answer.get("parameters")
    return InferResponse(
        model_name=_text(answer.get("model_name")) or request.model_name,
        model_version=_text(answer.get("model_version")) or served_version,
        id=_text(answer.get("id")) or request.id,
        outputs=outputs,
        parameters=parameters if isinstance(parameters, dict) else {},
    )


def _text(value: Any) -> str:
    return value if isinstance(value, str) else str(value) if isinstance(value, int | float) else ""


def _output(obj: Any, index: int) -> Tensor:
    if not isinstance(obj, dict):
        raise HandlerError(f"the handler's output {index} is not an object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise HandlerError(f"the handler's output {index} has no name")
    what = f"the handler's output {name!r}"
    dtype_name = obj.get("datatype")
    if not isinstance(dtype_name, str):
        raise HandlerError(f"{what} has no datatype")
    dtype = datatype(dtype_name, HandlerError, what)
    shape = obj.get("shape")
    if not isinstance(shape, list):
        raise HandlerError(f"{what} has no shape")
    if "data" not in obj:
        raise HandlerError(f"{what} has no data")
    values = flatten(obj["data"])
    if dtype.kind == "bytes":  # numbers, objects ... become their JSON text
        values = [v if isinstance(v, str) else json.dumps(v) for v in values]
    check_count(len(values), element_count(shape, HandlerError, what), HandlerError, what, shape)
    values = check_values(dtype, values, HandlerError, what)
    parameters = obj.get("parameters")
    return Tensor(name, dtype.name, list(shape), values, parameters if isinstance(parameters, dict) else {})


def select_outputs(response: InferResponse, requested: list[RequestedOutput]) -> list[Tensor]:
    """The outputs of ``response`` the client asked for, in its order (all when it asked for none).

    Raises:
        InvalidArgument: a requested output the model did not produce (as Triton answers).
    """
    if not requested:
        return response.outputs
    by_name = {t.name: t for t in response.outputs}
    missing = [o.name for o in requested if o.name not in by_name]
    if missing:
        raise InvalidArgument(f"requested outputs {missing} are not produced by model {response.model_name!r} "
                              f"(its outputs: {sorted(by_name)})")
    return [by_name[o.name] for o in requested]



# ------------------------------------------------------------------ operations on the core
SERVER_NAME = "inference-service"
#: Protocol extensions served: Triton's binary tensor data (HTTP ``Inference-Header-Content-Length``).
EXTENSIONS = ("binary_tensor_data",)


def server_metadata() -> dict[str, Any]:
    """``{"name": "inference-service", "version": <this server's>, "extensions": [...]}``."""
    return {"name": SERVER_NAME, "version": inference_service.__version__, "extensions": list(EXTENSIONS)}


def server_ready(core: InferenceCore) -> bool:
    """Ready: not shutting down, every startup model registered with its minimum workers ready
    (the readiness of ``grpc.health.v1``; TorchServe always answers true)."""
    return core.accepting and core.startup_ready()


def model_ready(core: InferenceCore, name: str, version: str) -> bool:
    """The version (default: the default one) has its minimum workers ready, or sleeps (a request
    wakes it), and the server is not shutting down (health's ``model/<name>`` rule).

    Raises:
        InvalidArgument: no name. NotFound: unknown model or version (as TorchServe).
    """
    if not name:
        raise InvalidArgument("name is required", reason="MODEL_NAME_REQUIRED")
    model = core.get(name, version)
    return core.accepting and model.serving


def model_metadata(core: InferenceCore, name: str, version: str) -> dict[str, Any]:
    """``{"name", "versions", "platform": "", "inputs": [], "outputs": []}`` as TorchServe answers (a
    handler declares no tensors).

    Raises:
        InvalidArgument: no name. NotFound: unknown model or version.
    """
    if not name:
        raise InvalidArgument("name is required", reason="MODEL_NAME_REQUIRED")
    core.get(name, version)
    versions = [model.version for model, _default in core.versions(name, "all")]
    return {"name": name, "versions": versions, "platform": "", "inputs": [], "outputs": []}


async def infer(core: InferenceCore, request: InferRequest, headers: dict[str, str],
                time_remaining: float | None = None) -> InferResponse:
    """Run ``request`` through :meth:`InferenceCore.predict` (dynamic batching); only the outputs
    asked for. A body that cannot fit ``max_request_size`` is refused (413), never built whole.

    Raises:
        InferenceError: the core's errors; HandlerError for an answer that is not a v2 response;
            InvalidArgument for a requested output the model did not produce.
    """
    model = core.get(request.model_name, request.model_version)
    limit = core.settings.max_request_size
    check_json_floor(request.inputs, limit)
    body = await convert(request.handler_body, limit, size=element_total(request.inputs))
    payload = await core.predict(request.model_name, request.model_version, {"body": body}, headers, time_remaining)
    response = await convert(parse_answer, payload, request, model.version, size=len(payload))
    response.outputs = select_outputs(response, request.outputs)
    return response
