"""Token authorization of the gRPC APIs, on by default (as TorchServe 0.11.1+).

The server writes ``key_file.json`` (mode 0600, TorchServe's layout); a missing or wrong key is
UNAUTHENTICATED. Keys never appear in the log. See docs/security.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hmac
import json
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from inference_service.contracts.torchserve_status import TORCHSERVE, torchserve_status
from inference_service.errors import InferenceError

log = logging.getLogger(__name__)

KEY_FILE_NAME = "key_file.json"
INFERENCE = "inference"
MANAGEMENT = "management"
API = "API"
SCOPES = (MANAGEMENT, INFERENCE, API)
# Methods every caller may use: Kubernetes probes and tooling carry no token.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
#: TorchServe's text first (its GRPCInterceptor and TokenAuthorizationHandler), then what to send.
TORCHSERVE_TOKEN_MESSAGE = "Token Authorization failed. Token either incorrect, expired, or not provided correctly"
UNAUTHENTICATED_MESSAGE = (
    TORCHSERVE_TOKEN_MESSAGE + ": send metadata 'authorization: Bearer <key>' with the {scope} key "
    "of the server's key_file.json"
)


def new_key() -> str:
    """A fresh random key: 32 bytes from :mod:`secrets`, URL-safe base64 (43 characters), never
    beginning with ``-``: a command line reads ``--auth-token -x...`` as a missing value (one key in
    64 failed the gRPC client's ``--auth-token "$(...)"`` so)."""
    while (key := secrets.token_urlsafe(32)).startswith("-"):
        pass
    return key


@dataclass
class _Key:
    value: str
    expires_mono: float | None  # time.monotonic() deadline; None: never
    expires_wall: float | None  # time.time() of the same instant, for the key file
    rotate_mono: float | None  # when it is replaced (half its lifetime)


@dataclass
class _Scope:
    current: _Key
    previous: list[_Key] = field(default_factory=list)


class KeyStore:
    """The three keys of TorchServe's token authorization, with optional rotation.

    Args:
        expiration_min: key lifetime in minutes (``None``: keys never expire nor rotate).
        clock: monotonic clock (seconds) deciding validity.
        fixed: keys given by the operator per scope; they never expire or rotate.

    Raises:
        ValueError: ``expiration_min`` is not positive, or a fixed key is shorter than 16 characters.
    """

    def __init__(self, expiration_min: float | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 fixed: dict[str, str] | None = None) -> None:
        if expiration_min is not None and not expiration_min > 0:
            raise ValueError(f"token_expiration_min must be positive, not {expiration_min}")
        self._fixed = {scope: key for scope, key in (fixed or {}).items() if key}
        for scope, key in self._fixed.items():
            if len(key) < 16:
                raise ValueError(f"the {scope} key given must have at least 16 characters")
        self.lifetime_s = None if expiration_min is None else expiration_min * 60.0
        self._clock = clock
        self._wall = wall_clock
        self._scopes = {scope: _Scope(self._make(scope)) for scope in SCOPES}

    def _make(self, scope: str) -> _Key:
        if scope in self._fixed:
            return _Key(self._fixed[scope], None, None, None)
        if self.lifetime_s is None or scope == API:
            return _Key(new_key(), None, None, None)
        now = self._clock()
        return _Key(new_key(), now + self.lifetime_s, self._wall() + self.lifetime_s,
                    now + self.lifetime_s / 2)

    def key(self, scope: str) -> str:
        """The current key of ``scope`` (``"inference"``, ``"management"`` or ``"API"``)."""
        return self._scopes[scope].current.value

    def verify(self, scope: str, token: str | None) -> bool:
        """Whether ``token`` is a valid key of ``scope`` (current, or replaced and not yet expired).

        Every valid key is compared with :func:`hmac.compare_digest`, without
        stopping at the first match, so the time taken says nothing about the key.
        """
        if not token:
            return False
        now = self._clock()
        entry = self._scopes[scope]
        candidate = token.encode("utf-8", "surrogateescape")
        ok = False
        for key in (entry.current, *entry.previous):
            if key.expires_mono is not None and now >= key.expires_mono:
                continue
            ok |= hmac.compare_digest(candidate, key.value.encode("ascii"))
        return ok

    def next_rotation_in(self) -> float | None:
        """Seconds until the next key is due for rotation (``None``: keys never rotate)."""
        due = [s.current.rotate_mono for s in self._scopes.values() if s.current.rotate_mono is not None]
        if not due:
            return None
        return max(0.0, min(due) - self._clock())

    def rotate_due(self) -> bool:
        """Replace keys past half their lifetime, drop expired ones; True if the key file must be rewritten."""
        now = self._clock()
        rotated = False
        for scope, entry in self._scopes.items():
            entry.previous = [k for k in entry.previous if k.expires_mono is None or now < k.expires_mono]
            if entry.current.rotate_mono is not None and now >= entry.current.rotate_mono:
                entry.previous.append(entry.current)
                entry.current = self._make(scope)
                rotated = True
        return rotated

    def renew(self, scope: str) -> None:
        """Replace the key of ``scope`` now, as TorchServe's token API (``/token?type=...``) does:
        the key it replaces, and any it had replaced before, stop being valid at once; the new key
        gets a full lifetime (``expiration_min``).

        Raises:
            ValueError: ``scope`` is not ``"management"`` or ``"inference"``, or its key was given
                by the operator (fixed keys never change).
        """
        if scope not in (MANAGEMENT, INFERENCE):
            raise ValueError(f"only the management and inference keys can be renewed, not {scope!r}")
        if scope in self._fixed:
            raise ValueError(f"the {scope} key was given by the operator and is never renewed")
        self._scopes[scope] = _Scope(self._make(scope))

    def as_key_file(self) -> dict[str, Any]:
        """The key file's content in TorchServe's layout ("expiration time" ``null`` when keys never expire)."""
        out: dict[str, Any] = {}
        for scope in SCOPES:
            key = self._scopes[scope].current
            if scope == API:
                out[scope] = {"key": key.value}
            else:
                out[scope] = {"key": key.value, "expiration time": _iso(key.expires_wall)}
        return out


def _iso(wall: float | None) -> str | None:
    if wall is None:
        return None
    moment = datetime.datetime.fromtimestamp(wall, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def write_key_file(path: Path, content: dict[str, Any]) -> None:
    """Write ``content`` as JSON to ``path`` with mode 0600, atomically.

    The temporary file is created 0600, so the keys are never readable by others. Raises OSError.
    """
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)  # whatever the umask
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def read_bearer(metadata: Any) -> str | None:
    """The token of the first ``authorization: Bearer <token>`` entry of call metadata (``None`` if absent)."""
    for item in metadata or ():
        key, value = item[0], item[1]
        if key.lower() != "authorization":
            continue
        if isinstance(value, bytes):
            value = value.decode("utf-8", "surrogateescape")
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return None
    return None


def _denying_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode,
                     message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call with ``code``."""

    # The status is set, not raised with context.abort: grpc.aio keeps an abort's exception, and
    # with it the frame holding the request, until the cycle collector runs (see
    # servicers.base._end_with), so large requests without a key would pile up in memory.
    async def deny_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        context.set_code(code)
        context.set_details(message)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        context.set_code(code)
        context.set_details(message)
        return
        yield  # pragma: no cover - makes this an async generator, as gRPC expects of a stream handler

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny_unary, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny_unary, **kwargs)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without a valid ``authorization: Bearer <key>`` for one scope.

    Health and reflection methods pass without a key; a rejected call ends UNAUTHENTICATED before
    the servicer runs (``status_codes`` "torchserve": PERMISSION_DENIED, as its ``GRPCInterceptor``).
    """

    def __init__(self, keys: KeyStore, scope: str, status_codes: str = "default") -> None:
        self.keys = keys
        self.scope = scope
        refused = InferenceError(UNAUTHENTICATED_MESSAGE.format(scope=scope), reason="UNAUTHENTICATED")
        refused.code = grpc.StatusCode.UNAUTHENTICATED
        self.code, self.message = (torchserve_status(refused, "") if status_codes == TORCHSERVE
                                   else (refused.code, refused.message))

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        """Pass authorized and open calls on; answer the rest UNAUTHENTICATED."""
        method = handler_call_details.method or ""
        if method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        token = read_bearer(handler_call_details.invocation_metadata)
        if self.keys.verify(self.scope, token):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
            return None
        log.info("rejected %s: %s token", method, "missing" if token is None else "invalid")
        return _denying_handler(handler, self.code, self.message)


class TokenAuthorization:
    """The server's token authorization: key store, key file and rotation task.

    Raises ValueError when ``expiration_min`` (minutes; ``None``: never) is not positive.
    """

    def __init__(self, key_file: Path, expiration_min: float | None = None,
                 fixed: dict[str, str] | None = None, status_codes: str = "default") -> None:
        self.key_file = key_file
        self.status_codes = status_codes
        self.keys = KeyStore(expiration_min, fixed=fixed)
        self._written: dict[str, Any] | None = None
        self._task: asyncio.Task[None] | None = None

    def interceptors(self, scope: str) -> list[grpc.aio.ServerInterceptor]:
        """The interceptors for the port of ``scope`` (``"inference"`` or ``"management"``)."""
        return [AuthInterceptor(self.keys, scope, self.status_codes)]

    def _write(self) -> None:
        content = self.keys.as_key_file()
        write_key_file(self.key_file, content)
        self._written = content

    def start(self) -> None:
        """Write the key file (OSError if it cannot) and, when keys expire, start rotating them."""
        self._write()
        lifetime = self.keys.lifetime_s
        log.info("token authorization enabled: keys written to %s (%s)", self.key_file,
                 "keys never expire" if lifetime is None else
                 f"keys rotate every {lifetime / 120:g} min and stay valid {lifetime / 60:g} min")
        if lifetime is not None:
            self._task = asyncio.get_running_loop().create_task(self._rotate_forever())

    def renew(self, scope: str) -> None:
        """Replace the key of ``scope`` (TorchServe's token API) and rewrite the key file.

        Raises:
            ValueError: as :meth:`KeyStore.renew` (nothing changed).
            OSError: the key file cannot be written (the new key is in force all the same).
        """
        self.keys.renew(scope)
        self._write()
        log.info("token authorization: %s key renewed, %s rewritten", scope, self.key_file)

    async def _rotate_forever(self) -> None:
        while True:
            delay = self.keys.next_rotation_in()
            if delay is None:
                return
            await asyncio.sleep(delay)
            if self.keys.rotate_due():
                try:
                    self._write()
                    log.info("token authorization: keys rotated, %s rewritten", self.key_file)
                except OSError as exc:
                    log.error("token authorization: cannot rewrite %s: %s", self.key_file, exc)

    async def stop(self) -> None:
        """Stop rotating and delete the key file (only if it still holds this server's keys)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._written is None:
            return
        try:
            on_disk = json.loads(self.key_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if on_disk == self._written:
            with contextlib.suppress(FileNotFoundError):
                self.key_file.unlink()
        else:
            log.warning("%s now holds another server's keys; left in place", self.key_file)
