"""Remote model archives: which ``http(s)`` URLs may be fetched (TorchServe's ``allowed_urls``,
checked before fetching and for every redirect), and the capped, timed download into a randomly
named file. See docs/security.md."""

from __future__ import annotations

import logging
import os
import re
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse, urlsplit, urlunsplit

from inference_service.archive.extract import DEFAULT_MAX_ARCHIVE_BYTES
from inference_service.archive.model_url import RELATIVE_PATH_MESSAGE, has_parent_segment, refuse_control_characters
from inference_service.errors import DeadlineExceeded, InvalidArgument, NotFound, PermissionDenied, Unavailable

log = logging.getLogger(__name__)

REMOTE_SCHEMES = ("http", "https")
#: The reason of every failed download (NOT_FOUND for a 404, UNAVAILABLE, DEADLINE_EXCEEDED).
DOWNLOAD_FAILED = "DOWNLOAD_FAILED"
MAX_REDIRECTS = 5


@dataclass(frozen=True)
class UrlPolicy:
    """Which remote register URLs are fetched, and how (TorchServe's ``allowed_urls``).

    A URL is allowed when a regex matches it whole, scheme and host lower-cased, the rest as written
    (TorchServe ignores case throughout). Empty: no remote URL. Caps: ``max_download_bytes``
    (10 GiB), ``timeout_s`` for the whole download (300 s).
    """

    allowed_urls: tuple[str, ...] = ()
    max_download_bytes: int = DEFAULT_MAX_ARCHIVE_BYTES
    timeout_s: float = 300.0

    def check(self, url: str) -> None:
        """Refuse ``url`` unless ``allowed_urls`` allows it; checked before fetching and for every redirect.

        Raises:
            InvalidArgument: control characters (urllib.parse would drop some, so the URL matched would
                not be the one fetched), not http(s), credentials, no host, or a ``..`` segment, also
                percent-encoded (CVE-2024-35198; TorchServe's "Relative path is not allowed in url").
            PermissionDenied: no pattern matches (TorchServe's "Given URL ... does not match").
        """
        refuse_control_characters(url)
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
        if has_parent_segment(path):
            raise InvalidArgument(RELATIVE_PATH_MESSAGE.format(url=url) + " (a '..' path segment)",
                                  reason="RELATIVE_PATH")
        normalized = urlunsplit(urlsplit(url)._replace(scheme=parsed.scheme.lower(), netloc=parsed.netloc.lower()))
        if not any(re.fullmatch(p, normalized) for p in self.allowed_urls):
            raise PermissionDenied(  # TorchServe's ArchiveUtils.validateURL text, then why
                f"Given URL {url} does not match any allowed URL(s): it matches no allowed_urls pattern "
                "(by default only archives in the model store can be registered)", reason="URL_NOT_ALLOWED")


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
    """Download an allowed archive into a randomly named file under ``dest_dir``, no proxies.

    Raises:
        InvalidArgument / PermissionDenied: as :meth:`UrlPolicy.check`; above ``max_download_bytes``.
        NotFound: 404. Unavailable: unreachable or another error. DeadlineExceeded: past ``timeout_s``.
            All three with reason ``DOWNLOAD_FAILED``.
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
                        raise DeadlineExceeded(f"downloading {url!r} took longer than {policy.timeout_s:g} s",
                                               reason=DOWNLOAD_FAILED)
                    out.write(chunk)
    except urllib.error.HTTPError as exc:
        target.unlink(missing_ok=True)
        if exc.code == 404:
            raise NotFound(f"model URL {url!r}: the server answered 404", reason=DOWNLOAD_FAILED) from exc
        raise Unavailable(f"cannot download {url!r}: HTTP {exc.code} {exc.reason}", reason=DOWNLOAD_FAILED) from exc
    except (urllib.error.URLError, OSError) as exc:
        target.unlink(missing_ok=True)
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError) or isinstance(exc, TimeoutError):
            raise DeadlineExceeded(f"downloading {url!r} took longer than {policy.timeout_s:g} s",
                                   reason=DOWNLOAD_FAILED) from exc
        raise Unavailable(f"cannot download {url!r}: {reason}", reason=DOWNLOAD_FAILED) from exc
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    log.info("downloaded %s (%d bytes)", url, total)
    return target
