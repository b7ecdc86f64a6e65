"""Model archives (``.mar`` zip, tgz, or an unpacked directory) and the model store.

Local archives are opened only from inside the model store as named (no ``..``); a symbolic
link found there is followed, as TorchServe does. Remote ones are fetched under
:class:`~inference_service.archive.fetch.UrlPolicy`; both are extracted by the one hardened path
(:mod:`inference_service.archive.extract`), and manifest and YAML are read as data, never code
(:mod:`inference_service.archive.yaml_budget`). The ``url`` text checks live in
:mod:`inference_service.archive.model_url`. See docs/security.md.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tarfile
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urlparse

from inference_service.archive.extract import (
    DEFAULT_MAX_ARCHIVE_BYTES,
    archive_extractor,
    safe_member,
    sanitize_archive_name,
)
from inference_service.archive.fetch import UrlPolicy, fetch_archive
from inference_service.archive.model_url import (
    RELATIVE_PATH_MESSAGE,
    has_parent_segment,
    is_remote_url,
    refuse_control_characters,
)
from inference_service.archive.yaml_budget import read_yaml_budgeted
from inference_service.errors import FailedPrecondition, InvalidArgument, NotFound, shorten

__all__ = [
    "DEFAULT_MAX_ARCHIVE_BYTES", "MANIFEST", "ModelArchive", "UrlPolicy", "fetch_archive", "install_requirements",
    "is_remote_url", "open_archive", "read_manifest", "resolve_in_store", "sanitize_archive_name",
]

log = logging.getLogger(__name__)

MANIFEST = "MAR-INF/MANIFEST.json"


@dataclass
class ModelArchive:
    """An opened model archive: ``config`` the per-model YAML (``{}`` without one); ``extracted``
    whether ``model_dir`` is a private copy to delete on unregister."""

    url: str
    model_dir: Path
    manifest: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)
    extracted: bool = False
    cleanup_dir: Path | None = None

    @property
    def model_name(self) -> str:
        """The manifest's ``model.modelName`` ("" if absent)."""
        return str(self.manifest.get("model", {}).get("modelName", ""))

    @property
    def version(self) -> str:
        """The manifest's ``model.modelVersion`` (TorchServe's default "1.0")."""
        return str(self.manifest.get("model", {}).get("modelVersion") or "1.0")

    @property
    def handler(self) -> str:
        """The manifest's handler entry point ("" if absent)."""
        return str(self.manifest.get("model", {}).get("handler", ""))

    def remove(self) -> None:
        """Delete the extracted copy (no-op for in-place directories)."""
        if self.extracted:
            shutil.rmtree(self.cleanup_dir or self.model_dir, ignore_errors=True)


def resolve_in_store(url: str, model_store: Path | None) -> Path:
    """Resolve a RegisterModel (or ``--models``) ``url`` to a path in the model store, links not
    resolved: a name or path in the store, an absolute path inside it, or a ``file://`` URL.

    Raises:
        InvalidArgument: empty, control characters, a remote URL, a workflow archive, a ``..``
            segment (TorchServe's "Relative path is not allowed in url"), a path outside the store,
            or a name the file system cannot hold (255 bytes an element, 4096 the path).
        FailedPrecondition: the server has no model store.
        NotFound: nothing at that path (or a link in the store points nowhere).
    """
    if not url:
        raise InvalidArgument("url is required: the model archive's file name in the model store",
                              reason="URL_REQUIRED")
    refuse_control_characters(url)
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https", "s3", "ftp"):
        raise InvalidArgument(
            f"remote model URLs are not supported ({url}); copy the archive into the model store"
        )
    raw = unquote(parsed.path) if parsed.scheme == "file" else url
    refuse_control_characters(url, raw, " once percent-decoded")
    if raw.endswith(".war"):
        raise InvalidArgument("workflows are not supported: register a model archive (.mar)")
    if model_store is None:
        raise FailedPrecondition("the server was started without --model-store")
    if has_parent_segment(raw):
        raise InvalidArgument(RELATIVE_PATH_MESSAGE.format(url=url)
                              + " (a '..' segment could point outside the model store)", reason="RELATIVE_PATH")
    store = Path(os.path.abspath(model_store))
    path = Path(os.path.normpath(raw))
    if path.is_absolute():
        for root in (store, store.resolve()):
            if path == root or root in path.parents:
                path = path.relative_to(root)
                break
        else:
            raise InvalidArgument(f"model url {url!r} is outside the model store {store}")
    path = store / path
    try:
        found = path.exists()
    except OSError as exc:  # ENAMETOOLONG, ELOOP...: no archive can have that name
        raise InvalidArgument(f"model url {shorten(url)!r} cannot name a file: {exc.strerror}") from None
    if not found:
        raise NotFound(f"model archive {shorten(url)!r} not found in the model store {store}",
                       reason="ARCHIVE_NOT_FOUND")
    return path


