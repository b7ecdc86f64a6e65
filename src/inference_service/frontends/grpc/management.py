"""``org.pytorch.serve.grpc.management.ManagementAPIsService`` over :class:`InferenceCore`."""

from __future__ import annotations

import json

import grpc

from inference_service._proto import management_pb2, management_pb2_grpc
from inference_service.contracts.torchserve_status import TORCHSERVE
from inference_service.errors import PermissionDenied
from inference_service.frontends.grpc.base import unary
from inference_service.frontends.torchserve_json import (
    describe_json,
    register_status,
    scale_status,
    unregister_status,
)
from inference_service.observability.metrics import Telemetry
from inference_service.serving.core import InferenceCore
from inference_service.serving.registration import RegisterRequest

ManagementResponse = management_pb2.ManagementResponse


class ManagementServicer(management_pb2_grpc.ManagementAPIsServiceServicer):
    """TorchServe's management API.

    ``ManagementResponse.msg`` is TorchServe's plain status text for RegisterModel,
    UnregisterModel, ScaleWorker and SetDefault (e.g. ``Model "echo" unregistered``, as its
    ``ManagementImpl.sendStatusResponse`` sends it), and JSON for DescribeModel and ListModels.

    Args:
        core: the serving core.
        model_api_enabled: whether RegisterModel/UnregisterModel are allowed
            (PERMISSION_DENIED "Model API disabled", TorchServe's text, otherwise).
        telemetry: where RPCs are counted and access-logged (``None``: nowhere).
        status_codes: ``grpc_status_codes`` (``"torchserve"``: TorchServe 0.12's codes, see
            :func:`~inference_service.frontends.grpc.base.refusal`, and its ScaleWorker counts).
    """

    def __init__(self, core: InferenceCore, model_api_enabled: bool = True,
                 telemetry: Telemetry | None = None, status_codes: str = "default") -> None:
        self.core = core
        self.model_api_enabled = model_api_enabled
        self.telemetry = telemetry
        self.status_codes = status_codes

    def _check_model_api(self) -> None:
        if not self.model_api_enabled:
            raise PermissionDenied("Model API disabled: start the server with --enable-model-api",
                                   reason="MODEL_API_DISABLED")

    @unary
    async def RegisterModel(self, request: management_pb2.RegisterModelRequest,
                            context: grpc.aio.ServicerContext) -> ManagementResponse:
        """Register an archive from the model store or an allowed URL (TorchServe's RegisterModel).

        Status: INVALID_ARGUMENT (bad url/fields/archive, workflows), NOT_FOUND
        (no such archive), FAILED_PRECONDITION (version exists), INTERNAL
        (synchronous and the worker failed to load: the handler's message),
        PERMISSION_DENIED (Model API disabled, or a URL ``allowed_urls`` does
        not allow), UNAVAILABLE / DEADLINE_EXCEEDED (a download failed or took
        longer than ``download_timeout``).
        """
        self._check_model_api()
        model = await self.core.register(RegisterRequest(
            url=request.url, model_name=request.model_name, handler=request.handler,
            runtime=request.runtime, batch_size=request.batch_size,
            max_batch_delay=request.max_batch_delay, initial_workers=request.initial_workers,
            response_timeout=request.response_timeout, startup_timeout=request.startup_timeout,
            synchronous=request.synchronous))
        return ManagementResponse(msg=register_status(model, request.synchronous))

    @unary
    async def UnregisterModel(self, request: management_pb2.UnregisterModelRequest,
                              context: grpc.aio.ServicerContext) -> ManagementResponse:
        """Remove a version (default if none given). Status: NOT_FOUND, FAILED_PRECONDITION
        (removing the default while other versions exist)."""
        self._check_model_api()
        await self.core.unregister(request.model_name, request.model_version)
        return ManagementResponse(msg=unregister_status(request.model_name))

    @unary
    async def ScaleWorker(self, request: management_pb2.ScaleWorkerRequest,
                          context: grpc.aio.ServicerContext) -> ManagementResponse:
        """Set the number of workers. Status: NOT_FOUND, INVALID_ARGUMENT, INTERNAL (load failure).

        With ``grpc_status_codes=torchserve`` the counts are read as TorchServe's ScaleWorker reads
        them (``GRPCUtils.getRegisterParam``): ``min_worker`` at or below 0 is 1, ``max_worker`` at
        or below 0 is ``min_worker``.
        """
        min_worker, max_worker = request.min_worker, request.max_worker
        if self.status_codes == TORCHSERVE:
            min_worker = min_worker if min_worker > 0 else 1
            max_worker = max_worker if max_worker > 0 else min_worker
        model = await self.core.scale(request.model_name, request.model_version, min_worker,
                                      max_worker, request.synchronous, request.timeout,
                                      request.number_gpu)
        return ManagementResponse(msg=scale_status(model, request.model_version, request.synchronous))

    @unary
    async def SetDefault(self, request: management_pb2.SetDefaultRequest,
                         context: grpc.aio.ServicerContext) -> ManagementResponse:
        """Make a version the default. Status: NOT_FOUND, INVALID_ARGUMENT."""
        self.core.set_default(request.model_name, request.model_version)
        return ManagementResponse(msg=f'Default version successfully updated for model "{request.model_name}" '
                                      f'to "{request.model_version}"')

    @unary
    async def DescribeModel(self, request: management_pb2.DescribeModelRequest,
                            context: grpc.aio.ServicerContext) -> ManagementResponse:
        """JSON array, one object per version, with TorchServe's keys. Status: NOT_FOUND."""
        return ManagementResponse(msg=describe_json(self.core.versions(request.model_name,
                                                                       request.model_version)))

    @unary
    async def ListModels(self, request: management_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> ManagementResponse:
        """``{"nextPageToken"?, "models": [...]}`` sorted by name; limit 0 means 100."""
        return ManagementResponse(msg=json.dumps(
            self.core.list_models(request.limit, request.next_page_token), indent=2))
