"""Unit tests of the security pieces: key store and rotation, key file, bearer parsing, the
interceptor's routing, bind warnings, the URL policy and the security settings."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import grpc
import pytest

from inference_service.archive.model_archive import UrlPolicy, is_remote_url
from inference_service.config import ConfigError, Settings, apply_properties
from inference_service.errors import InvalidArgument, PermissionDenied
from inference_service.security import tls
from inference_service.security.auth import (
    API,
    INFERENCE,
    MANAGEMENT,
    AuthInterceptor,
    KeyStore,
    TokenAuthorization,
    new_key,
    read_bearer,
    write_key_file,
)
from inference_service.security.exposure import is_loopback, warn_exposed_binds


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_keys_never_expire_by_default():
    clock = FakeClock()
    keys = KeyStore(clock=clock)
    assert keys.next_rotation_in() is None
    clock.now += 10**9
    assert not keys.rotate_due()
    assert keys.verify(INFERENCE, keys.key(INFERENCE))
    assert keys.verify(MANAGEMENT, keys.key(MANAGEMENT))
    assert len({keys.key(s) for s in (INFERENCE, MANAGEMENT, API)}) == 3
    content = keys.as_key_file()
    assert content["inference"]["expiration time"] is None and set(content["API"]) == {"key"}


def test_keys_are_scoped_and_exact():
    keys = KeyStore()
    key = keys.key(INFERENCE)
    assert not keys.verify(MANAGEMENT, key)
    assert not keys.verify(INFERENCE, keys.key(API))
    for wrong in (None, "", key[:-1], key + "x", key.upper(), " " + key, "\u00e9" + key[1:]):
        assert not keys.verify(INFERENCE, wrong)


def test_rotation_at_half_life_with_grace_until_expiry():
    clock = FakeClock()
    keys = KeyStore(expiration_min=1, clock=clock, wall_clock=lambda: 0.0)
    first = keys.key(INFERENCE)
    api = keys.key(API)
    assert keys.next_rotation_in() == pytest.approx(30)
    assert keys.as_key_file()["inference"]["expiration time"] == "1970-01-01T00:01:00.000000Z"
    clock.now += 29.9
    assert not keys.rotate_due()
    clock.now += 0.1
    assert keys.rotate_due()
    second = keys.key(INFERENCE)
    assert second != first and keys.key(API) == api  # the API key never rotates
    assert keys.verify(INFERENCE, first) and keys.verify(INFERENCE, second)  # grace period
    clock.now += 29.9
    assert keys.verify(INFERENCE, first)
    clock.now += 0.1  # first's expiration time
    assert not keys.verify(INFERENCE, first)
    assert keys.verify(INFERENCE, second)
    assert keys.rotate_due()  # second at its half life
    assert keys.verify(INFERENCE, second) and keys.verify(INFERENCE, keys.key(INFERENCE))


def test_fractional_and_invalid_expiration():
    clock = FakeClock()
    keys = KeyStore(expiration_min=0.01, clock=clock)
    assert keys.next_rotation_in() == pytest.approx(0.3)
    for bad in (0, -1):
        with pytest.raises(ValueError):
            KeyStore(expiration_min=bad)


def test_key_file_is_0600_and_replaced_atomically(tmp_path: Path):
    path = tmp_path / "key_file.json"
    path.write_text("old")
    os.chmod(path, 0o644)
    old_umask = os.umask(0)
    try:
        write_key_file(path, {"inference": {"key": "k"}})
    finally:
        os.umask(old_umask)
    assert path.stat().st_mode & 0o777 == 0o600
    assert json.loads(path.read_text()) == {"inference": {"key": "k"}}
    assert [p.name for p in tmp_path.iterdir()] == ["key_file.json"]
    (tmp_path / f"key_file.json.{os.getpid()}.tmp").write_text("stale")  # left by a crash
    write_key_file(path, {"x": 1})
    assert json.loads(path.read_text()) == {"x": 1}


def test_token_authorization_deletes_only_its_own_key_file(tmp_path: Path):
    async def scenario() -> None:
        auth = TokenAuthorization(tmp_path / "key_file.json")
        auth.start()
        assert json.loads(auth.key_file.read_text())["inference"]["key"] == auth.keys.key(INFERENCE)
        await auth.stop()
        assert not auth.key_file.exists()
        other = TokenAuthorization(tmp_path / "key_file.json")
        other.start()
        newer = TokenAuthorization(tmp_path / "key_file.json")  # a second server, same working dir
        newer.start()
        await other.stop()
        assert auth.key_file.exists()  # it holds newer's keys
        await newer.stop()
        assert not auth.key_file.exists()

    asyncio.run(scenario())


def test_rotation_task_rewrites_the_key_file(tmp_path: Path):
    async def scenario() -> None:
        auth = TokenAuthorization(tmp_path / "key_file.json", expiration_min=0.002)  # 0.12 s
        auth.start()
        first = json.loads(auth.key_file.read_text())["inference"]["key"]
        for _ in range(100):
            await asyncio.sleep(0.02)
            if json.loads(auth.key_file.read_text())["inference"]["key"] != first:
                break
        else:
            raise AssertionError("key_file.json was not rewritten")
        assert auth.key_file.stat().st_mode & 0o777 == 0o600
        await auth.stop()
        assert not auth.key_file.exists()

    asyncio.run(scenario())


@pytest.mark.parametrize("metadata,token", [
    ((("authorization", "Bearer abc"),), "abc"),
    ((("authorization", "bearer  abc "),), "abc"),
    ((("x", "y"), ("authorization", b"Bearer abc")), "abc"),
    ((("authorization", "Basic abc"),), None),
    ((("authorization", "Bearer"),), None),
    ((("authorization", "abc"),), None),
    ((), None),
    (None, None),
])
def test_read_bearer(metadata, token):
    assert read_bearer(metadata) == token


class _Details:
    def __init__(self, method: str, metadata=()) -> None:
        self.method = method
        self.invocation_metadata = metadata


def _intercept(interceptor: AuthInterceptor, method: str, metadata=(), handler=None):
    sentinel = handler or grpc.unary_unary_rpc_method_handler(lambda r, c: r)

    async def continuation(details):
        return sentinel

    return sentinel, asyncio.run(interceptor.intercept_service(continuation, _Details(method, metadata)))


def test_interceptor_routes_open_authorized_and_rejected_calls():
    keys = KeyStore()
    interceptor = AuthInterceptor(keys, INFERENCE)
    for method in ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
                   "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                   "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"):
        sentinel, got = _intercept(interceptor, method)
        assert got is sentinel
    method = "/org.pytorch.serve.grpc.inference.InferenceAPIsService/Predictions"
    sentinel, got = _intercept(interceptor, method, (("authorization", f"Bearer {keys.key(INFERENCE)}"),))
    assert got is sentinel
    for shape in (grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler,
                  grpc.stream_unary_rpc_method_handler, grpc.stream_stream_rpc_method_handler):
        original = shape(lambda r, c: r)
        _, denied = _intercept(interceptor, method, (), original)
        assert denied is not original
        assert (denied.request_streaming, denied.response_streaming) == (original.request_streaming,
                                                                          original.response_streaming)
    # a health look-alike outside the exempt prefix is not open
    _, denied = _intercept(interceptor, "/grpc.health.v1.HealthX/Check")
    assert denied is not None and denied.unary_unary is not None


@pytest.mark.parametrize("address,loopback", [
    ("127.0.0.1", True), ("127.8.9.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("example.com", False), ("", False),
])
def test_is_loopback(address, loopback):
    assert is_loopback(address) is loopback


def test_exposed_bind_warnings():
    assert warn_exposed_binds({"inference": "127.0.0.1", "management": "::1"}, token_auth=False, tls=False) == []
    loud = warn_exposed_binds({"inference": "0.0.0.0", "management": "127.0.0.1"}, token_auth=False, tls=True)
    assert len(loud) == 1 and loud[0].startswith("SECURITY WARNING") and "DISABLED" in loud[0]
    loud = warn_exposed_binds({"management": "0.0.0.0"}, token_auth=False, tls=False)
    assert "register models" in loud[0]
    clear = warn_exposed_binds({"inference": "0.0.0.0"}, token_auth=True, tls=False)
    assert len(clear) == 1 and "clear text" in clear[0]
    assert warn_exposed_binds({"inference": "0.0.0.0"}, token_auth=True, tls=True) == []


@pytest.mark.parametrize("url,error", [
    ("https://models.example.com/a/m.mar", None),
    ("HTTPS://Models.Example.COM/a/m.mar", None),  # scheme and host are case-insensitive
    ("https://models.example.com/A/m.mar", PermissionDenied),  # the path is not
    ("https://models.example.com.evil.net/a/m.mar", PermissionDenied),
    ("https://evil.net/?https://models.example.com/a/m.mar", PermissionDenied),
    ("https://models.example.com/a/../b/m.mar", InvalidArgument),
    ("https://models.example.com/a/%2E%2E/b/m.mar", InvalidArgument),
    ("https://models.example.com/a/%252e%252e/m.mar", InvalidArgument),
    ("https://models.example.com/a/..%5cm.mar", InvalidArgument),
    ("https://u:p@models.example.com/a/m.mar", InvalidArgument),
    ("https:///a/m.mar", InvalidArgument),
    ("s3://bucket/a/m.mar", InvalidArgument),
    ("file:///store/m.mar", InvalidArgument),
])
def test_url_policy(url, error):
    policy = UrlPolicy((r"https://models\.example\.com/a/.*",))
    if error is None:
        policy.check(url)
    else:
        with pytest.raises(error):
            policy.check(url)


def test_default_url_policy_allows_no_remote_url():
    for url in ("http://127.0.0.1/m.mar", "https://example.com/m.mar", "http://169.254.169.254/"):
        with pytest.raises(PermissionDenied):
            UrlPolicy().check(url)


@pytest.mark.parametrize("url,remote", [
    ("m.mar", False), ("sub/m.mar", False), ("/abs/m.mar", False), ("file:///s/m.mar", False),
    ("http://h/m.mar", True), ("HTTPS://h/m.mar", True), ("s3://b/m.mar", True), ("", False),
])
def test_is_remote_url(url, remote):
    assert is_remote_url(url) is remote


def test_security_properties():
    settings = Settings()
    assert (settings.disable_token_auth, settings.enable_model_api, settings.allowed_urls,
            settings.token_expiration_min, settings.enable_grpc_ssl) == (False, False, [], None, False)
    apply_properties(settings, {
        "token_expiration_min": "0.5", "allowed_urls": r"https://a\.example/.*, file://.*",
        "enable_grpc_ssl": "true", "certificate_file": "c.pem", "private_key_file": "k.pem",
        "client_ca_file": "ca.pem", "max_download_size": "1000", "download_timeout": "2.5",
        "grpc_health_port": "0"}, "test")
    assert settings.token_expiration_min == 0.5
    assert settings.allowed_urls == [r"https://a\.example/.*", "file://.*"]
    assert (settings.max_download_size, settings.download_timeout_s, settings.health_port) == (1000, 2.5, 0)
    tls.validate(settings)
    for key, value in (("token_expiration_min", "0"), ("token_expiration_min", "-1"),
                       ("allowed_urls", "http://(unclosed"), ("download_timeout", "nan")):
        with pytest.raises(ConfigError, match=key):
            apply_properties(Settings(), {key: value}, "test")


def test_tls_settings_must_fit_together(tmp_path: Path):
    with pytest.raises(ConfigError, match="certificate_file and private_key_file"):
        tls.validate(Settings(enable_grpc_ssl=True))
    with pytest.raises(ConfigError, match="needs TLS"):
        tls.validate(Settings(client_ca_file=Path("ca.pem")))
    assert tls.server_credentials(Settings()) is None
    (tmp_path / "not.pem").write_text("plain text")
    with pytest.raises(OSError, match="not PEM"):
        tls.server_credentials(Settings(enable_grpc_ssl=True, certificate_file=tmp_path / "not.pem",
                                        private_key_file=tmp_path / "not.pem"))


def test_fixed_keys_are_used_and_never_rotate():
    from inference_service.security.auth import KeyStore

    now = [0.0]
    store = KeyStore(0.01, clock=lambda: now[0], fixed={"inference": "i" * 20})
    assert store.key("inference") == "i" * 20 and store.verify("inference", "i" * 20)
    before = store.key("management")
    now[0] += 3600
    store.rotate_due()
    assert store.key("inference") == "i" * 20 and store.key("management") != before
    with pytest.raises(ValueError, match="16 characters"):
        KeyStore(fixed={"inference": "short"})


def test_short_key_from_environment_is_a_config_error(monkeypatch):
    from inference_service.cli import build_parser, settings_from_args
    from inference_service.config import ConfigError

    monkeypatch.setenv("INFERENCE_SERVICE_INFERENCE_KEY", "short")
    with pytest.raises(ConfigError, match="INFERENCE_SERVICE_INFERENCE_KEY"):
        settings_from_args(build_parser().parse_args([]))


def test_fixed_keys_from_the_flag_a_file_or_the_environment(monkeypatch, tmp_path):
    """--api-key > --api-key-file > INFERENCE_SERVICE_INFERENCE_KEY; --management-key-file >
    INFERENCE_SERVICE_MANAGEMENT_KEY; a short key, an empty or unreadable file: a config error
    naming where it came from."""
    from inference_service.cli import build_parser, settings_from_args
    from inference_service.config import ConfigError

    def settings(*argv: str):
        return settings_from_args(build_parser().parse_args(list(argv)))

    monkeypatch.setenv("INFERENCE_SERVICE_INFERENCE_KEY", "e" * 20)
    monkeypatch.setenv("INFERENCE_SERVICE_MANAGEMENT_KEY", "m" * 20)
    key_file, management_file = tmp_path / "inference.key", tmp_path / "management.key"
    key_file.write_text("f" * 24 + "\n")
    management_file.write_text("g" * 24)
    assert (settings().inference_key, settings().management_key) == ("e" * 20, "m" * 20)
    chosen = settings("--api-key-file", str(key_file), "--management-key-file", str(management_file))
    assert (chosen.inference_key, chosen.management_key) == ("f" * 24, "g" * 24)
    assert settings("--api-key", "a" * 16, "--api-key-file", str(key_file)).inference_key == "a" * 16
    with pytest.raises(ConfigError, match="--api-key must have at least 16"):
        settings("--api-key", "short")
    (tmp_path / "empty.key").write_text("\n")
    with pytest.raises(ConfigError, match="--api-key-file .*empty.key is empty"):
        settings("--api-key-file", str(tmp_path / "empty.key"))
    with pytest.raises(ConfigError, match="cannot read --management-key-file"):
        settings("--management-key-file", str(tmp_path / "missing.key"))


def test_keys_never_begin_with_a_dash_that_a_command_line_reads_as_an_option():
    keys = [new_key() for _ in range(2000)]  # a generator that allowed it fails here but 1 time in 1e13
    assert not [k for k in keys if k.startswith("-")]
    assert all(len(k) == 43 for k in keys) and len(set(keys)) == len(keys)
