"""Security against real servers: token authorization, model API control, allowed URLs, TLS/mTLS,
bind warnings, hardened archives and YAML, JSON (never pickle) on the wire.

TorchServe's history is the checklist: CVE-2023-43654 (SSRF through the register URL), ShellTorch
(open management port + that SSRF + YAML code execution), CVE-2024-35198 (``..`` bypassing
``allowed_urls``), CVE-2024-35199 (ports bound to all interfaces), zip slip. Certificates are
generated here (a throwaway CA); remote archives come from an ``http.server`` on 127.0.0.1.
"""

from __future__ import annotations

import datetime
import http.server
import io
import ipaddress
import json
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from google.protobuf import empty_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import ROOT, ServerProcess, auth_metadata, build_dir, read_key
from inference_service._proto import inference_pb2, inference_pb2_grpc, management_pb2, management_pb2_grpc
from inference_service.archive.model_archive import sanitize_archive_name


@pytest.fixture
def server(shared_server: ServerProcess) -> ServerProcess:
    """This module only reads: tests/conftest.py's session-wide echo server."""
    return shared_server


UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
SERVING = health_pb2.HealthCheckResponse.SERVING


def _code(fn, *args, stream: bool = False, **kwargs) -> tuple[grpc.StatusCode, str]:
    """The status and details of a call that must fail (``stream``: iterate the responses)."""
    with pytest.raises(grpc.RpcError) as err:
        result = fn(*args, **kwargs)
        if stream:
            list(result)
    return err.value.code(), err.value.details() or ""


def _stubs(port: int, credentials: grpc.ChannelCredentials | None = None):
    target = f"127.0.0.1:{port}"
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    return (channel, inference_pb2_grpc.InferenceAPIsServiceStub(channel),
            management_pb2_grpc.ManagementAPIsServiceStub(channel), health_pb2_grpc.HealthStub(channel))


def _predict_req(data: bytes = b"hi", model: str = "echo") -> inference_pb2.PredictionsRequest:
    return inference_pb2.PredictionsRequest(model_name=model, input={"data": data})


# ------------------------------------------------------------------ token authorization
# TorchServe's text (GRPCInterceptor), at the start of the UNAUTHENTICATED details
TOKEN_FAILED = "Token Authorization failed. Token either incorrect, expired, or not provided correctly"


def test_key_file_written_0600_in_torchserve_layout(server):
    key_file = server.workdir / "key_file.json"
    assert server.status["key_file"] == str(key_file)
    assert key_file.stat().st_mode & 0o777 == 0o600
    keys = json.loads(key_file.read_text())
    assert set(keys) == {"management", "inference", "API"}
    assert set(keys["management"]) == set(keys["inference"]) == {"key", "expiration time"}
    assert keys["inference"]["expiration time"] is None  # no token_expiration_min: keys never expire
    assert len({keys[s]["key"] for s in keys}) == 3 and all(len(keys[s]["key"]) >= 32 for s in keys)
    assert f"keys written to {key_file}" in server.log()
    # loopback binds by default (CVE-2024-35199)
    assert server.status["inference_address"] == server.status["management_address"] == "127.0.0.1"


def test_inference_port_needs_the_inference_key(server):
    channel, inference, _, _ = _stubs(server.inference_port)
    keys = json.loads(server.key_file.read_text())
    bad = [(), (("authorization", "Bearer wrong"),), (("authorization", keys["inference"]["key"]),),
           (("authorization", f"Basic {keys['inference']['key']}"),),
           (("authorization", f"Bearer {keys['management']['key']}"),),
           (("authorization", f"Bearer {keys['API']['key']}"),),
           (("authorization", "Bearer " + keys["inference"]["key"][:-1]),)]
    stream2 = inference.StreamPredictions2
    for metadata in bad:
        assert _code(inference.Ping, empty_pb2.Empty(), metadata=metadata, timeout=5)[0] == UNAUTHENTICATED
        code, details = _code(inference.Predictions, _predict_req(), metadata=metadata, timeout=5)
        assert code == UNAUTHENTICATED and details.startswith(TOKEN_FAILED) and "inference key" in details, details
        code, _ = _code(inference.StreamPredictions, _predict_req(), metadata=metadata, timeout=5, stream=True)
        assert code == UNAUTHENTICATED
        code, _ = _code(stream2, iter([_predict_req()]), metadata=metadata, timeout=5, stream=True)
        assert code == UNAUTHENTICATED
    good = (("authorization", f"Bearer {keys['inference']['key']}"),)
    assert "Healthy" in inference.Ping(empty_pb2.Empty(), metadata=good, timeout=5).health
    assert inference.Predictions(_predict_req(b"ok"), metadata=good, timeout=10).prediction == b"ok"
    assert [r.prediction for r in inference.StreamPredictions(_predict_req(b"stream:1"), metadata=good,
                                                              timeout=10)] == [b"part0;", b"end"]
    lower = (("authorization", f"bearer {keys['inference']['key']}"),)
    assert inference.Predictions(_predict_req(b"ok"), metadata=lower, timeout=10).prediction == b"ok"
    channel.close()


