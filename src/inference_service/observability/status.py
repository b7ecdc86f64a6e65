"""The instance's status file, ``<instance dir>/status.json``: written by the server, read by
``--start`` (:mod:`inference_service.launch.launcher`), scripts and tests.

Rewritten atomically (:func:`write_json_atomic`) on every change, deleted when the server has
stopped. Each startup model (keyed by ``startup_key()``) has a ``state`` of :data:`STARTUP_STATES`.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Protocol

#: The status file's name in the instance directory.
STATUS_FILE_NAME = "status.json"

REGISTERING = "registering"  # archive, config, requirements not done yet
REGISTERED = "registered"  # model_name and version set; minimum workers not all READY
READY = "ready"  # minimum workers READY (TorchServe's Ping rule)
FAILED = "failed"  # with "error": registration failed, or every live worker's latest load failed
UNREGISTERED = "unregistered"  # registered, then unregistered
#: Every state a startup model can be in.
STARTUP_STATES = (REGISTERING, REGISTERED, READY, FAILED, UNREGISTERED)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` through a new temporary file (0600, ``O_EXCL``: a planted link
    is never written through), then rename. OSError / TypeError pass through."""
    text = json.dumps(data, indent=2)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def read_status(path: Path) -> dict[str, Any] | None:
    """The status file's content; ``None`` when it does not exist (yet, or any more) or is not a
    JSON object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def startup_key(ident: str, version: str = "") -> str:
    """The ``models`` map key: ``ident`` (a ``load_models`` name or URL, a snapshot model's name), or
    ``"ident/version"`` for a snapshot model (a snapshot may hold several versions)."""
    return f"{ident}/{version}" if version else ident


class VersionView(Protocol):
    """What :class:`StartupModels` reads of a registered model version
    (:class:`inference_service.serving.model_version.ModelVersion` has it)."""

    name: str
    version: str
    closed: bool

    @property
    def healthy(self) -> bool:
        """Its minimum workers are READY."""

    def load_error(self) -> str | None:
        """Why no worker can serve (every live worker's latest start failed to load), else ``None``."""


class StartupModels:
    """The startup models' states as the status file's ``models`` map; :meth:`as_json` derives a
    registered model's state from its workers on each call."""

    def __init__(self) -> None:
        self._failed: dict[str, str] = {}
        self._versions: dict[str, VersionView | None] = {}  # None: registering

    def registering(self, key: str) -> None:
        """``key``'s registration starts."""
        self._versions[key] = None
        self._failed.pop(key, None)

    def registered(self, key: str, version: VersionView) -> None:
        """``key`` is registered as ``version``; its state follows its workers from now on."""
        self._versions[key] = version
        self._failed.pop(key, None)

    def failed(self, key: str, error: str) -> None:
        """``key`` could not register: ``error`` says why."""
        self._versions[key] = None
        self._failed[key] = error

    @property
    def any_failed(self) -> bool:
        """Whether a startup model could not be registered (readiness then stays NOT_SERVING)."""
        return bool(self._failed)

    def as_json(self) -> dict[str, dict[str, Any]]:
        """``{key: {"state": ..., ["model_name", "version"], ["error"]}}``, in registration order."""
        out: dict[str, dict[str, Any]] = {}
        for key, version in self._versions.items():
            if version is None:
                error = self._failed.get(key)
                out[key] = {"state": REGISTERING} if error is None else {"state": FAILED, "error": error}
                continue
            entry: dict[str, Any] = {"state": REGISTERED, "model_name": version.name, "version": version.version}
            if version.closed:
                entry["state"] = UNREGISTERED
            elif version.healthy:
                entry["state"] = READY
            elif (error := version.load_error()) is not None:
                entry.update(state=FAILED, error=error)
            out[key] = entry
        return out