def open_archive(url: str, model_store: Path | None, extract_root: Path,
                 max_bytes: int = DEFAULT_MAX_ARCHIVE_BYTES, policy: UrlPolicy | None = None) -> ModelArchive:
    """Open the model archive named by ``url``: a zip or tar is extracted into a new directory under
    ``extract_root``, a directory used in place; a remote one allowed by ``policy`` (default: none)
    is downloaded under ``extract_root/downloads`` first and deleted once extracted.

    Raises:
        InvalidArgument: bad URL, not an archive, unsafe members, too large, or a manifest/config
            that cannot be parsed (a ``model-config.yaml`` over 1 MiB or 100,000 expanded nodes).
        PermissionDenied: a remote URL ``allowed_urls`` does not allow.
        NotFound: no such archive in the store (or 404).
        Unavailable / DeadlineExceeded: a download failed or took too long.
    """
    if url:
        refuse_control_characters(url)  # before any parsing: urllib.parse drops TAB, CR and LF
    if url and is_remote_url(url):
        if urlparse(url).path.endswith(".war"):
            raise InvalidArgument("workflows are not supported: register a model archive (.mar)")
        downloaded = fetch_archive(url, extract_root / "downloads", policy or UrlPolicy())
        try:
            return _extract_archive(url, downloaded, urlparse(url).path, extract_root, max_bytes)
        finally:
            downloaded.unlink(missing_ok=True)
    path = resolve_in_store(url, model_store)
    if path.is_dir():
        return _load_dir(url, path, extracted=False)
    return _extract_archive(url, path, path.name, extract_root, max_bytes)


def read_manifest(path: Path) -> dict[str, Any]:
    """``MAR-INF/MANIFEST.json`` of a zip, tar (``<name>/MAR-INF/...`` too) or directory archive,
    nothing else extracted; ``--start`` checks startup archives with it.

    Raises:
        InvalidArgument: not an archive, no manifest, or not a JSON object (names the archive).
    """
    shown = path.name
    try:
        if path.is_dir():
            manifest_path = path / MANIFEST
            if not manifest_path.is_file():
                raise InvalidArgument(f"model archive {shown} has no {MANIFEST}")
            raw = manifest_path.read_bytes()
        elif zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                try:
                    raw = zf.read(MANIFEST)
                except KeyError:
                    raise InvalidArgument(f"model archive {shown} has no {MANIFEST}") from None
        elif tarfile.is_tarfile(path):
            with tarfile.open(path, "r:*") as tf:
                member = next((m for m in tf.getmembers() if m.isfile() and (
                    m.name == MANIFEST or (m.name.endswith("/" + MANIFEST) and m.name.count("/") == 2))), None)
                fin = tf.extractfile(member) if member is not None else None
                if fin is None:
                    raise InvalidArgument(f"model archive {shown} has no {MANIFEST}")
                raw = fin.read()
        else:
            raise InvalidArgument(f"{shown} is not a model archive (expected a zip .mar, a tgz or a directory)")
        manifest = json.loads(raw.decode("utf-8"))
    except (OSError, zipfile.BadZipFile, tarfile.TarError, EOFError) as exc:
        raise InvalidArgument(f"cannot read {shown}: {exc}") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{MANIFEST} of {shown} is not valid JSON: {exc}") from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("model", {}), dict):
        raise InvalidArgument(f"{MANIFEST} of {shown} must be a JSON object with a 'model' object")
    return manifest


def _extract_archive(url: str, path: Path, name: str, extract_root: Path, max_bytes: int) -> ModelArchive:
    shown = PurePosixPath(name).name or path.name
    extract = archive_extractor(path)
    if extract is None:
        raise InvalidArgument(f"{shown} is not a model archive (expected a zip .mar, a tgz or a directory)")
    dest = extract_root / f"{sanitize_archive_name(name)}-{uuid.uuid4().hex[:12]}"
    dest.mkdir(parents=True)
    try:
        extract(path, dest, max_bytes)
        root = dest
        entries = list(dest.iterdir())
        if not (dest / MANIFEST).is_file() and len(entries) == 1 and (entries[0] / MANIFEST).is_file():
            root = entries[0]  # torch-model-archiver's tgz format wraps the files in <model-name>/
        archive = _load_dir(url, root, extracted=True)
        archive.cleanup_dir = dest
        return archive
    except (zipfile.BadZipFile, tarfile.TarError, EOFError) as exc:
        shutil.rmtree(dest, ignore_errors=True)
        raise InvalidArgument(f"cannot extract {shown}: {exc}") from exc
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise


def _load_dir(url: str, model_dir: Path, extracted: bool) -> ModelArchive:
    manifest_path = model_dir / MANIFEST
    if not manifest_path.is_file():
        raise InvalidArgument(f"model archive {url!r} has no {MANIFEST}")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{MANIFEST} of {url!r} is not valid JSON: {exc}") from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("model", {}), dict):
        raise InvalidArgument(f"{MANIFEST} of {url!r} must be a JSON object with a 'model' object")
    config: dict[str, Any] = {}
    config_file = manifest.get("model", {}).get("configFile")
    if config_file:
        config_path = (model_dir / safe_member(str(config_file))).resolve()
        if not config_path.is_file():
            raise InvalidArgument(f"model config file {config_file!r} named by the manifest is missing")
        loaded = read_yaml_budgeted(config_path, f"model config file {config_file!r}")
        if loaded is not None and not isinstance(loaded, dict):
            raise InvalidArgument(f"model config file {config_file!r} must be a YAML mapping")
        config = loaded or {}
    return ModelArchive(url=url, model_dir=model_dir, manifest=manifest, config=config, extracted=extracted)


def install_requirements(archive: ModelArchive, python: str) -> str | None:
    """Install the archive's ``requirements.txt`` into ``<model_dir>/.deps`` (pip --target), for
    ``install_py_dep_per_model``; returns that ``sys.path`` entry, or ``None`` without the file.

    Raises:
        FailedPrecondition: pip failed (the message carries pip's output tail).
    """
    import subprocess

    req = archive.model_dir / "requirements.txt"
    if not req.is_file():
        return None
    target = archive.model_dir / ".deps"
    proc = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--target", str(target), "-r", str(req)],
        capture_output=True, text=True, check=False,
    )
    if proc.returncode != 0:
        raise FailedPrecondition(f"installing requirements.txt failed: {proc.stderr.strip()[-800:]}")
    return str(target)