def test_management_port_needs_the_management_key(server):
    channel, _, management, _ = _stubs(server.management_port)
    keys = json.loads(server.key_file.read_text())
    requests = [(management.ListModels, management_pb2.ListModelsRequest()),
                (management.DescribeModel, management_pb2.DescribeModelRequest(model_name="echo")),
                (management.RegisterModel, management_pb2.RegisterModelRequest(url="echo.mar", model_name="x")),
                (management.UnregisterModel, management_pb2.UnregisterModelRequest(model_name="echo")),
                (management.ScaleWorker, management_pb2.ScaleWorkerRequest(model_name="echo", min_worker=0)),
                (management.SetDefault, management_pb2.SetDefaultRequest(model_name="echo", model_version="1.0"))]
    for metadata in [(), (("authorization", f"Bearer {keys['inference']['key']}"),)]:
        for rpc, request in requests:
            code, details = _code(rpc, request, metadata=metadata, timeout=5)
            assert code == UNAUTHENTICATED and details.startswith(TOKEN_FAILED) and "management key" in details
    good = (("authorization", f"Bearer {keys['management']['key']}"),)
    models = json.loads(management.ListModels(management_pb2.ListModelsRequest(), metadata=good, timeout=5).msg)
    assert [m["modelName"] for m in models["models"]] == ["echo"]  # nothing above reached the core
    assert server.wait_workers("echo", 2)
    channel.close()


def test_health_stays_open_without_a_key(server):
    for port in (server.inference_port, server.management_port):
        channel, _, _, health = _stubs(port)
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == SERVING
        assert health.Check(health_pb2.HealthCheckRequest(service="model/echo"), timeout=5).status == SERVING
        # an unknown method is UNIMPLEMENTED (not UNAUTHENTICATED), as without authorization
        call = channel.unary_unary("/no.such.Service/Method")
        assert _code(call, b"", timeout=5)[0] == grpc.StatusCode.UNIMPLEMENTED
        channel.close()


def test_handlers_never_see_the_key_and_the_log_never_holds_it(server):
    out = server.predict("echo", "headers")
    assert "authorization" not in json.loads(out)
    keys = json.loads(server.key_file.read_text())
    _, inference, _, _ = _stubs(server.inference_port)
    wrong = (("authorization", f"Bearer {keys['management']['key']}"),)
    assert _code(inference.Predictions, _predict_req(), metadata=wrong, timeout=5)[0] == UNAUTHENTICATED
    log = server.log()
    assert "rejected /org.pytorch.serve.grpc.inference.InferenceAPIsService/Predictions" in log
    for scope in keys:
        assert keys[scope]["key"] not in log


