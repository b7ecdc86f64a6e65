"""The HTTP management API's statuses under ``http_management_status_codes``: this server's, and
TorchServe 0.12's.

Two real servers with the model API on, token authorization on and ``allowed_urls`` open to a
local archive host: ``ours`` with the default codes, ``ts`` with the option (from
``config.properties``; the flag is checked by :func:`test_option_from_flag_and_file`). TorchServe's
answers come from its ``HttpRequestHandler``, ``ManagementRequestHandler``, ``ApiUtils``,
``ModelArchive``, ``HttpUtils`` and ``WorkLoadManager``, and its regression data
(``test/postman/management_data.json``: "Model Re-Registration Densenet161" 500, "Register Model -
Empty URL" 404, "Register Model - Invalid URL" 400, "... negative min worker Count" 500).
"""

from __future__ import annotations

import http.client
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import ServerProcess, read_key, wait_for
from inference_service._proto import management_pb2
from inference_service.cli import build_parser, settings_from_args
from inference_service.config import ConfigError

TOKEN_FAILED = "Token Authorization failed. Token either incorrect, expired, or not provided correctly"


class _ArchiveHost(http.server.BaseHTTPRequestHandler):
    """``/ok/echo.mar`` and ``/ok/remote.mar``: the archive; ``/err/...``: 500; anything else: 404."""

    archive = b""

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.startswith("/err/"):
            self.send_error(500)
            return
        if self.path not in ("/ok/echo.mar", "/ok/remote.mar"):
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.archive)))
        self.end_headers()
        self.wfile.write(self.archive)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def archive_host(store: Path) -> Iterator[str]:
    """A local HTTP server for remote register URLs; its base URL."""
    _ArchiveHost.archive = (store / "echo.mar").read_bytes()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ArchiveHost)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _start(work: Path, store: Path, archive_host: str, option: str | None) -> ServerProcess:
    pattern = archive_host.replace(".", "\\\\.") + "/.*"  # properties escape: \\. is the regex \.
    config = work / "config.properties"
    config.write_text(f"enable_model_api=true\nallowed_urls={pattern}\n"
                      + (f"http_management_status_codes={option}\n" if option else ""))
    srv = ServerProcess(work, store, ["--ts-config", str(config), "--models", "echo=echo.mar",
                                      "--workers-per-model", "1"])
    srv.archive_host = archive_host  # type: ignore[attr-defined]
    return srv


