"""Safe extraction of a model archive (zip ``.mar`` or tar/tgz): every member is checked before
anything is written (inside the directory, a regular file or directory, total size capped)."""

from __future__ import annotations

import functools
import re
import shutil
import stat
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from inference_service.errors import InvalidArgument

DEFAULT_MAX_ARCHIVE_BYTES = 10 * 1024**3
"""Default cap of an archive's total uncompressed size, and of one download (10 GiB)."""


def safe_member(name: str) -> PurePosixPath:
    """``name`` (a member, or a file the manifest names) as a relative path; backslashes separate.
    InvalidArgument when absolute, with a ``..`` segment or a drive letter."""
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts or (path.parts and ":" in path.parts[0]):
        raise InvalidArgument(f"archive member {name!r} points outside the archive; refusing to extract")
    return path


def sanitize_archive_name(name: str) -> str:
    """A directory-name stem: the part before the first ``.``, ``[A-Za-z0-9_-]`` kept, others ``_``, at
    most 64 characters, ``"model"`` if empty; never ``/``, ``\\``, ``..`` or NUL."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9_-]", "_", base.split(".")[0])[:64] or "model"


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
        safe_member(member.name)
        if member.problem:
            raise InvalidArgument(f"archive member {member.name!r} {member.problem}; refusing to extract")
        total += member.size
        if total > max_bytes:
            raise InvalidArgument(f"archive {src.name} expands beyond the {max_bytes}-byte limit")
    for member in members:
        target = dest / safe_member(member.name)
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


def archive_extractor(path: Path) -> Callable[[Path, Path, int], None] | None:
    """``extract(src, dest, max_bytes)`` for a zip or tar (by content, not name), else ``None``.
    ``extract`` checks every member before writing any: InvalidArgument for one outside the
    archive, a link or special file, or a total above ``max_bytes``; ``zipfile.BadZipFile`` /
    ``tarfile.TarError`` / ``EOFError`` for a damaged archive."""
    if zipfile.is_zipfile(path):
        return _extract_zip
    if tarfile.is_tarfile(path):
        return _extract_tar
    return None
