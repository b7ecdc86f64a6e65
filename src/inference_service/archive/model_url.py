"""The text of a RegisterModel (or ``--models``) ``url``, checked before it is resolved or fetched.

Shared by the model store lookup (:func:`inference_service.archive.model_archive.resolve_in_store`)
and remote downloads (:mod:`inference_service.archive.fetch`), so both refuse the same
forms with the same words.
"""

from __future__ import annotations

import re
import unicodedata
from urllib.parse import urlparse

from inference_service.errors import InvalidArgument

RELATIVE_PATH_MESSAGE = "Relative path is not allowed in url: {url}"  # TorchServe's ModelArchive text


def has_parent_segment(path: str) -> bool:
    """Whether ``path`` has a ``..`` segment (``/`` or ``\\`` separated)."""
    return ".." in re.split(r"[/\\]", path)


def is_remote_url(url: str) -> bool:
    """Whether ``url`` names a remote archive (any scheme but ``file``, e.g. ``https://``)."""
    scheme = urlparse(url).scheme.lower()
    return "://" in url and len(scheme) > 1 and scheme != "file"


def refuse_control_characters(url: str, text: str | None = None, how: str = "") -> None:
    """Refuse a ``url`` holding a control character (Unicode category ``Cc``), checked in ``text`` when
    given (e.g. the percent-decoded path): ``urllib.parse`` silently drops TAB, CR and LF, so
    ``allowed_urls`` would match another URL than the one fetched.

    Raises:
        InvalidArgument: "model url '<url, escaped>' contains control characters" + ``how``.
    """
    checked = url if text is None else text
    if any(unicodedata.category(ch) == "Cc" for ch in checked):
        raise InvalidArgument(f"model url {url!r} contains control characters{how} (CR, LF, TAB, NUL...); "
                              "name the archive without them")
