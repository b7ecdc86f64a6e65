"""The model registry's plain parts: RegisterModel's request, one model's versions, version
order and names, and the preparation of a new version (archive, name, handler, config).

``InferenceCore`` (``core.py``) owns the registry and its locking; what does not need the
running server lives here.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from inference_service.archive.model_archive import ModelArchive, install_requirements, open_archive
from inference_service.config import Settings
from inference_service.errors import InvalidArgument, shorten
from inference_service.serving.model_config import ModelConfig
from inference_service.serving.model_version import ModelVersion

log = logging.getLogger(__name__)


def version_key(version: str) -> tuple[int, ...] | None:
    """``"10.0"`` -> ``(10, 0)``: a version of dot-separated integers as a tuple that orders
    numerically ("9.0" before "10.0"); ``None`` for anything else ("1.0a", "latest")."""
    parts = version.split(".")
    if not all(p.isdigit() and p.isascii() for p in parts):
        return None
    return tuple(int(p) for p in parts)


def newest_version(versions: Iterable[str]) -> str:
    """The fallback default version: the numerically highest dot-separated-integer one
    (:func:`version_key`), else the last registered."""
    ordered = list(versions)
    numeric = [(key, i) for i, v in enumerate(ordered) if (key := version_key(v)) is not None]
    return ordered[max(numeric)[1]] if numeric else ordered[-1]


@dataclass
class RegisterRequest:
    """RegisterModel's fields (0 / "" mean unset, as in proto3)."""

    url: str
    model_name: str = ""
    handler: str = ""
    runtime: str = ""
    batch_size: int = 0
    max_batch_delay: int = 0
    initial_workers: int = 0
    response_timeout: int = 0
    startup_timeout: int = 0
    startup_timeout_zero: bool = False  # HTTP's startup_timeout=0, read as is (see prepare_version)
    synchronous: bool = False
    loaded_at_startup: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelEntry:
    """All versions of one model name and which is the default."""

    versions: dict[str, ModelVersion] = field(default_factory=dict)
    default_version: str = ""


def list_models_page(models: Mapping[str, ModelEntry], limit: int, next_page_token: int) -> dict[str, Any]:
    """One page of TorchServe's ListModels JSON, names sorted, the default version's URL; never raises.
    ``limit`` outside 1..100 means 100 (TorchServe answers an empty page for 0, which proto3 cannot
    tell from unset); a negative ``next_page_token`` is 0, as TorchServe."""
    if limit <= 0 or limit > 100:  # TorchServe's ApiUtils.getModelList: outside 1..100 means 100
        limit = 100
    next_page_token = max(0, next_page_token)  # as TorchServe: a negative token is the first page
    names = sorted(models)
    page = names[next_page_token : next_page_token + limit]
    result: dict[str, Any] = {}
    if next_page_token + limit < len(names):
        result["nextPageToken"] = str(next_page_token + limit)
    result["models"] = [
        {"modelName": n, "modelUrl": models[n].versions[models[n].default_version].archive.url} for n in page
    ]
    return result


def valid_model_name(name: str) -> bool:
    """Letters, digits, ``_``, ``-`` and ``.``, 1 to 256 ASCII characters (a name becomes part
    of file paths, metric labels and URLs)."""
    return 0 < len(name) <= 256 and all(c.isalnum() or c in "_-." for c in name) and name.isascii()


@dataclass
class PreparedVersion:
    """A model version ready to be registered; the caller removes ``archive`` if registration fails.
    ``name`` and ``handler`` are the request's, else the manifest's."""

    archive: ModelArchive
    name: str
    handler: str
    config: ModelConfig
    extra_paths: list[str]


#: Fields refused when negative (0 means unset, as in proto3), with the setting they override.
_REFUSED_NEGATIVE = ("batch_size", "max_batch_delay", "response_timeout", "startup_timeout")


