"""The Open Inference Protocol (KServe v2) over HTTP/1.1, on the HTTP inference API's port.

:func:`add_open_inference_routes` adds the ``/v2`` routes to
:class:`~inference_service.frontends.http.inference.HttpInferenceApi`'s application (so with its
token authorization), including Triton's binary tensor data extension
(``Inference-Header-Content-Length``). Errors answer the protocol's ``{"error": "<message>"}``
(what tritonclient reads) with the HTTP API's status. See docs/open-inference-protocol.md.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from inference_service.contracts.explain import set_explain
from inference_service.errors import HandlerError, InferenceError, InvalidArgument
from inference_service.frontends.limits import JsonWriter, parse_json, refuse_form
from inference_service.frontends.oip.generation import generate, infer_any, llm_body
from inference_service.frontends.oip.protocol import (
    InferRequest,
    InferResponse,
    RequestedOutput,
    convert,
    element_total,
    elements_json,
    make_input,
    model_metadata,
    model_ready,
    server_metadata,
    server_ready,
)
from inference_service.frontends.oip.tensors import (
    DATATYPES,
    RawElements,
    datatype,
    element_count,
    encode_raw,
    flatten,
    raw_elements,
)
from inference_service.serving.core import InferenceCore

HEADER_LENGTH = "Inference-Header-Content-Length"
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add_open_inference_routes(app: web.Application, core: InferenceCore) -> None:
    """Add the ``/v2`` routes (see the module docstring) and the middleware that gives their
    errors the protocol's ``{"error": ...}`` body. Call before the application starts."""
    routes = OpenInferenceRoutes(core)
    for prefix in ("/v2/models/{model_name}", "/v2/models/{model_name}/versions/{model_version}"):
        app.router.add_get(prefix, routes.model_metadata, allow_head=False)
        app.router.add_get(prefix + "/ready", routes.model_ready, allow_head=False)
        app.router.add_post(prefix + "/infer", routes.infer)
        app.router.add_post(prefix + "/explain", routes.explain)  # TorchServe's: infer flagged explain
        app.router.add_post(prefix + "/generate", routes.generate)  # Triton's generate extension (an LLM)
        app.router.add_post(prefix + "/generate_stream", routes.generate_stream)
    app.router.add_get("/v2", routes.server_metadata, allow_head=False)
    app.router.add_get("/v2/health/live", routes.live, allow_head=False)
    app.router.add_get("/v2/health/ready", routes.ready, allow_head=False)
    # outermost, so it also sees the answers of the authorization and error middlewares
    app.middlewares.insert(0, open_inference_errors)


def is_open_inference_path(path: str) -> bool:
    """True for ``/v2`` and the paths under it."""
    return path == "/v2" or path.startswith("/v2/")


@web.middleware
async def open_inference_errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """For the ``/v2`` routes, turn the HTTP API's error body (TorchServe's ``{"code", "type",
    "message"}``) into the protocol's ``{"error": message}``, keeping the status and headers.
    A path or method no route serves keeps the HTTP API's answer (404/405, TorchServe's body)."""
    response = await handler(request)
    if (response.status < 400 or request.match_info.http_exception is not None
            or not is_open_inference_path(request.path) or not isinstance(response, web.Response)):
        return response
    try:
        body = json.loads(response.body) if isinstance(response.body, bytes) else None
    except ValueError:
        body = None
    if not isinstance(body, dict) or "error" in body or "message" not in body:
        return response
    headers = {k: v for k, v in response.headers.items() if k in ("WWW-Authenticate", "Retry-After", "Allow")}
    return web.json_response({"error": str(body["message"])}, status=response.status, headers=headers)


