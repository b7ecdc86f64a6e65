"""``org.pytorch.serve.grpc.inference.InferenceAPIsService`` over :class:`InferenceCore`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import empty_pb2
from google.rpc import status_pb2

from inference_service._proto import inference_pb2, inference_pb2_grpc
from inference_service.contracts.explain import EXPLAIN_HEADER
from inference_service.errors import InferenceError, InvalidArgument
from inference_service.frontends.grpc.base import bidi_streaming, refusal, streaming, unary
from inference_service.frontends.grpc.registration import Malformed
from inference_service.frontends.request_ids import REQUEST_ID_HEADER, current
from inference_service.observability.metrics import Telemetry
from inference_service.serving.core import InferenceCore
from inference_service.serving.sequences import SEQ_END, SEQ_ID, SEQ_START, new_sequence_id

PredictionResponse = inference_pb2.PredictionResponse
_SKIP_HEADERS = ("authorization", "grpc-", ":")


def request_headers(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """gRPC metadata passed to the handler as request headers (credentials, transport keys and
    ``explain`` left out: TorchServe's gRPC API has no explanations; binary ``-bin`` values skipped;
    ``x-request-id`` the call's id)."""
    headers = {}
    for key, value in context.invocation_metadata() or ():
        if not key.startswith(_SKIP_HEADERS) and key != EXPLAIN_HEADER and isinstance(value, str):
            headers[key] = value
    if rid := current.get():
        headers[REQUEST_ID_HEADER] = rid  # the call's id, as its access line names it
    return headers


def _flag(inputs: Any, key: str) -> bool:
    value = inputs.get(key)
    return value is not None and bytes(value).strip().lower() == b"true"


class InferenceServicer(inference_pb2_grpc.InferenceAPIsServiceServicer):
    """TorchServe's inference API.

    Args:
        core: the serving core.
        telemetry: where RPCs are counted and access-logged (``None``: nowhere).
        status_codes: ``grpc_status_codes`` (``"torchserve"``: TorchServe 0.12's codes, see
            :func:`~inference_service.frontends.grpc.base.refusal`).
    """

    def __init__(self, core: InferenceCore, telemetry: Telemetry | None = None,
                 status_codes: str = "default") -> None:
        self.core = core
        self.telemetry = telemetry
        self.status_codes = status_codes

    @unary
    async def Ping(self, request: empty_pb2.Empty,
                   context: grpc.aio.ServicerContext) -> inference_pb2.TorchServeHealthResponse:
        """``{"status": "Healthy", "code": 200}``, or Unhealthy/500 while a model has
        fewer than its minimum workers (TorchServe's rule)."""
        return inference_pb2.TorchServeHealthResponse(health=health_json(self.core.healthy()))

    @unary
    async def Predictions(self, request: inference_pb2.PredictionsRequest,
                          context: grpc.aio.ServicerContext) -> inference_pb2.PredictionResponse:
        """Unary inference; a streaming handler's messages come back concatenated.

        Status: NOT_FOUND (unknown model/version), INVALID_ARGUMENT (no
        model_name, or the handler's 400), UNAVAILABLE (no worker),
        RESOURCE_EXHAUSTED (job queue full), INTERNAL (handler error).
        """
        payload = await self.core.predict(
            request.model_name, request.model_version, dict(request.input),
            request_headers(context), context.time_remaining())
        return PredictionResponse(prediction=payload)

    @streaming
    async def StreamPredictions(self, request: inference_pb2.PredictionsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[PredictionResponse]:
        """Server-streaming inference: each intermediate response as the worker produces
        it, then the final one (batch size 1). A client cancel reaches the handler."""
        async for payload, _final in self.core.stream(
                request.model_name, request.model_version, dict(request.input),
                request_headers(context), context.time_remaining()):
            yield PredictionResponse(prediction=payload)

    @bidi_streaming
    async def StreamPredictions2(self, request_iterator: AsyncIterator[inference_pb2.PredictionsRequest],
                                 context: grpc.aio.ServicerContext) -> AsyncIterator[PredictionResponse]:
        """One bidirectional stream per sequence (TorchServe's stateful inference).

        Requests are answered in order with ``sequence_id`` echoed. An empty
        ``sequence_id`` with input ``ts_request_sequence_start=true`` gets a new
        ``ts-seq-<uuid>``; ``ts_request_sequence_end=true`` closes the sequence.
        Errors come back in-band in ``PredictionResponse.status``; the stream stays open.
        """
        opened: dict[str, Any] = {}
        headers = request_headers(context)
        started = time.monotonic()
        iterator = request_iterator.__aiter__()
        try:
            while True:
                idle_ms = timeout_ms = 0
                for model in opened.values():
                    idle_ms = model.config.sequence_max_idle_ms or idle_ms
                    timeout_ms = model.config.sequence_timeout_ms or timeout_ms
                wait = idle_ms / 1000 if idle_ms else None
                if timeout_ms:
                    left = timeout_ms / 1000 - (time.monotonic() - started)
                    wait = left if wait is None else min(wait, left)
                try:
                    request = await asyncio.wait_for(anext(iterator), wait) if wait is not None \
                        else await anext(iterator)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    for seq in opened:
                        yield self._in_band(seq, grpc.StatusCode.DEADLINE_EXCEEDED,
                                            f"sequence {seq} timed out (sequenceMaxIdleMSec / "
                                            "sequenceTimeoutMSec)")
                    return
                async for response in self._sequence_request(request, opened, headers, context):
                    yield response
        finally:
            for seq, model in opened.items():
                model.close_sequence(seq)

    async def _sequence_request(self, request: inference_pb2.PredictionsRequest, opened: dict[str, Any],
                                headers: dict[str, str],
                                context: grpc.aio.ServicerContext) -> AsyncIterator[PredictionResponse]:
        if isinstance(request, Malformed):
            yield self._in_band("", grpc.StatusCode.INVALID_ARGUMENT,
                                f"request message does not parse: {request.error}")
            return
        seq = request.sequence_id if request.HasField("sequence_id") else ""
        inputs = dict(request.input)
        try:
            if not seq:
                if not _flag(inputs, SEQ_START):
                    raise InvalidArgument("Parameter sequenceId is required.", reason="SEQUENCE_ID_REQUIRED")
                seq = new_sequence_id()
            model = opened.get(seq) or self.core.open_sequence(request.model_name, request.model_version, seq)
            opened[seq] = model
            seq_headers = dict(headers)
            seq_headers[SEQ_ID] = seq  # as TorchServe, so handlers find it with context.header_key_sequence_id
            for key in (SEQ_START, SEQ_END):
                if key in inputs:
                    seq_headers[key] = bytes(inputs[key]).decode("utf-8", "replace")
            async for payload, _final in self.core.stream(request.model_name, model.version, inputs, seq_headers,
                                                  context.time_remaining(), sequence_id=seq):
                yield PredictionResponse(prediction=payload, sequence_id=seq)
        except InferenceError as exc:
            yield self._in_band(seq, *refusal(self, exc, "StreamPredictions2", request, in_band=True))
        if seq and _flag(inputs, SEQ_END) and seq in opened:
            opened.pop(seq).close_sequence(seq)

    @staticmethod
    def _in_band(seq: str, code: grpc.StatusCode, message: str) -> PredictionResponse:
        response = PredictionResponse(status=status_pb2.Status(code=code.value[0], message=message))
        if seq:
            response.sequence_id = seq
        return response


def health_json(healthy: bool) -> str:
    """Ping's JSON text."""
    return json.dumps({"status": "Healthy" if healthy else "Unhealthy", "code": 200 if healthy else 500})