def _checked_request(req: RegisterRequest) -> RegisterRequest:
    """``req`` checked: 0 is unset (proto3), and a negative ``initial_workers`` too, as TorchServe's
    ``GRPCUtils.getRegisterParam`` reads it (its test data sends ``-1``).

    Raises:
        InvalidArgument: a runtime other than python, or a negative ``batch_size``,
            ``max_batch_delay``, ``response_timeout`` or ``startup_timeout`` (TorchServe silently
            takes its default).
    """
    if req.runtime and req.runtime != "python":
        raise InvalidArgument(f"runtime {req.runtime!r} is not supported (only python)", reason="RUNTIME")
    for name in _REFUSED_NEGATIVE:
        if getattr(req, name) < 0:
            low, high = ModelConfig.LIMITS[_CONFIG_FIELD[name]]
            raise InvalidArgument(f"{name} must be 0 (unset) or from {max(low, 1)} to {high}, "
                                  f"got {getattr(req, name)}")
    return replace(req, initial_workers=max(0, req.initial_workers))


_CONFIG_FIELD = {"batch_size": "batch_size", "max_batch_delay": "max_batch_delay_ms",
                 "response_timeout": "response_timeout_s", "startup_timeout": "startup_timeout_s"}


async def prepare_version(settings: Settings, req: RegisterRequest, extract_dir: Path) -> PreparedVersion:
    """Open the request's archive (in a thread) and resolve the version's settings, the first half of
    TorchServe's RegisterModel: request fields over model-config.yaml over the server's defaults;
    installs ``requirements.txt`` under ``install_py_dep_per_model``. On error the extracted
    archive is removed.

    Raises:
        InvalidArgument: bad runtime, URL, archive, manifest, name or config.
        PermissionDenied: a remote URL ``allowed_urls`` does not allow.
        NotFound: no such archive in the store.
    """
    req = _checked_request(req)
    archive = await asyncio.to_thread(open_archive, req.url, settings.model_store, extract_dir,
                                      settings.max_archive_bytes, settings.url_policy)
    try:
        name = req.model_name or archive.model_name
        if not name:
            raise InvalidArgument("model_name is required (the manifest has no modelName)")
        if not valid_model_name(name):
            raise InvalidArgument(
                f"invalid model name {shorten(repr(name), 100)}: use letters, digits, '_', '-' and '.' (at most 256)")
        defaults = {
            "response_timeout_s": settings.default_response_timeout_s,
            "startup_timeout_s": settings.default_startup_timeout_s,
            "job_queue_size": settings.job_queue_size,
            "max_backoff_s": settings.max_backoff_s,
            "worker_threads": settings.worker_threads,
            "worker_wait_policy": settings.worker_omp_wait_policy,
        }
        if req.loaded_at_startup and "minWorkers" not in archive.config:
            defaults["min_workers"] = settings.default_workers_per_model
        overrides = {
            "batch_size": req.batch_size,
            "max_batch_delay_ms": req.max_batch_delay,
            "response_timeout_s": req.response_timeout,
            "startup_timeout_s": req.startup_timeout,
            "min_workers": req.initial_workers,
            **req.extra,
        }
        config = ModelConfig.resolve(archive.config, overrides, defaults)
        if req.startup_timeout_zero and not archive.manifest.get("model", {}).get("configFile"):
            # TorchServe's REST API keeps startup_timeout=0 for an archive without model-config.yaml:
            # its workers get no time to load (its gRPC API and a model-config.yaml read 0 as unset)
            config = replace(config, startup_timeout_s=0)
        extra_paths = []
        if (archive.model_dir / "requirements.txt").is_file():
            if settings.install_py_dep_per_model:
                deps = await asyncio.to_thread(install_requirements, archive, sys.executable)
                if deps:
                    extra_paths.append(deps)
            else:
                log.info("model %s: requirements.txt ignored (install_py_dep_per_model=false)", name)
        return PreparedVersion(archive, name, req.handler or archive.handler, config, extra_paths)
    except BaseException:
        archive.remove()
        raise