def request_from_http(body: bytes, header_length: str | None, name: str, version: str,
                      max_depth: int = 64, max_nodes: int = 100_000) -> InferRequest:
    """A v2 HTTP inference body (JSON, or JSON plus binary tensor data) as an :class:`InferRequest`;
    fixed-size binary inputs stay raw until the handler's body is written.

    Raises:
        InvalidArgument: JSON that does not parse, nests deeper than ``max_depth``, holds more than
            ``max_nodes`` objects and arrays (counted before parsing) or is not an object; a bad
            ``Inference-Header-Content-Length`` or binary sizes that do not add up; an input
            :func:`make_input` refuses.
    """
    binary = b""
    if header_length is not None:
        try:
            length = int(header_length)
        except ValueError:
            length = -1
        if not 0 <= length <= len(body):
            raise InvalidArgument(f"{HEADER_LENGTH} {header_length!r} is not a length within the body "
                                  f"({len(body)} bytes)")
        body, binary = body[:length], body[length:]
    obj = parse_json(body, max_depth, max_nodes)
    if not isinstance(obj, dict):
        raise InvalidArgument("the request body is not a JSON object")
    raw_inputs = obj.get("inputs")
    if not isinstance(raw_inputs, list):
        raise InvalidArgument('the request has no "inputs" list')
    inputs = []
    offset = 0
    for index, item in enumerate(raw_inputs):
        if not isinstance(item, dict):
            raise InvalidArgument(f"input {index} is not an object")
        parameters = _parameters(item.get("parameters"), f"input {index}")
        size = parameters.get("binary_data_size")
        data: list[Any] | RawElements
        if size is not None:
            what = f"input {item.get('name') or index!r}"
            if isinstance(size, bool) or not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise InvalidArgument(f"{what}: binary_data_size {size!r} exceeds the {len(binary) - offset} "
                                      "bytes of binary data left")
            dtype = datatype(str(item.get("datatype")), InvalidArgument, what)
            shape = item.get("shape")
            count = element_count(shape if isinstance(shape, list) else [], InvalidArgument, what)
            data = raw_elements(dtype, binary[offset:offset + size], count, what, InvalidArgument)
            offset += size
            typed = True
        elif "data" in item:
            data, typed = flatten(item["data"]), False
        else:
            raise InvalidArgument(f"input {item.get('name') or index!r} has neither data nor binary_data_size")
        inputs.append(make_input(item.get("name"), item.get("datatype"), item.get("shape"), data, typed=typed,
                                 parameters=parameters, index=index))
    if offset != len(binary):
        raise InvalidArgument(f"{len(binary) - offset} bytes of binary data belong to no input")
    outputs = []
    raw_outputs = obj.get("outputs") or []
    if not isinstance(raw_outputs, list):
        raise InvalidArgument('"outputs" is not a list')
    for index, item in enumerate(raw_outputs):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidArgument(f"requested output {index} has no name")
        outputs.append(RequestedOutput(item["name"], _parameters(item.get("parameters"), f"output {index}")))
    request_id = obj.get("id")
    return InferRequest(name, version, request_id if isinstance(request_id, str) else "" if request_id is None
                        else json.dumps(request_id), inputs, outputs, _parameters(obj.get("parameters"), "request"))