def test_keys_rotate_before_they_expire_and_clients_are_never_locked_out(store, tmp_path):
    config = tmp_path / "config.properties"
    config.write_text("token_expiration_min=0.05\nload_models=echo=echo.mar\ndefault_workers_per_model=1\n")
    srv = ServerProcess(tmp_path / "work", store, ["--ts-config", str(config)])
    try:
        srv.wait_workers("echo", 1)
        first = json.loads(srv.key_file.read_text())
        expires = datetime.datetime.strptime(first["inference"]["expiration time"], "%Y-%m-%dT%H:%M:%S.%fZ")
        expires = expires.replace(tzinfo=datetime.timezone.utc)
        lifetime = (expires - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
        assert 0 < lifetime <= 3.0  # 0.05 min
        assert "API" in first and "expiration time" not in first["API"]
        old = (("authorization", f"Bearer {first['inference']['key']}"),)
        _, raw, _, _ = _stubs(srv.inference_port)
        rotated_at = None
        deadline = time.monotonic() + 20
        # a client that re-reads key_file.json (srv.inference does, per call) never fails; the old key
        # keeps working after the rotation until its own expiration time, then is refused
        while True:
            assert srv.predict("echo", "still in", timeout=5) == b"still in"
            current = read_key(srv.key_file, "inference")
            if rotated_at is None and current != first["inference"]["key"]:
                rotated_at = time.monotonic()
                assert srv.key_file.stat().st_mode & 0o777 == 0o600
                assert read_key(srv.key_file, "API") == first["API"]["key"]  # the API key does not rotate
            try:
                raw.Predictions(_predict_req(b"old"), metadata=old, timeout=5)
            except grpc.RpcError as err:
                assert err.code() == UNAUTHENTICATED
                break
            assert time.monotonic() < deadline, "the old key was never refused"
            time.sleep(0.05)
        assert rotated_at is not None, "the key expired without being rotated first"
        assert datetime.datetime.now(datetime.timezone.utc) >= expires - datetime.timedelta(seconds=0.5)
        assert not list(srv.workdir.glob("key_file.json*.tmp"))
    finally:
        assert srv.stop() == 0
    assert not srv.key_file.exists()


def test_disabled_token_auth_and_loud_warning_on_a_non_loopback_bind(store, tmp_path):
    exposed = ServerProcess(tmp_path / "cli", store, ["--disable-token-auth", "--grpc-inference-address", "0.0.0.0"])
    config = tmp_path / "config.properties"
    config.write_text("disable_token_authorization=true\n")
    from_config = ServerProcess(tmp_path / "file", store, ["--ts-config", str(config)])
    try:
        for srv in (exposed, from_config):
            assert not srv.key_file.exists() and srv.status["key_file"] is None
            _, inference, _, _ = _stubs(srv.inference_port)
            assert "Healthy" in inference.Ping(empty_pb2.Empty(), timeout=5).health
            _, _, management, _ = _stubs(srv.management_port)
            assert json.loads(management.ListModels(management_pb2.ListModelsRequest(), timeout=5).msg)
            # model API off by default, token or not
            code, details = _code(management.RegisterModel,
                                  management_pb2.RegisterModelRequest(url="echo.mar"), timeout=5)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "Model API disabled" in details
        warning = [line for line in exposed.log().splitlines() if "SECURITY WARNING" in line]
        assert len(warning) == 1 and "0.0.0.0" in warning[0] and "inference" in warning[0]
        assert "WARNING" in warning[0]
        assert "SECURITY WARNING" not in from_config.log()
    finally:
        assert exposed.stop() == 0
        assert from_config.stop() == 0


# ------------------------------------------------------------------ allowed URLs, archives, YAML
class _ArchiveHost(http.server.BaseHTTPRequestHandler):
    """Serves the test archives; records every path requested."""

    files: dict[str, bytes] = {}
    requested: list[str] = []
    release = threading.Event()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.requested.append(self.path)
        if self.path in ("/ok/redirect-out", "/ok/redirect-in"):
            self.send_response(302)
            self.send_header("Location", "/bad/echo.mar" if self.path.endswith("out") else "/ok/echo.mar")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path == "/ok/slow.mar":
            self.release.wait(10)
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        if not self.path.endswith("nolength.mar"):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass  # the server gave up reading (size cap)

    def log_message(self, *args) -> None:
        pass


def _zip_slip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": {"modelName": "slip", "handler": "h.py"}}))
        zf.writestr("../../slipped.py", "print('escaped')")
    return buf.getvalue()


@pytest.fixture(scope="module")
def url_env(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, str]]:
    """A server with its own store, allowed_urls for one prefix of a local HTTP server, small caps."""
    root = tmp_path_factory.mktemp("urls")
    ustore = root / "store"
    ustore.mkdir()
    shutil.copy(store / "echo.mar", ustore / "echo.mar")
    shutil.copy(store / "echo.mar", ustore / "weird name;$(id).mar")
    shutil.copy(store / "echo.mar", root / "outside.mar")
    (ustore / "escape.mar").symlink_to(root / "outside.mar")
    (ustore / "slip.mar").write_bytes(_zip_slip())
    build_dir(ustore, "tensor_dir", "tensor_handler.py", model_name="tensor")
    marker = root / "pwned"
    build_dir(ustore, "yaml_rce", "echo_handler.py", model_name="yaml_rce",
              config_yaml=f'minWorkers: 0\nx: !!python/object/apply:os.system ["touch {marker}"]\n')
    echo = (store / "echo.mar").read_bytes()
    _ArchiveHost.files = {"/ok/echo.mar": echo, "/bad/echo.mar": echo, "/ok/slip.mar": _zip_slip(),
                          "/ok/slow.mar": echo, "/ok/big.mar": b"\0" * 300_000,
                          "/ok/big-nolength.mar": b"\0" * 300_000, "/ok/not-an-archive.mar": b"hello"}
    _ArchiveHost.requested = []
    _ArchiveHost.release.clear()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ArchiveHost)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    config = root / "config.properties"
    pattern = base.replace(".", "\\\\.") + "/ok/.*"  # properties escape: \\. is the regex \.
    config.write_text(f"allowed_urls={pattern}\nmax_download_size=100000\ndownload_timeout=1.5\n")
    srv = ServerProcess(root / "work", ustore, ["--enable-model-api", "--ts-config", str(config)])
    try:
        yield srv, base
        assert not marker.exists()
    finally:
        _ArchiveHost.release.set()
        code = srv.stop()
        httpd.shutdown()
        httpd.server_close()
        assert code == 0, srv.log()


