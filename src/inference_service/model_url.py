"""The text of a RegisterModel (or ``--models``) ``url``, checked before it is resolved or fetched.

Shared by the model store lookup (:func:`inference_service.archive.resolve_in_store`)
and remote downloads (:mod:`inference_service.archive_fetch`), so both refuse the same
forms with the same words.
"""

from __future__ import annotations

import re
from urllib.parse import urlparse

RELATIVE_PATH_MESSAGE = "Relative path is not allowed in url: {url}"  # TorchServe's ModelArchive text


def has_parent_segment(path: str) -> bool:
    """Whether ``path`` has a ``..`` segment (``/`` or ``\\`` separated)."""
    return ".." in re.split(r"[/\\]", path)


def is_remote_url(url: str) -> bool:
    """Whether ``url`` names a remote archive (any scheme but ``file``, e.g. ``https://``)."""
    scheme = urlparse(url).scheme.lower()
    return "://" in url and len(scheme) > 1 and scheme != "file"