def _parameters(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument(f"the parameters of {what} are not an object")
    return value


def _wants_binary(request: InferRequest, output: str) -> bool:
    """Binary data for ``output``: its requested parameter ``binary_data``, else the request's
    ``binary_data_output`` (Triton's binary tensor data extension)."""
    for requested in request.outputs:
        if requested.name == output and "binary_data" in requested.parameters:
            return requested.parameters["binary_data"] is True
    return request.parameters.get("binary_data_output") is True


def response_to_http(request: InferRequest, response: InferResponse) -> web.Response:
    """The v2 HTTP answer: JSON, or JSON followed by the outputs asked for as binary data.

    Raises:
        HandlerError: an output value that does not fit its data type in binary form.
    """
    out = JsonWriter(sys.maxsize, "the v2 answer")
    blobs: list[bytes] = []
    out.write(b'{"model_name":')
    out.value(response.model_name)
    out.write(b',"model_version":')
    out.value(response.model_version)
    if response.id:
        out.write(b',"id":')
        out.value(response.id)
    if response.parameters:
        out.write(b',"parameters":')
        out.value(response.parameters)
    out.write(b',"outputs":[')
    for index, tensor in enumerate(response.outputs):
        out.write(b',{"name":' if index else b'{"name":')
        out.value(tensor.name)
        out.write(b',"datatype":')
        out.value(tensor.datatype)
        out.write(b',"shape":')
        out.value(tensor.shape)
        parameters = dict(tensor.parameters)
        if _wants_binary(request, tensor.name):
            blob = encode_raw(DATATYPES[tensor.datatype], tensor.data, f"the handler's output {tensor.name!r}",
                              HandlerError)
            parameters["binary_data_size"] = len(blob)
            blobs.append(blob)
        else:
            out.write(b',"data":')
            elements_json(out, tensor)
        if parameters:
            out.write(b',"parameters":')
            out.value(parameters)
        out.write(b"}")
    out.write(b"]}")
    head = out.getvalue()
    if not blobs:
        return web.Response(body=head, content_type="application/json")
    return web.Response(body=head + b"".join(blobs), content_type="application/octet-stream",
                        headers={HEADER_LENGTH: str(len(head))})


def _version(request: web.Request) -> str:
    return request.match_info.get("model_version", "")


class OpenInferenceRoutes:
    """The route handlers of :func:`add_open_inference_routes` over one core."""

    def __init__(self, core: InferenceCore) -> None:
        self.core = core

    async def server_metadata(self, request: web.Request) -> web.Response:
        """``GET /v2``: the server's name, version and protocol extensions."""
        return web.json_response(server_metadata())

    async def live(self, request: web.Request) -> web.Response:
        """``GET /v2/health/live``: 200 ``{"live": true}`` while the server answers."""
        return web.json_response({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        """``GET /v2/health/ready``: 200 when ready, 400 otherwise (see :func:`server_ready`)."""
        ready = server_ready(self.core)
        return web.json_response({"ready": ready}, status=200 if ready else 400)

    async def model_ready(self, request: web.Request) -> web.Response:
        """``GET /v2/models/{name}[/versions/{v}]/ready``: 200 when ready, 400 otherwise, 404 when unknown."""
        name = request.match_info["model_name"]
        ready = model_ready(self.core, name, _version(request))
        return web.json_response({"name": name, "ready": ready}, status=200 if ready else 400)

    async def model_metadata(self, request: web.Request) -> web.Response:
        """``GET /v2/models/{name}[/versions/{v}]``: the model's metadata, 404 when unknown."""
        return web.json_response(model_metadata(self.core, request.match_info["model_name"], _version(request)))

    async def infer(self, request: web.Request) -> web.Response:
        """``POST /v2/models/{name}[/versions/{v}]/infer``.

        Steps: 1. resolve the model (404 when unknown); 2. read and check the body (400, 413);
        3. run it (:func:`~inference_service.frontends.oip.protocol.infer`) with TorchServe's header
        ``explain`` (``True`` from :meth:`explain`); 4. answer JSON or binary.
        """
        name, version = request.match_info["model_name"], _version(request)
        self.core.get(name, version)
        body = await request.read()
        refuse_form(request.content_type, body)
        infer_request = await convert(request_from_http, body, request.headers.get(HEADER_LENGTH), name, version,
                                      self.core.settings.max_json_depth, self.core.settings.max_json_nodes,
                                      size=len(body))
        headers = {key: value for key, value in request.headers.items() if key.lower() != "authorization"}
        set_explain(headers, request.get("explain", False))
        response = await infer_any(self.core, infer_request, headers)
        return await convert(response_to_http, infer_request, response, size=element_total(response.outputs))

    async def explain(self, request: web.Request) -> web.Response:
        """``POST /v2/models/{name}[/versions/{v}]/explain``: :meth:`infer` with ``explain: True``; the
        handler's explanation must be a v2 response, as an inference's (TorchServe's kservev2 envelope)."""
        request["explain"] = True
        return await self.infer(request)

    async def generate(self, request: web.Request) -> web.Response:
        """``POST /v2/models/{name}[/versions/{v}]/generate``, Triton's generate extension:
        ``{"text_input", "parameters"}`` in, ``{"model_name", "model_version", "text_output"}`` out
        (400 for a model that is not an LLM, or a field it does not take)."""
        name, version, body = await self._generation(request)
        pieces = [piece async for piece, _ in generate(self.core, name, version, body, _headers(request))]
        return web.json_response({"model_name": name, "model_version": version, "text_output": "".join(pieces)})

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        """``POST .../generate_stream``: server-sent events, one ``{"model_name", "model_version",
        "text_output"}`` a piece as the model writes it. An error before the first piece is the
        route's error answer; after it, an event ``{"error": message}`` ends the stream."""
        name, version, body = await self._generation(request)
        stream = generate(self.core, name, version, body, _headers(request))
        try:
            item: tuple[str, bool] | None = await anext(stream)  # a refusal still has its own status
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            try:
                while item is not None:
                    piece, final = item
                    if piece or final:
                        event = {"model_name": name, "model_version": version, "text_output": piece}
                        await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                    item = None if final else await anext(stream)
            except InferenceError as exc:
                await response.write(b"data: " + json.dumps({"error": exc.message}).encode() + b"\n\n")
            await response.write_eof()
            return response
        finally:
            await stream.aclose()

    async def _generation(self, request: web.Request) -> tuple[str, str, bytes]:
        """``(model, served version, the LLM handler's body)`` of a generate request.

        Raises:
            InvalidArgument: not JSON, no ``text_input`` string, another field, or the model is
                not an LLM.
        """
        name = request.match_info["model_name"]
        model = self.core.get(name, _version(request))
        if not model.accepts_generation:
            raise InvalidArgument(f"model {name!r} does not generate text (its handler takes no LLM requests): "
                                  "send tensors to /v2/models/<model>/infer")
        raw = await request.read()
        refuse_form(request.content_type, raw)
        settings = self.core.settings
        decoded = await convert(parse_json, raw, settings.max_json_depth, settings.max_json_nodes, size=len(raw))
        if not isinstance(decoded, dict) or not isinstance(decoded.get("text_input"), str) or not decoded["text_input"]:
            raise InvalidArgument('the body must be a JSON object with a non-empty string "text_input"')
        others = sorted(set(decoded) - {"text_input", "parameters", "id"})
        if others:
            raise InvalidArgument(f"field(s) {', '.join(map(repr, others))} are not read: send the text as "
                                  '"text_input" and sampling settings in "parameters"')
        parameters = _parameters(decoded.get("parameters"), "parameters")
        return name, model.version, llm_body(decoded["text_input"], parameters, "parameters")


def _headers(request: web.Request) -> dict[str, str]:
    return {key: value for key, value in request.headers.items() if key.lower() != "authorization"}