def test_allowed_remote_url_is_fetched_and_opened_by_the_same_extraction(url_env):
    srv, base = url_env
    url = f"{base}/ok/echo.mar"
    srv.register(url, model_name="remote", initial_workers=1)
    assert srv.predict("remote", "from afar") == b"from afar"
    assert srv.describe("remote")[0]["modelUrl"] == url
    srv.register(f"{base}/ok/redirect-in", model_name="redirected", initial_workers=0)
    assert not list((srv.workdir / ".inference_service").rglob("*.download"))  # downloads are deleted
    srv.unregister("remote")
    srv.unregister("redirected")


@pytest.mark.parametrize("path,code,text", [
    # TorchServe's texts first (ArchiveUtils.validateURL, ModelArchive.downloadModel), then why
    ("/bad/echo.mar", grpc.StatusCode.PERMISSION_DENIED, "Given URL {url} does not match any allowed URL(s)"),
    ("/ok/../bad/echo.mar", grpc.StatusCode.INVALID_ARGUMENT, "Relative path is not allowed in url: {url}"),
    ("/ok/%2e%2e/bad/echo.mar", grpc.StatusCode.INVALID_ARGUMENT, "Relative path is not allowed in url: {url}"),
    ("/ok/%252e%252e/bad/echo.mar", grpc.StatusCode.INVALID_ARGUMENT, "Relative path is not allowed in url: {url}"),
    ("/ok/..%2fbad/echo.mar", grpc.StatusCode.INVALID_ARGUMENT, "Relative path is not allowed in url: {url}"),
])
def test_refused_remote_urls_are_never_fetched(url_env, path, code, text):
    srv, base = url_env
    before = list(_ArchiveHost.requested)
    got, details = _code(srv.register, base + path, model_name="nope", initial_workers=0)
    assert got == code and details.startswith(text.format(url=base + path)), details
    assert _ArchiveHost.requested == before  # checked before anything was fetched (SSRF)


def test_remote_url_forms_refused_before_fetching(url_env):
    srv, base = url_env
    port = base.rsplit(":", 1)[1]
    for url, code, text in [
        (f"http://user:pw@127.0.0.1:{port}/ok/echo.mar", grpc.StatusCode.INVALID_ARGUMENT, "credentials"),
        (f"HTTP://127.0.0.1:{port}/OK/echo.mar", grpc.StatusCode.PERMISSION_DENIED, "allowed_urls"),
        (f"http://localhost:{port}/ok/echo.mar", grpc.StatusCode.PERMISSION_DENIED, "allowed_urls"),
        ("ftp://127.0.0.1/ok/echo.mar", grpc.StatusCode.INVALID_ARGUMENT, "not supported"),
        ("http://169.254.169.254/latest/meta-data/", grpc.StatusCode.PERMISSION_DENIED, "allowed_urls"),
    ]:
        got, details = _code(srv.register, url, model_name="nope", initial_workers=0)
        assert got == code and text in details, (url, details)


