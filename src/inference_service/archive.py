"""Model archives and the model store.

A model archive is what ``torch-model-archiver`` writes: a zip ``.mar`` (its
default), a gzipped tar (``--archive-format tgz``), or an unpacked directory
(``no-archive``), each holding ``MAR-INF/MANIFEST.json`` and the handler,
weights, extra files and the per-model YAML config named by
``model.configFile``. Local archives are opened only from inside the model
store: the name given (RegisterModel's ``url``, ``--models``) must stay in it as
written (no ``..``, no absolute path elsewhere), and a symbolic link found there is
then followed wherever it points, as TorchServe does (an operator's choice:
TorchServe's test harness and Kubernetes volume mounts fill stores with links);
``http(s)://`` URLs are fetched only when they match ``allowed_urls``
(:class:`UrlPolicy`, checked before anything is fetched, and again for every
redirect), with a size cap and a deadline, into the per-instance directory.
Extraction is the one hardened path for both: member names must stay inside
the extraction directory (no ``..``, no absolute paths, no links) and the total
uncompressed size is capped. Extraction directories are named after the
archive's sanitised name plus a random suffix; the manifest and YAML are data
(``json`` and ``yaml.safe_load``), never code.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import stat
import tarfile
import time
import urllib.error
import urllib.request
import uuid
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Any
from urllib.parse import unquote, urlparse, urlsplit, urlunsplit

import yaml

from inference_service.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)

log = logging.getLogger(__name__)

MANIFEST = "MAR-INF/MANIFEST.json"
DEFAULT_MAX_ARCHIVE_BYTES = 10 * 1024**3


@dataclass
class ModelArchive:
    """An opened model archive.

    Attributes:
        url: the URL it was registered with.
        model_dir: directory holding its files (extracted copy, or the directory itself).
        manifest: ``MAR-INF/MANIFEST.json`` as a dict.
        config: the per-model YAML config (``{}`` without one).
        extracted: whether ``model_dir`` is a private copy to delete on unregister.
    """

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


def _safe_member(name: str) -> PurePosixPath:
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts or (path.parts and ":" in path.parts[0]):
        raise InvalidArgument(f"archive member {name!r} points outside the archive; refusing to extract")
    return path


@dataclass
class _Member:
    """One archive member, whatever the archive format."""

    name: str
    size: int
    is_dir: bool
    problem: str | None  # why it may not be extracted (a link, a device...), or None
    open: Callable[[], IO[bytes]]


def _zip_members(zf: zipfile.ZipFile) -> list[_Member]:
    return [_Member(info.filename, info.file_size, info.is_dir(),
                    "is a symbolic link" if stat.S_ISLNK(info.external_attr >> 16) else None,
                    functools.partial(zf.open, info)) for info in zf.infolist()]


def _tar_members(tf: tarfile.TarFile) -> list[_Member]:
    def opener(member: tarfile.TarInfo) -> IO[bytes]:
        fin = tf.extractfile(member)
        assert fin is not None  # regular files only reach here
        return fin

    return [_Member(m.name, m.size, m.isdir(), None if m.isfile() or m.isdir() else "is not a regular file",
                    functools.partial(opener, m)) for m in tf.getmembers()]


def _extract_members(members: list[_Member], src: Path, dest: Path, max_bytes: int) -> None:
    """Check every member (path stays inside, no links, total size capped), then write them."""
    total = 0
    for member in members:
        _safe_member(member.name)
        if member.problem:
            raise InvalidArgument(f"archive member {member.name!r} {member.problem}; refusing to extract")
        total += member.size
        if total > max_bytes:
            raise InvalidArgument(f"archive {src.name} expands beyond the {max_bytes}-byte limit")
    for member in members:
        target = dest / _safe_member(member.name)
        if member.is_dir:
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        with member.open() as fin, open(target, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)


def _extract_zip(src: Path, dest: Path, max_bytes: int) -> None:
    with zipfile.ZipFile(src) as zf:
        _extract_members(_zip_members(zf), src, dest, max_bytes)


def _extract_tar(src: Path, dest: Path, max_bytes: int) -> None:
    with tarfile.open(src, "r:*") as tf:
        _extract_members(_tar_members(tf), src, dest, max_bytes)


RELATIVE_PATH_MESSAGE = "Relative path is not allowed in url: {url}"  # TorchServe's ModelArchive text


def _has_parent_segment(path: str) -> bool:
    """Whether ``path`` has a ``..`` segment (``/`` or ``\\`` separated)."""
    return ".." in re.split(r"[/\\]", path)


def resolve_in_store(url: str, model_store: Path | None) -> Path:
    """Resolve a RegisterModel (or ``--models``) ``url`` to a path in the model store.

    Accepts a file name or relative path in the store, an absolute path inside
    it (as the store is given or as it resolves), or a ``file://`` URL of either
    (percent-encoding decoded). The name is confined as written: a ``..``
    segment is refused with TorchServe's "Relative path is not allowed in url"
    (its ``ModelArchive.downloadModel``), an absolute path elsewhere is refused.
    Symbolic links inside the store are then followed wherever they point: only
    whoever can write the store can place one, and TorchServe follows them too.

    Returns:
        The path in the store (links not resolved, so its name is the store's).

    Raises:
        InvalidArgument: empty URL, a remote URL, a workflow archive, a ``..``
            segment, or an absolute path outside the model store.
        FailedPrecondition: the server has no model store.
        NotFound: nothing exists at that path (or a link in the store points nowhere).
    """
    if not url:
        raise InvalidArgument("url is required: the model archive's file name in the model store")
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https", "s3", "ftp"):
        raise InvalidArgument(
            f"remote model URLs are not supported ({url}); copy the archive into the model store"
        )
    raw = unquote(parsed.path) if parsed.scheme == "file" else url
    if raw.endswith(".war"):
        raise InvalidArgument("workflows are not supported: register a model archive (.mar)")
    if model_store is None:
        raise FailedPrecondition("the server was started without --model-store")
    if _has_parent_segment(raw):
        raise InvalidArgument(RELATIVE_PATH_MESSAGE.format(url=url)
                              + " (a '..' segment could point outside the model store)")
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
    if not path.exists():
        raise NotFound(f"model archive {url!r} not found in the model store {store}")
    return path


REMOTE_SCHEMES = ("http", "https")
MAX_REDIRECTS = 5


def sanitize_archive_name(name: str) -> str:
    """A safe directory-name stem for an archive file name.

    The part before the first ``.`` with every character outside
    ``[A-Za-z0-9_-]`` replaced by ``_``, at most 64 characters; ``"model"``
    when nothing is left. The result never contains ``/``, ``\\``, ``..`` or a NUL.
    """
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9_-]", "_", base.split(".")[0])[:64] or "model"


def is_remote_url(url: str) -> bool:
    """Whether ``url`` names a remote archive (any scheme but ``file``, e.g. ``https://``)."""
    scheme = urlparse(url).scheme.lower()
    return "://" in url and len(scheme) > 1 and scheme != "file"


@dataclass(frozen=True)
class UrlPolicy:
    """Which remote register URLs are fetched, and how (TorchServe's ``allowed_urls``).

    Attributes:
        allowed_urls: regexes; a URL is allowed when one matches it whole, its
            scheme and host in lower case (case-insensitive by RFC 3986), the
            rest as written (TorchServe ignores case throughout, so its
            ``.*/models/.*`` also lets ``/MODELS/`` through). Empty (the
            default): no remote URL.
        max_download_bytes: cap of one download (10 GiB).
        timeout_s: deadline of one whole download, also the socket timeout (300 s).
    """

    allowed_urls: tuple[str, ...] = ()
    max_download_bytes: int = DEFAULT_MAX_ARCHIVE_BYTES
    timeout_s: float = 300.0

    def check(self, url: str) -> None:
        """Refuse ``url`` unless it is an ``http(s)`` URL ``allowed_urls`` allows.

        Checked before anything is fetched, and for every redirect target.

        Raises:
            InvalidArgument: not http(s), credentials in the URL, no host, or a
                ``..`` path segment (also percent-encoded: CVE-2024-35198), the latter
                with TorchServe's "Relative path is not allowed in url: <url>".
            PermissionDenied: no ``allowed_urls`` pattern matches (TorchServe's
                "Given URL <url> does not match any allowed URL(s)", then why).
        """
        parsed = urlparse(url)
        if parsed.scheme.lower() not in REMOTE_SCHEMES:
            raise InvalidArgument(f"model URL scheme {parsed.scheme!r} is not supported ({url}): "
                                  "use http(s):// or a file in the model store")
        if parsed.username is not None or parsed.password is not None:
            raise InvalidArgument("model URLs with credentials (user:password@) are not supported")
        if not parsed.hostname:
            raise InvalidArgument(f"model URL {url!r} has no host")
        path = parsed.path
        for _ in range(3):  # %252e%252e decodes to %2e%2e, then to ..
            path = unquote(path)
        if _has_parent_segment(path):
            raise InvalidArgument(RELATIVE_PATH_MESSAGE.format(url=url) + " (a '..' path segment)")
        normalized = urlunsplit(urlsplit(url)._replace(scheme=parsed.scheme.lower(), netloc=parsed.netloc.lower()))
        if not any(re.fullmatch(p, normalized) for p in self.allowed_urls):
            raise PermissionDenied(  # TorchServe's ArchiveUtils.validateURL text, then why
                f"Given URL {url} does not match any allowed URL(s): it matches no allowed_urls pattern "
                "(by default only archives in the model store can be registered)")


class _PolicyRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to a URL the policy allows (at most MAX_REDIRECTS)."""

    max_redirections = MAX_REDIRECTS

    def __init__(self, policy: UrlPolicy) -> None:
        super().__init__()
        self.policy = policy

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> urllib.request.Request | None:
        self.policy.check(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch_archive(url: str, dest_dir: Path, policy: UrlPolicy) -> Path:
    """Download an allowed ``http(s)`` archive into a new file under ``dest_dir``.

    The file's name is random (nothing of the URL reaches the file system).
    Proxies from the environment are not used.

    Raises:
        InvalidArgument / PermissionDenied: see :meth:`UrlPolicy.check` (also
            for redirects); the download exceeds ``max_download_bytes``.
        NotFound: the server answered 404.
        Unavailable: the server cannot be reached or answered another error.
        DeadlineExceeded: the download took longer than ``timeout_s``.
    """
    policy.check(url)
    dest_dir.mkdir(parents=True, exist_ok=True)
    target = dest_dir / f"{uuid.uuid4().hex}.download"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _PolicyRedirects(policy))
    request = urllib.request.Request(url, headers={"User-Agent": "inference-service"})
    deadline = time.monotonic() + policy.timeout_s
    cap = policy.max_download_bytes
    too_big = f"model URL {url!r} is larger than max_download_size ({cap} bytes)"
    try:
        with opener.open(request, timeout=policy.timeout_s) as response:
            length = response.headers.get("Content-Length")
            if length and length.isdigit() and int(length) > cap:
                raise InvalidArgument(too_big)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                total = 0
                while chunk := response.read1(1 << 16):
                    total += len(chunk)
                    if total > cap:
                        raise InvalidArgument(too_big)
                    if time.monotonic() > deadline:
                        raise DeadlineExceeded(f"downloading {url!r} took longer than {policy.timeout_s:g} s")
                    out.write(chunk)
    except urllib.error.HTTPError as exc:
        target.unlink(missing_ok=True)
        if exc.code == 404:
            raise NotFound(f"model URL {url!r}: the server answered 404") from exc
        raise Unavailable(f"cannot download {url!r}: HTTP {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, OSError) as exc:
        target.unlink(missing_ok=True)
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError) or isinstance(exc, TimeoutError):
            raise DeadlineExceeded(f"downloading {url!r} took longer than {policy.timeout_s:g} s") from exc
        raise Unavailable(f"cannot download {url!r}: {reason}") from exc
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    log.info("downloaded %s (%d bytes)", url, total)
    return target


def open_archive(url: str, model_store: Path | None, extract_root: Path,
                 max_bytes: int = DEFAULT_MAX_ARCHIVE_BYTES, policy: UrlPolicy | None = None) -> ModelArchive:
    """Open the model archive named by ``url``.

    A local ``url`` must resolve inside the model store (see
    :func:`resolve_in_store`); an ``http(s)`` one must be allowed by ``policy``
    (default: none is) and is downloaded under ``extract_root/downloads``
    first (see :func:`fetch_archive`), then deleted once extracted. A zip or
    tar archive is extracted into a new directory under ``extract_root``; a
    directory is used in place.

    Raises:
        InvalidArgument: bad URL, not an archive, unsafe members, too large,
            or a manifest/config that cannot be parsed.
        PermissionDenied: a remote URL ``allowed_urls`` does not allow.
        NotFound: no such archive in the store (or 404).
        Unavailable / DeadlineExceeded: a download failed or took too long.
    """
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
    """``MAR-INF/MANIFEST.json`` of the archive at ``path``, read without extracting anything else.

    Reads a zip ``.mar``, a tar (``<name>/MAR-INF/...`` too, as torch-model-archiver's tgz
    format writes it) or a directory. Used by ``inference-service --start`` to name the
    startup models it waits for, and to refuse an archive that cannot load before the
    server starts.

    Raises:
        InvalidArgument: not an archive, no manifest, or a manifest that is not a JSON
            object (the message names the archive).
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
    if zipfile.is_zipfile(path):
        extract = _extract_zip
    elif tarfile.is_tarfile(path):
        extract = _extract_tar
    else:
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
        config_path = (model_dir / _safe_member(str(config_file))).resolve()
        if not config_path.is_file():
            raise InvalidArgument(f"model config file {config_file!r} named by the manifest is missing")
        try:
            loaded = yaml.safe_load(config_path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"model config file {config_file!r} is not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise InvalidArgument(f"model config file {config_file!r} must be a YAML mapping")
        config = loaded or {}
    return ModelArchive(url=url, model_dir=model_dir, manifest=manifest, config=config, extracted=extracted)


def install_requirements(archive: ModelArchive, python: str) -> str | None:
    """Install the archive's ``requirements.txt`` into ``<model_dir>/.deps`` (pip --target).

    Used only when per-model dependency installation is switched on
    (TorchServe's ``install_py_dep_per_model``); off, the file is ignored with
    a log line, as TorchServe does.

    Returns:
        The directory to put on the worker's ``sys.path``, or ``None`` if the
        archive has no requirements file.

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

