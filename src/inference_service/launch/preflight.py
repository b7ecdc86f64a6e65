"""Checks made before a server starts, so that a start that cannot work is refused at once
with the cause (exit 1) instead of leaving a server behind that logs it.

The ports are checked by :mod:`inference_service.launch.ports`.
"""

from __future__ import annotations

from inference_service.config import Settings


def model_store_problem(settings: Settings) -> str | None:
    """TorchServe's refusal of a model store that is not a directory (``ts/model_server.py``):
    ``"--model-store directory not found: /path"``, or ``None`` when there is none to check."""
    store = settings.model_store
    if store is not None and not store.is_dir():
        return f"--model-store directory not found: {store}"
    return None


def startup_problems(settings: Settings) -> list[str]:
    """``["startup model NAME: <the archive error>", ...]`` for each ``load_models`` archive in the store
    that is missing or unreadable (server's rules; remote URLs and snapshots left to the server)."""
    from inference_service.archive.model_archive import MANIFEST, is_remote_url, read_manifest, resolve_in_store
    from inference_service.errors import InferenceError

    store = settings.model_store
    entries = list(settings.load_models)
    if "all" in entries:
        entries = sorted(p.name for p in (store.iterdir() if store is not None and store.is_dir() else [])
                         if p.suffix == ".mar" or p.name.endswith((".tar.gz", ".tgz"))
                         or (p.is_dir() and (p / MANIFEST).is_file()))
    problems = []
    for entry in entries:
        name, sep, url = entry.partition("=")
        name, url = (name.strip(), url.strip()) if sep else ("", entry.strip())
        if is_remote_url(url):
            continue
        try:
            read_manifest(resolve_in_store(url, store))
        except InferenceError as exc:
            problems.append(f"startup model {name or url}: {exc.message}")
    return problems