def test_remote_download_limits(url_env):
    srv, base = url_env
    cases = [
        ("/ok/redirect-out", grpc.StatusCode.PERMISSION_DENIED, "allowed_urls"),  # redirect leaves the allowed set
        ("/ok/big.mar", grpc.StatusCode.INVALID_ARGUMENT, "max_download_size"),
        ("/ok/big-nolength.mar", grpc.StatusCode.INVALID_ARGUMENT, "max_download_size"),
        ("/ok/missing.mar", grpc.StatusCode.NOT_FOUND, "404"),
        ("/ok/not-an-archive.mar", grpc.StatusCode.INVALID_ARGUMENT, "not a model archive"),
        ("/ok/slip.mar", grpc.StatusCode.INVALID_ARGUMENT, "outside the archive"),  # same hardened extraction
    ]
    for path, code, text in cases:
        got, details = _code(srv.register, base + path, model_name="nope", initial_workers=0)
        assert got == code and text in details, (path, details)
    assert "/bad/echo.mar" not in _ArchiveHost.requested
    start = time.monotonic()
    got, details = _code(srv.register, base + "/ok/slow.mar", model_name="nope", initial_workers=0)
    assert got == grpc.StatusCode.DEADLINE_EXCEEDED and "1.5 s" in details
    assert time.monotonic() - start < 8
    _ArchiveHost.release.set()
    assert not list(srv.workdir.parent.rglob("slipped.py"))
    assert not list((srv.workdir / ".inference_service").rglob("*.download"))


def test_local_paths_stay_inside_the_model_store(url_env):
    srv, _ = url_env
    store = srv.store
    for url in ["../outside.mar", str(store.parent / "outside.mar"), f"file://{store}/%2e%2e/outside.mar",
                f"file://{store}/..%2Foutside.mar", "file:///etc/passwd"]:
        got, details = _code(srv.register, url, model_name="nope", initial_workers=0)
        assert got == grpc.StatusCode.INVALID_ARGUMENT and "outside the model store" in details, (url, details)
    # a link placed in the store is the operator's choice and is followed, as TorchServe does
    # (tests/integration/test_model_store_links.py); the names above are what the API may not do
    srv.register("escape.mar", model_name="linked", initial_workers=0)
    srv.unregister("linked")
    code, details = _code(srv.register, "slip.mar", model_name="nope", initial_workers=0)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "outside the archive" in details
    assert not list(store.parent.rglob("slipped.py"))
    srv.register(f"file://{store}/echo.mar", model_name="by_file_url", initial_workers=0)
    srv.unregister("by_file_url")


def test_urls_with_control_characters_are_refused(url_env):
    srv, base = url_env
    before = list(_ArchiveHost.requested)
    for url in ["echo.mar\r\nX: y", "echo.mar\n", "echo.mar\x00", "\techo.mar", "echo\x7f.mar", "echo\x85.mar",
                f"file://{srv.store}/echo.mar%0d%0aX: y", f"{base}/ok/a\nb.mar",
                f"{base}/ok/echo.mar\r\nX-Injected: 1", f"{base}/ok/echo.mar\x00"]:
        got, details = _code(srv.register, url, model_name="nope", initial_workers=0)
        assert got == grpc.StatusCode.INVALID_ARGUMENT and "contains control characters" in details, (url, details)
        assert "\n" not in details and "\r" not in details  # the message shows them escaped
    assert _ArchiveHost.requested == before  # refused before anything was fetched


def test_archive_names_are_sanitised(url_env):
    srv, _ = url_env
    srv.register("weird name;$(id).mar", model_name="weird", initial_workers=0)
    extracted = [p.name for p in (srv.workdir / ".inference_service").glob("models-*/*")]
    assert any(name.startswith("weird_name___id_-") for name in extracted), extracted
    assert all(set(name) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")
               for name in extracted), extracted
    srv.unregister("weird")
    for name in ("../evil", "a/b", "x y", "a\\b", "caf\u00e9"):
        got, _ = _code(srv.register, "echo.mar", model_name=name, initial_workers=0)
        assert got == grpc.StatusCode.INVALID_ARGUMENT, name


