"""The models a server registers at start: config.properties' ``model_snapshot`` (as TorchServe,
``load_models`` and ``--models`` are then ignored), else the latest config snapshot's, when it is
to be restored, and the ``--models`` / ``load_models`` entries with their settings from
config.properties' ``models`` JSON. See docs/configuration.md.
"""

from __future__ import annotations

import logging
from pathlib import Path

from inference_service.archive.model_archive import MANIFEST
from inference_service.config import Settings
from inference_service.serving.registration import RegisterRequest
from inference_service.serving.snapshot import SnapshotError, SnapshotModel, SnapshotStore, snapshot_models

log = logging.getLogger(__name__)

# models JSON (config.properties) key -> RegisterRequest field
_MODELS_JSON_KEYS = {
    "minWorkers": "initial_workers",
    "batchSize": "batch_size",
    "maxBatchDelay": "max_batch_delay",
    "responseTimeout": "response_timeout",
    "startupTimeout": "startup_timeout",
}


def snapshot_to_restore(settings: Settings, snapshots: SnapshotStore) -> list[SnapshotModel] | None:
    """config.properties' ``model_snapshot``, or the models of the latest snapshot when it is to be
    restored (see :mod:`.snapshot`): not with ``--ncs``, ``--ts-config`` or ``--models``. A snapshot
    file that cannot be read is set aside."""
    if settings.model_snapshot is not None:  # checked when config.properties was read
        models = snapshot_models(settings.model_snapshot)
        log.info("starting the %d model versions of config.properties' model_snapshot", len(models))
        return models
    latest = snapshots.latest()
    if latest is None:
        return None
    reason = ("--ncs" if not settings.snapshot else "--ts-config" if settings.ts_config is not None
              else "--models" if settings.load_models else None)
    if reason is not None:
        log.warning("config snapshot %s not restored because %s was given", latest, reason)
        return None
    try:
        models = snapshots.load(latest)
    except SnapshotError as exc:
        aside = snapshots.set_aside(latest)
        log.error("%s; kept aside as %s; starting without it", exc, aside.name)
        return None
    log.info("restoring %d model versions from config snapshot %s", len(models), latest)
    return models


def startup_requests(settings: Settings) -> list[RegisterRequest]:
    """One RegisterModel request per ``load_models`` entry (``"all"``: every archive in the model
    store), with the settings the ``models`` JSON gives its model; none beside a ``model_snapshot``."""
    entries = list(settings.load_models)
    if settings.model_snapshot is not None:
        if entries:
            log.warning("load_models / --models %s ignored: config.properties' model_snapshot names the startup "
                        "models (as TorchServe)", ",".join(entries))
        return []
    if entries == ["all"] or "all" in entries:
        store = settings.model_store
        entries = sorted(
            p.name for p in (store.iterdir() if store and store.is_dir() else [])
            if p.suffix == ".mar" or p.name.endswith((".tar.gz", ".tgz"))
            or (p.is_dir() and (p / MANIFEST).is_file())
        )
    requests = []
    for entry in entries:
        name, sep, url = entry.partition("=")
        if not sep:
            name, url = "", entry
        req = RegisterRequest(url=url.strip(), model_name=name.strip(), loaded_at_startup=True)
        lookup = req.model_name or Path(req.url).name.split(".")[0]
        for version_config in (settings.models_config.get(lookup) or {}).values():
            if not isinstance(version_config, dict):
                continue
            if version_config.get("marName") not in (None, req.url):
                continue
            for key, attr in _MODELS_JSON_KEYS.items():
                if key in version_config:
                    setattr(req, attr, int(version_config[key]))
            if "maxWorkers" in version_config:
                req.extra["max_workers"] = int(version_config["maxWorkers"])
        requests.append(req)
    return requests
