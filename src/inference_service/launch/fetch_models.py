"""Fill a model store with archives fetched from allowed URLs (a Kubernetes initContainer's command).

Quick start (what ``deploy/kubernetes/deployment.yaml`` runs before the server starts)::

    python -m inference_service.launch.fetch_models --ts-config /config/config.properties \\
        http://model-repository.models.svc.cluster.local/releases/mymodel.mar

Each URL is fetched under the server's rules for a remote ``url``
(:class:`~inference_service.archive.fetch.UrlPolicy`) and replaced atomically. Exit status: 0
every archive in place, 1 at the first that fails, 2 a usage or configuration error.
See docs/scaling-out.md.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tarfile
import zipfile
from pathlib import Path
from urllib.parse import unquote, urlparse

from inference_service.archive.fetch import UrlPolicy, fetch_archive
from inference_service.config import ConfigError, Settings, apply_properties, read_properties
from inference_service.errors import InferenceError

#: Archive names ``load_models=all`` loads.
ARCHIVE_SUFFIXES = (".mar", ".tar.gz", ".tgz")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class FetchError(Exception):
    """An archive could not be put in the store (the message names the URL and why)."""


def archive_name(spec: str) -> tuple[str, str]:
    """``(file name, url)`` of a ``[NAME=]URL`` argument (no NAME: the URL path's last segment,
    percent-decoded); FetchError unless a plain name ending in ``.mar``, ``.tar.gz`` or ``.tgz``."""
    name, sep, url = spec.partition("=")
    if not sep or "://" in name:  # a bare URL (its query may hold '=')
        name, url = unquote(urlparse(spec).path.rsplit("/", 1)[-1]), spec
    if not _NAME.fullmatch(name) or not name.endswith(ARCHIVE_SUFFIXES):
        raise FetchError(f"{url}: archive name {name!r} must be a plain file name ending in "
                         f"{', '.join(ARCHIVE_SUFFIXES)} (give one as NAME=URL)")
    return name, url


def fetch_into_store(spec: str, model_store: Path, policy: UrlPolicy) -> Path:
    """Fetch one ``[NAME=]URL`` archive into ``model_store`` and return its path; FetchError (leaving
    nothing in the store) for a refused name or URL, a failed fetch, or neither zip nor tar."""
    name, url = archive_name(spec)
    try:
        download = fetch_archive(url, model_store, policy)
    except InferenceError as exc:
        raise FetchError(f"{url}: {exc.message}") from exc
    try:
        if not (zipfile.is_zipfile(download) or tarfile.is_tarfile(download)):
            raise FetchError(f"{url}: the download is neither a zip (.mar) nor a tar archive")
        os.chmod(download, 0o644)  # the server may run as another user than this container
        target = model_store / name
        os.replace(download, target)
    except BaseException:
        download.unlink(missing_ok=True)
        raise
    return target


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m inference_service.launch.fetch_models``."""
    p = argparse.ArgumentParser(
        prog="python -m inference_service.launch.fetch_models",
        description="Fetch model archives from allowed URLs into a model store (allowed_urls, "
                    "max_download_size and download_timeout from the config file).")
    p.add_argument("--ts-config", type=Path, required=True, help="the server's config.properties")
    p.add_argument("--model-store", type=Path, help="where the archives go (default: the config's model_store)")
    p.add_argument("archives", nargs="+", metavar="[NAME=]URL", help="an archive to fetch")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point. Returns the exit status (0 fetched, 1 a fetch failed, 2 usage or config error)."""
    args = build_parser().parse_args(argv)
    settings = Settings()
    try:
        apply_properties(settings, read_properties(args.ts_config), str(args.ts_config))
    except ConfigError as exc:
        print(f"fetch_models: {exc}", file=sys.stderr)
        return 2
    store = args.model_store or settings.model_store
    if store is None:
        print("fetch_models: no model store: pass --model-store or set model_store in the config",
              file=sys.stderr)
        return 2
    store.mkdir(parents=True, exist_ok=True)
    for spec in args.archives:
        try:
            target = fetch_into_store(spec, store, settings.url_policy)
        except FetchError as exc:
            print(f"fetch_models: {exc}", file=sys.stderr)
            return 1
        print(f"fetched {archive_name(spec)[1]} -> {target} ({target.stat().st_size} bytes)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