@pytest.mark.parametrize("name,stem", [
    ("echo.mar", "echo"), ("../../etc/passwd.mar", "passwd"), ("a\\..\\b.tar.gz", "b"), ("", "model"),
    (".hidden.mar", "model"), ("we ird;$(rm -rf).mar", "we_ird___rm_-rf_"), ("x" * 100, "x" * 64),
    ("caf\u00e9\u0000.mar", "caf__"),
])
def test_sanitize_archive_name(name, stem):
    assert sanitize_archive_name(name) == stem


def test_yaml_is_data_never_code(url_env):
    srv, _ = url_env
    code, details = _code(srv.register, "yaml_rce", initial_workers=0)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not valid YAML" in details
    assert not (srv.store.parent / "pwned").exists()


def test_tensor_results_travel_as_json_never_pickle(url_env):
    srv, _ = url_env
    srv.register("tensor_dir", initial_workers=1)
    out = srv.predict("tensor", "x")
    assert not out.startswith(b"\x80")  # pickle's protocol marker
    assert json.loads(out) == [[1.5, 2.0], [3.0, 4.0]]
    assert [json.loads(m) for m in srv.stream("tensor", "stream")] == [[0, 1, 2], [[1.5, 2.0], [3.0, 4.0]]]
    srv.unregister("tensor")