@pytest.fixture(scope="module")
def ours(store: Path, archive_host: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = _start(tmp_path_factory.mktemp("codes_ours"), store, archive_host, None)
    try:
        srv.wait_workers("echo", 1, timeout=60)
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def ts(store: Path, archive_host: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = _start(tmp_path_factory.mktemp("codes_ts"), store, archive_host, "torchserve")
    try:
        srv.wait_workers("echo", 1, timeout=60)
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def call(server: ServerProcess, method: str, path: str, *, body: Any = None, key: str | None = "",
         timeout: float = 60) -> tuple[int, dict[str, str], Any]:
    """One request (``body``: sent as JSON) on a fresh connection with ``key`` ("": the management
    key, ``None``: none); (status, headers, parsed body)."""
    key = read_key(server.key_file, "management") if key == "" else key
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    raw = b""
    if body is not None:
        raw, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    path = path.replace("{host}", getattr(server, "archive_host", ""))
    conn = http.client.HTTPConnection("127.0.0.1", server.status["http_management_port"], timeout=timeout)
    try:
        conn.request(method, path, body=raw, headers=headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())
    finally:
        conn.close()


def refusal(server: ServerProcess, method: str, path: str, **kwargs: Any) -> tuple[int, str]:
    """(status, type) of a refusal; its body keeps TorchServe's shape, its code the status."""
    status, _, body = call(server, method, path, **kwargs)
    assert set(body) == {"code", "type", "message"} and body["code"] == status, body
    assert isinstance(body["message"], str) and body["message"], body
    return status, body["type"]


# (method, path, JSON body or None, this server's answer, the option's: TorchServe 0.12's but where noted)
ROWS: list[tuple[str, str, Any, tuple[int, str], tuple[int, str]]] = [
    ("POST", "/models?url=&model_name=empty", None, (400, "BadRequestException"), (404, "ModelNotFoundException")),
    ("POST", "/models", {"url": "", "model_name": "empty"}, (400, "BadRequestException"),
     (404, "ModelNotFoundException")),
    ("POST", "/models?url={host}/ok/missing.mar", None, (404, "ModelNotFoundException"),
     (400, "DownloadArchiveException")),
    ("POST", "/models?url={host}/err/other.mar", None, (503, "ServiceUnavailableException"),
     (400, "DownloadArchiveException")),
    ("PUT", "/models/echo?min_worker=-1", None, (400, "BadRequestException"), (500, "IndexOutOfBoundsException")),
    ("PUT", "/models/echo?min_worker=-2&max_worker=-1", None, (400, "BadRequestException"),
     (500, "IndexOutOfBoundsException")),
    ("PUT", "/models/nosuch?min_worker=-1", None, (400, "BadRequestException"), (404, "ModelNotFoundException")),
    ("POST", "/models?url=http://archives.invalid/echo.mar", None, (403, "ForbiddenException"),
     (404, "ModelNotFoundException")),
    ("POST", "/models?url=../echo.mar", None, (400, "BadRequestException"), (404, "ModelNotFoundException")),
    # the same in both
    ("POST", "/models", None, (400, "BadRequestException"), (400, "BadRequestException")),
    ("POST", "/models", {"url": None, "model_name": "nourl"}, (400, "BadRequestException"),
     (400, "BadRequestException")),
    ("POST", "/models?url=missing.mar", None, (404, "ModelNotFoundException"), (404, "ModelNotFoundException")),
    ("PUT", "/models/echo?max_worker=-1", None, (400, "BadRequestException"), (400, "BadRequestException")),
    ("PUT", "/models/echo?min_worker=-1&max_worker=-2", None, (400, "BadRequestException"),
     (400, "BadRequestException")),
    ("PUT", "/models/echo?min_worker=-1&max_worker=2", None, (400, "BadRequestException"),
     (400, "BadRequestException")),  # TorchServe accepts it (documented as still different)
    ("PUT", "/models/echo?min_worker=3&max_worker=1", None, (400, "BadRequestException"),
     (400, "BadRequestException")),
    ("GET", "/models/nosuch", None, (404, "ModelNotFoundException"), (404, "ModelNotFoundException")),
    ("POST", "/models?url=echo.mar&model_name=echo", None, (409, "ConflictStatusException"),
     (409, "ConflictStatusException")),
]


@pytest.mark.parametrize("codes", ["ours", "ts"])
def test_refusals_answer_the_chosen_statuses(codes: str, request: pytest.FixtureRequest) -> None:
    srv: ServerProcess = request.getfixturevalue(codes)
    torchserve = codes == "ts"
    for method, path, body, default, theirs in ROWS:
        got = refusal(srv, method, path, body=body)
        assert got == (theirs if torchserve else default), (codes, method, path, body, got)
    # a retryable download failure says Retry-After with this server's 503 only
    headers = call(srv, "POST", "/models?url={host}/err/other.mar")[1]
    assert ("Retry-After" in headers) is not torchserve, headers
    # nothing above changed a model: echo keeps its READY worker, nothing else was registered
    wait_for(lambda: [w["status"] for w in call(srv, "GET", "/models/echo")[2][0]["workers"]] == ["READY"],
             30, 0.1, "echo's one READY worker")
    assert [m["modelName"] for m in call(srv, "GET", "/models")[2]["models"]] == ["echo"]


@pytest.mark.parametrize("codes", ["ours", "ts"])
def test_registering_a_remote_version_again(codes: str, request: pytest.FixtureRequest) -> None:
    srv: ServerProcess = request.getfixturevalue(codes)
    # remote.mar, not echo.mar: TorchServe refuses a URL whose file is in its model store (500)
    path = "/models?url={host}/ok/remote.mar&model_name=remote"
    assert call(srv, "POST", path)[::2] == (
        200, {"status": 'Model "remote" Version: 1.0 registered with 0 initial workers. '
                        "Use scale workers API to add workers for the model."})
    try:
        # TorchServe finds the downloaded file in its model store: 500 (this server: the version's 409)
        expected = (500, "InternalServerException") if codes == "ts" else (409, "ConflictStatusException")
        assert refusal(srv, "POST", path) == expected
        assert refusal(srv, "POST", path + "&initial_workers=1") == expected
        assert [d["modelVersion"] for d in call(srv, "GET", "/models/remote/all")[2]] == ["1.0"]
    finally:
        assert call(srv, "DELETE", "/models/remote")[0] == 200


@pytest.mark.parametrize("codes", ["ours", "ts"])
def test_a_remote_url_whose_file_is_in_the_store(codes: str, request: pytest.FixtureRequest) -> None:
    """TorchServe looks for the URL's file name in its model store before downloading: 500."""
    srv: ServerProcess = request.getfixturevalue(codes)
    path = "/models?url={host}/ok/echo.mar&model_name=stored"
    if codes == "ts":
        assert refusal(srv, "POST", path) == (500, "InternalServerException")
        assert call(srv, "GET", "/models/stored")[0] == 404
        return
    assert call(srv, "POST", path)[0] == 200  # downloaded and registered
    assert call(srv, "DELETE", "/models/stored")[0] == 200


@pytest.mark.parametrize("codes", ["ours", "ts"])
def test_a_missing_or_wrong_key(codes: str, request: pytest.FixtureRequest) -> None:
    srv: ServerProcess = request.getfixturevalue(codes)
    for key, method, path in ((None, "GET", "/models"), ("not-the-key", "PUT", "/models/echo?min_worker=-1"),
                              (read_key(srv.key_file, "inference"), "POST", "/models?url=")):
        status, headers, body = call(srv, method, path, key=key)
        if codes == "ts":  # TorchServe's InvalidKeyException is a ModelException: 400
            assert (status, body) == (400, {"code": 400, "type": "InvalidKeyException", "message": TOKEN_FAILED})
            assert "WWW-Authenticate" not in headers
        else:
            assert (status, body) == (401, {"code": 401, "type": "InvalidKeyException", "message": TOKEN_FAILED})
            assert headers["WWW-Authenticate"] == "Bearer"
    assert call(srv, "GET", "/models")[0] == 200


def test_option_from_flag_and_file(tmp_path: Path) -> None:
    def settings(*args: str):
        return settings_from_args(build_parser().parse_args(list(args)))

    assert settings().http_management_status_codes == "default"
    assert settings("--http-management-status-codes", "torchserve").http_management_status_codes == "torchserve"
    assert settings().grpc_status_codes == "default"  # the gRPC option is its own
    config = tmp_path / "config.properties"
    config.write_text("http_management_status_codes=torchserve\n")
    assert settings("--ts-config", str(config)).http_management_status_codes == "torchserve"
    assert settings("--ts-config", str(config), "--http-management-status-codes", "default") \
        .http_management_status_codes == "default"  # the flag wins
    config.write_text("http_management_status_codes=java\n")
    with pytest.raises(ConfigError, match="http_management_status_codes"):
        settings("--ts-config", str(config))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--http-management-status-codes", "java"])


def test_the_grpc_api_keeps_its_codes(ts: ServerProcess) -> None:
    """The HTTP option leaves gRPC's codes as they are (``grpc_status_codes`` is not set)."""
    with pytest.raises(grpc.RpcError) as err:
        ts.management.ScaleWorker(management_pb2.ScaleWorkerRequest(model_name="echo", min_worker=-1), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        ts.register(f"{ts.archive_host}/ok/missing.mar")  # type: ignore[attr-defined]
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "org.pytorch" not in (err.value.details() or "")
