"""Config snapshots: registered models survive a restart, even after ``kill -9``.

As TorchServe's snapshot feature: after every change of the registered models the server writes
``<working dir>/logs/config/<timestamp>-snapshot.cfg`` atomically, in TorchServe's layout (a
``model_snapshot`` JSON property); the newest ``KEEP`` are kept. See docs/operations.md.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import javaproperties

from inference_service.serving.core import InferenceCore
from inference_service.serving.registration import RegisterRequest

log = logging.getLogger(__name__)

KEEP = 5
SUFFIX = "-snapshot.cfg"


class SnapshotError(Exception):
    """A snapshot file cannot be read or parsed (the message names the file)."""


@dataclass
class SnapshotModel:
    """One model version recorded in a snapshot."""

    name: str
    version: str
    default: bool
    request: RegisterRequest
    max_workers: int


def snapshot_models(snapshot: dict[str, Any]) -> list[SnapshotModel]:
    """The model versions of a ``model_snapshot`` JSON object, as startup requests (TorchServe's
    ``SnapshotManager.restore``). Raises KeyError, TypeError or ValueError when malformed."""
    out = []
    for name, versions in snapshot["models"].items():
        for version, rec in versions.items():
            req = RegisterRequest(
                url=str(rec["marName"]), model_name=str(name), handler=str(rec.get("handler", "")),
                batch_size=int(rec.get("batchSize", 0)), max_batch_delay=int(rec.get("maxBatchDelay", 0)),
                initial_workers=int(rec.get("minWorkers", 0)), response_timeout=int(rec.get("responseTimeout", 0)),
                startup_timeout=int(rec.get("startupTimeout", 0)), loaded_at_startup=True)
            out.append(SnapshotModel(str(name), str(version), bool(rec.get("defaultVersion")), req,
                                     int(rec.get("maxWorkers", 0))))
    return out


class SnapshotStore:
    """Snapshot files in ``directory`` (``<working dir>/logs/config``)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def files(self) -> list[Path]:
        """Snapshot files, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted(self.directory.glob(f"*{SUFFIX}"))

    def latest(self) -> Path | None:
        """The newest snapshot file, or ``None``."""
        files = self.files()
        return files[-1] if files else None

    def save(self, core: InferenceCore, model_store: Path | None) -> Path:
        """Write the current registry atomically and prune old files; returns the new file (OSError passes)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        now_us = time.time_ns() // 1000  # one clock read: seconds and microseconds always agree
        name = time.strftime("%Y%m%d%H%M%S", time.localtime(now_us // 1_000_000)) + f"{now_us % 1_000_000:06d}"
        for existing in self.files()[-1:]:  # never sort before the previous one (clock steps)
            if existing.name[:-len(SUFFIX)] >= name:
                name = str(int(existing.name[:-len(SUFFIX)]) + 1)
        name += SUFFIX
        models: dict[str, dict[str, Any]] = {}
        for model_name, entry in sorted(core.models.items()):
            for version, model in sorted(entry.versions.items()):
                record: dict[str, Any] = {
                    "defaultVersion": version == entry.default_version,
                    "marName": model.archive.url,
                    **model.config.torchserve_fields(),
                }
                if model.handler != model.archive.handler:
                    record["handler"] = model.handler
                models.setdefault(model_name, {})[version] = record
        snapshot = {"name": name, "modelCount": len(models), "models": models}
        props = {"model_snapshot": json.dumps(snapshot)}
        if model_store is not None:
            props["model_store"] = str(model_store)
        path = self.directory / name
        # a new temporary file (O_EXCL: a link planted in its place is never written through)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=self.directory)
        try:
            with open(fd, "w", encoding="utf-8") as f:
                javaproperties.dump(props, f, timestamp=False)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        for old in self.files()[:-KEEP]:
            old.unlink(missing_ok=True)
        return path

    def load(self, path: Path) -> list[SnapshotModel]:
        """Parse a snapshot file; SnapshotError when unreadable or malformed."""
        try:
            with open(path, encoding="utf-8") as f:
                props = javaproperties.load(f)
            return snapshot_models(json.loads(props["model_snapshot"]))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SnapshotError(f"snapshot {path} is unreadable: {type(exc).__name__}: {exc}") from exc

    def set_aside(self, path: Path) -> Path:
        """Rename a bad snapshot to ``<name>.corrupt`` so it is not tried again."""
        target = path.with_name(path.name + ".corrupt")
        os.replace(path, target)
        return target