# ------------------------------------------------------------------ TLS and mutual TLS
def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Certificate | None,
           issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool = False, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject))
               .issuer_name(issuer.subject if issuer else _name(subject))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    elif not ca:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(obj) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1, a client certificate, and a rogue client."""
    out = tmp_path_factory.mktemp("pki")
    ca_key, rogue_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _issue("test CA", ca_key, None, ca_key, ca=True)
    rogue_ca = _issue("rogue CA", rogue_key, None, rogue_key, ca=True)
    files: dict[str, Path] = {}
    for name, obj in [("ca", ca)]:
        files[name] = out / f"{name}.pem"
        files[name].write_bytes(_pem(obj))
    for name, issuer, issuer_key, is_server in [("server", ca, ca_key, True), ("client", ca, ca_key, False),
                                                ("rogue", rogue_ca, rogue_key, False)]:
        key = ec.generate_private_key(ec.SECP256R1())
        files[name] = out / f"{name}.pem"
        files[name].write_bytes(_pem(_issue(name, key, issuer, issuer_key, server=is_server)))
        files[f"{name}_key"] = out / f"{name}.key"
        files[f"{name}_key"].write_bytes(_pem(key))
    return files


def _credentials(pki: dict[str, Path], client: str | None = None) -> grpc.ChannelCredentials:
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=pki["ca"].read_bytes())
    return grpc.ssl_channel_credentials(root_certificates=pki["ca"].read_bytes(),
                                        private_key=pki[f"{client}_key"].read_bytes(),
                                        certificate_chain=pki[client].read_bytes())


def test_tls_serves_both_ports_and_refuses_plaintext(store, tmp_path, pki):
    srv = ServerProcess(tmp_path / "work", store,
                        ["--tls-cert", str(pki["server"]), "--tls-key", str(pki["server_key"]),
                         "--grpc-health-port", "0", "--models", "echo=echo.mar", "--workers-per-model", "1"],
                        credentials=_credentials(pki))
    try:
        assert srv.status["tls"] is True
        srv.wait_workers("echo", 1)  # management over TLS, with the management key
        assert srv.predict("echo", "sealed") == b"sealed"
        assert "Healthy" in srv.inference.Ping(empty_pb2.Empty(), timeout=5).health
        key = auth_metadata(srv.key_file, "inference")
        for port in (srv.inference_port, srv.management_port):
            _, inference, _, health = _stubs(port)
            code, _ = _code(inference.Ping, empty_pb2.Empty(), metadata=key, timeout=5)
            assert code == grpc.StatusCode.UNAVAILABLE  # a plaintext client gets no answer from a TLS port
            assert _code(health.Check, health_pb2.HealthCheckRequest(), timeout=5)[0] == grpc.StatusCode.UNAVAILABLE
        # token authorization still applies over TLS
        _, tls_inference, _, _ = _stubs(srv.inference_port, _credentials(pki))
        assert _code(tls_inference.Ping, empty_pb2.Empty(), timeout=5)[0] == UNAUTHENTICATED
        # the plaintext health-only port, for probes
        _, inference, _, health = _stubs(srv.status["health_port"])
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == SERVING
        assert health.Check(health_pb2.HealthCheckRequest(service="model/echo"), timeout=5).status == SERVING
        assert _code(inference.Ping, empty_pb2.Empty(), metadata=key, timeout=5)[0] == grpc.StatusCode.UNIMPLEMENTED
        assert "(TLS)" in srv.log() and "health-only port (plaintext)" in srv.log()
    finally:
        assert srv.stop() == 0


def test_mutual_tls_requires_a_client_certificate_from_the_ca(store, tmp_path, pki):
    config = tmp_path / "config.properties"
    config.write_text(f"enable_grpc_ssl=true\ncertificate_file={pki['server']}\nprivate_key_file={pki['server_key']}\n"
                      f"client_ca_file={pki['ca']}\n")
    srv = ServerProcess(tmp_path / "work", store,
                        ["--ts-config", str(config), "--models", "echo=echo.mar", "--workers-per-model", "1"],
                        credentials=_credentials(pki, "client"))
    try:
        srv.wait_workers("echo", 1)  # management over mTLS, with the management key
        assert "Healthy" in srv.inference.Ping(empty_pb2.Empty(), timeout=5).health
        # the reference client over mutual TLS, with the key file
        (tmp_path / "in.txt").write_text("mutual")
        client = [sys.executable, str(ROOT / "clients" / "torchserve_grpc_client.py"),
                  "--inference-port", str(srv.inference_port), "--key-file", str(srv.key_file),
                  "--tls-ca", str(pki["ca"]), "infer", "echo", str(tmp_path / "in.txt")]
        mtls = ["--tls-cert", str(pki["client"]), "--tls-key", str(pki["client_key"])]
        out = subprocess.run(client + mtls, capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0 and out.stdout.strip() == "mutual", out.stderr
        out = subprocess.run(client, capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 1 and "UNAVAILABLE" in out.stderr
        key = auth_metadata(srv.key_file, "inference")
        for creds in (_credentials(pki), _credentials(pki, "rogue")):  # no client cert; a cert of another CA
            _, inference, _, health = _stubs(srv.inference_port, creds)
            assert _code(inference.Ping, empty_pb2.Empty(), metadata=key, timeout=5)[0] == grpc.StatusCode.UNAVAILABLE
            assert _code(health.Check, health_pb2.HealthCheckRequest(), timeout=5)[0] == grpc.StatusCode.UNAVAILABLE
        # a valid client certificate does not replace the token
        _, inference, _, _ = _stubs(srv.inference_port, _credentials(pki, "client"))
        assert _code(inference.Ping, empty_pb2.Empty(), timeout=5)[0] == UNAUTHENTICATED
        assert "(mutual TLS)" in srv.log()
    finally:
        assert srv.stop() == 0


def test_tls_configuration_errors(store, tmp_path, pki):
    def run(*args: str, config: str | None = None) -> subprocess.CompletedProcess[str]:
        extra = []
        if config is not None:
            (tmp_path / "config.properties").write_text(config)
            extra = ["--ts-config", str(tmp_path / "config.properties")]
        return subprocess.run([sys.executable, "-m", "inference_service", "--foreground", "--ncs",
                               "--model-store", str(store), "--grpc-inference-port", "0",
                               "--grpc-management-port", "0", *extra, *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)

    proc = run("--tls-client-ca", str(pki["ca"]))
    assert proc.returncode == 2 and "needs TLS" in proc.stderr
    proc = run(config="enable_grpc_ssl=true\n")
    assert proc.returncode == 2 and "certificate_file and private_key_file" in proc.stderr
    proc = run("--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(pki["server_key"]))
    assert proc.returncode == 1 and "cannot read the TLS certificate_file" in proc.stderr
    assert not (tmp_path / "key_file.json").exists()
