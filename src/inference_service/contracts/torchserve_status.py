"""TorchServe 0.12's refusals: the gRPC code and message, and the HTTP management API's status and
error type, it answers where this server refuses.

Used when ``grpc_status_codes: torchserve`` / ``http_management_status_codes: torchserve`` is set
(docs/torchserve-compatibility.md).
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from inference_service.errors import InferenceError

#: ``grpc_status_codes`` values: this server's codes, or TorchServe 0.12's.
STATUS_CODES = ("default", "torchserve")
TORCHSERVE = "torchserve"
#: The inference RPCs: TorchServe answers their refusals INTERNAL where its management RPCs
#: answer NOT_FOUND (its ``InferenceImpl.prediction`` and ``OpenInferenceProtocolImpl.modelInfer``).
INFERENCE_RPCS = frozenset({"Predictions", "StreamPredictions", "StreamPredictions2", "ModelInfer"})
#: grpc-java's status of an exception the servicer did not catch (TorchServe's
#: ``ConflictStatusException`` and ``InvalidModelVersionException`` reach it).
UNCAUGHT = (grpc.StatusCode.UNKNOWN, "Application error processing RPC")
_JAVA = "org.pytorch.serve."
_MODEL_NOT_FOUND = _JAVA + "archive.model.ModelNotFoundException"
_VERSION_NOT_FOUND = _JAVA + "archive.model.ModelVersionNotFoundException"
_MODEL_EXCEPTION = _JAVA + "archive.model.ModelException"
_BAD_REQUEST = _JAVA + "http.BadRequestException"
_INTERNAL_SERVER = _JAVA + "http.InternalServerException"
_DOWNLOAD = _JAVA + "archive.DownloadArchiveException"
_INFERENCE = grpc.StatusCode.INTERNAL  # every refusal of InferenceImpl.prediction


def _no_worker_message(name: str, version: str) -> str:
    """``ApiUtils.getStreamingInferenceErrorResponseMessage``."""
    shown = f'Model "{name}' + (f'" Version {version}' if version else "")
    return (shown + '" has no worker to serve inference request. Please use scale workers API to add '
            "workers. If this is a sequence inference, please check if it is closed, or expired; or "
            "exceeds maxSequenceJobQueueSize")


def torchserve_status(error: InferenceError, method: str, request: object = None,
                      in_band: bool = False) -> tuple[grpc.StatusCode, str]:
    """The code and message TorchServe 0.12 answers where this server refuses with ``error``.

    Read from TorchServe 0.12's frontend: ``InferenceImpl``, ``ManagementImpl``,
    ``OpenInferenceProtocolImpl`` (the Open Inference Protocol's ModelReady, ModelMetadata, ModelInfer),
    ``GRPCInterceptor``, ``GRPCJob.sendError``, ``ApiUtils``, ``ModelManager``,
    ``ModelVersionedRefs``, ``ModelArchive`` and ``WorkerThread``. Its messages end with a line
    naming the Java exception (``Status.augmentDescription``), reproduced here; ``in_band``
    (``StreamPredictions2``'s ``PredictionResponse.status``) carries the message alone, as TorchServe.
    An ``error.reason`` TorchServe has no refusal for keeps this server's code and message.

    Args:
        error: the refusal, as this server raises it (its ``reason`` selects the row).
        method: the RPC's name (``Predictions``, ``RegisterModel``, ...).
        request: the RPC's request message; its ``model_name`` (or ``name``), ``model_version`` (or
            ``version``), ``url`` and ``runtime`` fields, where it has them, are quoted as
            TorchServe's messages quote them.
        in_band: the status goes in a response message, not the call's status.
    """
    reason = error.reason
    inference = method in INFERENCE_RPCS
    name, version, url, runtime, short_name, short_version = (
        str(getattr(request, field, "") or "")
        for field in ("model_name", "model_version", "url", "runtime", "name", "version"))
    name, version = name or short_name, version or short_version or error.model_version or ""

    def java(code: grpc.StatusCode, message: str, exception: str) -> tuple[grpc.StatusCode, str]:
        return code, message if in_band else f"{message}\n{exception}"

    if reason == "UNAUTHENTICATED":  # GRPCInterceptor
        return grpc.StatusCode.PERMISSION_DENIED, (
            "Token Authorization failed. Token either incorrect, expired, or not provided correctly")
    if reason == "MODEL_API_DISABLED":
        return java(grpc.StatusCode.PERMISSION_DENIED, "Model API disabled", _MODEL_EXCEPTION)
    if reason == "MODEL_NAME_REQUIRED":
        if method == "ModelReady":  # sic: OpenInferenceProtocolImpl.modelReady's text
            return java(_INFERENCE, "Parameter name is required.", "BadRequestException.()")
        if inference or method == "ModelMetadata":
            return java(_INFERENCE, "Parameter model_name is required.", "BadRequestException.()")
        if method == "UnregisterModel":  # sic: ManagementImpl.unregisterModel's text
            return java(grpc.StatusCode.INVALID_ARGUMENT, "Parameter url is required.", _BAD_REQUEST)
        return java(grpc.StatusCode.NOT_FOUND, "Model not found: " + ("null" if method == "ScaleWorker" else ""),
                    _MODEL_NOT_FOUND)
    if reason == "MODEL_NOT_FOUND":
        return java(_INFERENCE if inference else grpc.StatusCode.NOT_FOUND, f"Model not found: {name}",
                    _MODEL_NOT_FOUND)
    if reason == "VERSION_NOT_FOUND":
        if method == "SetDefault":  # ModelVersionedRefs.setDefaultVersion
            return java(grpc.StatusCode.NOT_FOUND, f"Model version {version} does not exist for model {name}",
                        _VERSION_NOT_FOUND)
        return java(_INFERENCE if inference else grpc.StatusCode.NOT_FOUND,
                    f"Model version: {version} does not exist for model: {name}", _VERSION_NOT_FOUND)
    if reason == "VERSION_REQUIRED":  # SetDefault without a version: no version "" exists
        return java(grpc.StatusCode.NOT_FOUND, f"Model version  does not exist for model {name}", _VERSION_NOT_FOUND)
    if reason in ("NO_WORKER", "JOB_QUEUE_FULL", "MODEL_LOAD_FAILED") and inference:
        return java(_INFERENCE, _no_worker_message(name, version), "InternalServerException.()")
    if reason == "MODEL_LOAD_FAILED":  # a synchronous RegisterModel / ScaleWorker: ApiUtils.updateModelWorkers
        return java(grpc.StatusCode.INTERNAL,
                    f"Failed to start workers for model {name} version: {version or 'null'}", _INTERNAL_SERVER)
    if reason in ("WORKER_DIED", "RESPONSE_TIMEOUT"):  # WorkerThread: the worker is replaced
        return java(grpc.StatusCode.INTERNAL, "Worker died.", _INTERNAL_SERVER)
    if reason == "HANDLER_ERROR":  # ts/service.py: 507 for CUDA errors, 503 for anything else
        if "CUDA" in error.message:
            return java(grpc.StatusCode.INTERNAL, "CUDA out of memory", _INTERNAL_SERVER)
        return java(grpc.StatusCode.UNAVAILABLE, "Prediction failed", _INTERNAL_SERVER)
    if reason == "HANDLER_STATUS":
        return java(error.code, error.message, _INTERNAL_SERVER)
    if reason == "SEQUENCE_ID_REQUIRED":  # InferenceImpl.streamPredictions2
        return java(_INFERENCE, "Parameter sequenceId is required.", "BadRequestException.()")
    if reason == "URL_REQUIRED":
        return java(grpc.StatusCode.INVALID_ARGUMENT, "Parameter url is required.", _BAD_REQUEST)
    if reason == "DOWNLOAD_FAILED":  # ArchiveUtils.downloadArchive: any IOException
        return java(grpc.StatusCode.INVALID_ARGUMENT, f"Failed to download archive from: {url}", _DOWNLOAD)
    if reason == "ARCHIVE_NOT_FOUND":
        return java(grpc.StatusCode.NOT_FOUND, f"Model not found at: {url}", _MODEL_NOT_FOUND)
    if reason == "URL_NOT_ALLOWED":
        return java(grpc.StatusCode.NOT_FOUND, f"Given URL {url} does not match any allowed URL(s)",
                    _MODEL_NOT_FOUND)
    if reason == "RELATIVE_PATH":
        return java(grpc.StatusCode.NOT_FOUND, f"Relative path is not allowed in url: {url}", _MODEL_NOT_FOUND)
    if reason == "RUNTIME":
        return java(grpc.StatusCode.INVALID_ARGUMENT, f"Invalid RuntimeType value: {runtime}", _BAD_REQUEST)
    if reason == "MAX_BELOW_MIN":
        return java(grpc.StatusCode.INVALID_ARGUMENT, "max_worker cannot be less than min_worker.", _BAD_REQUEST)
    if reason == "VERSION_REGISTERED":
        if url.lower().startswith(("http://", "https://")):  # the download finds its file in the store
            filename = url.rstrip("/").rsplit("/", 1)[-1]
            return java(grpc.StatusCode.INTERNAL, f"Model file already exists {filename}", _INTERNAL_SERVER)
        return UNCAUGHT  # ModelVersionedRefs' ConflictStatusException
    if reason == "DEFAULT_VERSION":  # ApiUtils.unregisterModel's InvalidModelVersionException
        return UNCAUGHT
    return error.code, error.message


#: The HTTP management API's status and error type for a missing or wrong key (TorchServe's
#: ``InvalidKeyException``, a ``ModelException``, is 400 in its ``HttpRequestHandler``).
HTTP_TOKEN_REFUSAL = (400, "InvalidKeyException")


def torchserve_http_status(error: InferenceError, params: Mapping[str, str]) -> tuple[int, str] | None:
    """The status and error type TorchServe 0.12's HTTP management API answers where this server
    refuses with ``error``; ``None`` where they are this server's.

    Read from TorchServe 0.12's ``HttpRequestHandler`` (its exception-to-status table),
    ``ManagementRequestHandler``, ``ApiUtils``, ``ModelArchive.downloadModel``, ``HttpUtils``,
    ``ArchiveUtils`` and ``WorkLoadManager.modelChanged``, and checked against its regression data
    (``test/postman/management_data.json``).

    Args:
        error: the refusal, as this server raises it (its ``reason`` selects the row).
        params: the request's parameters (the query, or RegisterModel's JSON body); ``url``,
            ``min_worker`` and ``max_worker`` are read as TorchServe reads them.
    """
    reason = error.reason
    url = params.get("url")
    if reason == "URL_REQUIRED" and url is not None:  # ModelArchive.downloadModel: "empty url"
        return 404, "ModelNotFoundException"
    if reason in ("URL_NOT_ALLOWED", "RELATIVE_PATH"):  # InvalidArchiveURLException, read as not found
        return 404, "ModelNotFoundException"
    if reason == "DOWNLOAD_FAILED":  # a 404, an unreachable host, a cut download: DownloadArchiveException
        return 400, "DownloadArchiveException"
    if reason == "MODEL_FILE_EXISTS":  # ArchiveUtils.downloadArchive, before downloading
        return 500, "InternalServerException"
    if reason == "VERSION_REGISTERED" and (url or "").lower().startswith(("http://", "https://")):
        return 500, "InternalServerException"  # ApiUtils.handleRegister: "Model file already exists"
    if reason == "WORKER_COUNT":
        min_worker = int(params.get("min_worker") or 1)
        max_worker = int(params.get("max_worker") or min_worker)
        if min_worker <= max_worker < 0:  # WorkLoadManager.modelChanged removes worker -1
            return 500, "IndexOutOfBoundsException"
    return None
