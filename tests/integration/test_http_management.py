"""TorchServe's HTTP/1.1 management API (``/models``, ``/token``) against the real server.

Requests are TorchServe's documented curl examples (its docs/management_api.md and
token_authorization_api.md) sent with a plain ``http.client``; the expected status codes and
bodies are TorchServe 0.12's (its ``ManagementRequestHandler``, ``ApiUtils`` and
``ModelServerTest``). Models run in real worker processes behind the core the gRPC management
API uses, and what one API changes the other sees. ``server`` (conftest) has the model API on
and echo loaded with 2 workers; ``locked`` has neither the model API nor token authorization.
"""

from __future__ import annotations

import http.client
import json
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import ServerProcess, read_key, wait_for
from inference_service._proto import inference_pb2, management_pb2
from inference_service.cli import build_parser, settings_from_args
from inference_service.config import ConfigError

TOKEN_FAILED = "Token Authorization failed. Token either incorrect, expired, or not provided correctly"
NOT_ALLOWED = "Requested method is not allowed, please refer to API document."
ZERO_WORKERS = " registered with 0 initial workers. Use scale workers API to add workers for the model."


@pytest.fixture(scope="module")
def locked(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server as TorchServe starts by default for the model API (off), token authorization off."""
    plain = ServerProcess(tmp_path_factory.mktemp("http_management_locked"), store,
                          ["--disable-token-auth", "--models", "echo=echo.mar", "--workers-per-model", "1"])
    try:
        plain.wait_workers("echo", 1)
        yield plain
    finally:
        assert plain.stop() == 0, plain.log()


def call(server: ServerProcess, method: str, path: str, *, key: str | None = "management",
         body: bytes = b"", headers: dict[str, str] | None = None,
         timeout: float = 120) -> tuple[int, http.client.HTTPResponse, Any]:
    """One request on a fresh connection with the ``key`` scope's key (``None``: none); returns
    (status, response, body parsed as JSON)."""
    sent = dict(headers or {})
    if key is not None:
        sent["Authorization"] = f"Bearer {read_key(server.key_file, key)}"
    conn = http.client.HTTPConnection("127.0.0.1", server.status["http_management_port"], timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        raw = response.read()
        return response.status, response, json.loads(raw)
    finally:
        conn.close()


def error(answer: tuple[int, http.client.HTTPResponse, Any]) -> tuple[int, str, str]:
    """(status, type, message) of TorchServe's error body, its code field checked against the status."""
    status, _, body = answer
    assert set(body) == {"code", "type", "message"} and body["code"] == status, body
    return status, body["type"], body["message"]


def described(server: ServerProcess, path: str) -> list[dict[str, Any]]:
    status, _, body = call(server, "GET", path)
    assert status == 200, body
    return body


def ready_workers(server: ServerProcess, name: str, count: int, timeout: float = 60) -> None:
    """Wait (under ``timeout``) until ``GET /models/{name}`` shows ``count`` READY workers."""
    wait_for(lambda: len([w for w in described(server, f"/models/{name}")[0]["workers"]
                          if w["status"] == "READY"]) == count, timeout, 0.1, f"{name}: {count} READY workers")


def test_port_is_reported_logged_and_loopback(server):
    port = server.status["http_management_port"]
    assert isinstance(port, int) and port > 0 and server.status["http_management_address"] == "127.0.0.1"
    assert f"HTTP management API listening on 127.0.0.1:{port} (plaintext)" in server.log()
    assert port not in (server.status["http_port"], server.status["management_port"])


def test_token_authorization_wants_the_management_key(server):
    inference_key = read_key(server.key_file, "inference")
    api_key = json.loads(server.key_file.read_text())["API"]["key"]
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": f"Bearer {inference_key}"},
                    {"Authorization": f"Bearer {api_key}"}, {"Authorization": "Basic abc"}):
        for method, path in (("GET", "/models"), ("POST", "/models?url=echo.mar"), ("DELETE", "/models/echo"),
                             ("PUT", "/models/echo?min_worker=3"), ("GET", "/no/such/path")):
            answer = call(server, method, path, key=None, headers=headers)
            assert error(answer) == (401, "InvalidKeyException", TOKEN_FAILED), (headers, method, path)
            assert answer[1].getheader("WWW-Authenticate") == "Bearer"
    assert call(server, "GET", "/models")[0] == 200
    assert described(server, "/models/echo")[0]["minWorkers"] == 2  # nothing above went through
    log = server.log()
    assert "rejected HTTP GET /models: missing token" in log
    assert read_key(server.key_file, "management") not in log and inference_key not in log


def test_register_describe_list_unregister_as_documented(server):
    # curl -X POST "http://localhost:8081/models?url=...": no initial workers, 200
    status, response, body = call(server, "POST", "/models?url=echo.mar&model_name=hm_doc")
    assert (status, body) == (200, {"status": 'Model "hm_doc" Version: 1.0' + ZERO_WORKERS})
    assert response.getheader("Content-Type") == "application/json; charset=utf-8"
    # curl http://localhost:8081/models/noop: DescribeModel's array, as gRPC's DescribeModel
    desc = described(server, "/models/hm_doc")
    assert len(desc) == 1 and (desc[0]["modelName"], desc[0]["modelVersion"]) == ("hm_doc", "1.0")
    assert (desc[0]["modelUrl"], desc[0]["minWorkers"], desc[0]["workers"]) == ("echo.mar", 0, [])
    assert desc[0]["jobQueueStatus"] == {"remainingCapacity": 100, "pendingRequests": 0}
    assert desc == server.describe("hm_doc")
    assert described(server, "/models/hm_doc/1.0") == desc and described(server, "/models/hm_doc/all") == desc
    # curl http://localhost:8081/models: names sorted, the default version's URL
    status, _, body = call(server, "GET", "/models")
    assert status == 200 and {"modelName": "hm_doc", "modelUrl": "echo.mar"} in body["models"]
    # curl -X DELETE http://localhost:8081/models/noop/1.0
    assert call(server, "DELETE", "/models/hm_doc/1.0")[::2] == (200, {"status": 'Model "hm_doc" unregistered'})
    assert error(call(server, "GET", "/models/hm_doc"))[:2] == (404, "ModelNotFoundException")
    with pytest.raises(grpc.RpcError) as err:  # one registry: gRPC no longer sees it either
        server.describe("hm_doc")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_register_synchronous_and_asynchronous(server):
    # synchronous (TorchServe's default on HTTP): 200 once the workers are READY
    status, _, body = call(server, "POST", "/models?initial_workers=1&url=echo.mar&model_name=hm_sync")
    assert (status, body) == (200, {"status": 'Model "hm_sync" Version: 1.0 registered with 1 initial workers'})
    assert [w["status"] for w in described(server, "/models/hm_sync")[0]["workers"]] == ["READY"]
    assert server.predict("hm_sync", "served") == b"served"
    # asynchronous: 202 at once, the worker comes up afterwards
    status, _, body = call(server, "POST",
                           "/models?initial_workers=1&synchronous=false&url=echo.mar&model_name=hm_async")
    assert (status, body) == (202, {"status": "Processing worker updates..."})
    ready_workers(server, "hm_async", 1)
    for name in ("hm_sync", "hm_async"):
        assert call(server, "DELETE", f"/models/{name}")[0] == 200


def test_register_from_a_json_body(server):
    # TorchServe's RegisterModelRequest also reads an application/json body (its ModelServerTest)
    body = json.dumps({"url": "echo.mar", "model_name": "hm_json", "initial_workers": 1, "synchronous": True,
                       "batch_size": 2, "max_batch_delay": 30, "response_timeout": 9}).encode()
    status, _, answer = call(server, "POST", "/models", body=body, headers={"Content-Type": "application/json"})
    assert (status, answer) == (200, {"status": 'Model "hm_json" Version: 1.0 registered with 1 initial workers'})
    desc = described(server, "/models/hm_json")[0]
    assert (desc["batchSize"], desc["maxBatchDelay"], desc["responseTimeout"]) == (2, 30, 9)
    assert call(server, "DELETE", "/models/hm_json")[0] == 200
    for bad in (b"{not json", b"[1, 2]"):
        assert error(call(server, "POST", "/models", body=bad, headers={"Content-Type": "application/json"}))[:2] == \
            (400, "BadRequestException")


def test_register_errors(server):
    assert error(call(server, "POST", "/models"))[:2] == (400, "BadRequestException")  # no url
    assert error(call(server, "POST", "/models?url=missing.mar"))[:2] == (404, "ModelNotFoundException")
    assert error(call(server, "POST", "/models?url=echo.mar&model_name=hm_bad&runtime=InvalidRuntime"))[:2] == \
        (400, "BadRequestException")
    for query, message in (("batch_size=abc", "parameter batch_size must be an integer, got 'abc'"),
                           ("initial_workers=1.5", "parameter initial_workers must be an integer, got '1.5'"),
                           ("synchronous=maybe", "parameter synchronous must be true or false, got 'maybe'"),
                           ("max_batch_delay=99999999999", "parameter max_batch_delay must be an integer")):
        status, kind, text = error(call(server, "POST", f"/models?url=echo.mar&model_name=hm_bad&{query}"))
        assert (status, kind) == (400, "BadRequestException") and text.startswith(message), text
    # a number at or below 0 is unset, as TorchServe reads it
    assert call(server, "POST", "/models?url=echo.mar&model_name=hm_neg&initial_workers=-1&batch_size=0")[::2] == \
        (200, {"status": 'Model "hm_neg" Version: 1.0' + ZERO_WORKERS})
    assert call(server, "DELETE", "/models/hm_neg")[0] == 200
    assert error(call(server, "POST", "/models?url=echo.mar&model_name=bad%20name"))[0] == 400
    # a version registered twice: TorchServe's 409 (its testRegisterModelConflict)
    assert call(server, "POST", "/models?url=echo.mar&model_name=hm_twice")[0] == 200
    status, kind, message = error(call(server, "POST", "/models?url=echo.mar&model_name=hm_twice"))
    assert (status, kind) == (409, "ConflictStatusException") and "already registered" in message
    assert call(server, "DELETE", "/models/hm_twice")[0] == 200
    # a synchronous registration whose worker cannot load: 500 with the handler's error, not registered
    status, kind, message = error(call(server, "POST", "/models?url=broken.mar&initial_workers=1&synchronous=true"))
    assert (status, kind) == (500, "InternalServerException") and "weights are corrupt (test)" in message
    assert error(call(server, "GET", "/models/broken"))[0] == 404
    assert error(call(server, "GET", "/models/hm_bad"))[0] == 404  # none of the bad requests registered it


def _startup_timeout(server: ServerProcess, name: str) -> int:
    return described(server, f"/models/{name}")[0]["startupTimeout"]


def test_startup_timeout_zero_gives_no_time_to_load(server):
    # TorchServe's "Register Model with Additional Params and startup_timeout as 0" (its REST API keeps
    # the 0 for an archive without model-config.yaml): 500, nothing registered
    status, kind, message = error(call(server, "POST", "/models?url=echo.mar&model_name=st0&initial_workers=1"
                                                       "&startup_timeout=0"))
    assert (status, kind) == (500, "InternalServerException") and "startup_timeout=0" in message
    assert error(call(server, "GET", "/models/st0"))[0] == 404
    # without workers it registers (its next case) and keeps the 0: a worker scaled to cannot load
    for query, body in (("?url=echo.mar&model_name=st0&startup_timeout=0", b""),
                        ("", json.dumps({"url": "echo.mar", "model_name": "st0", "startup_timeout": 0}).encode())):
        assert call(server, "POST", "/models" + query, body=body, headers={"Content-Type": "application/json"}
                    if body else None)[0] == 200
        try:
            assert _startup_timeout(server, "st0") == 0
            assert error(call(server, "PUT", "/models/st0?min_worker=1&synchronous=true"))[:2] == \
                (500, "InternalServerException")
        finally:
            assert call(server, "DELETE", "/models/st0")[0] == 200
    assert server.predict("echo", "still serving") == b"still serving"


def test_startup_timeout_zero_elsewhere_is_the_default(server):
    # an empty value is absent; any other value is kept
    for query, expected in (("startup_timeout=", 120), ("startup_timeout=7", 7)):
        assert call(server, "POST", f"/models?url=echo.mar&model_name=st_other&{query}")[0] == 200
        try:
            assert _startup_timeout(server, "st_other") == expected, query
        finally:
            assert call(server, "DELETE", "/models/st_other")[0] == 200
    # an archive with a model-config.yaml (minWorkers 1): TorchServe takes its startupTimeout, 120 unless set
    status, _, body = call(server, "POST", "/models?url=echo_dir&model_name=st_yaml&startup_timeout=0")
    try:
        assert status == 200, body
        assert _startup_timeout(server, "st_yaml") == 120
        assert [w["status"] for w in described(server, "/models/st_yaml")[0]["workers"]] == ["READY"]
    finally:
        assert call(server, "DELETE", "/models/st_yaml")[0] == 200
    # gRPC's RegisterModel: 0 is unset (TorchServe's GRPCUtils.getRegisterParam), so the worker loads
    server.register("echo.mar", model_name="st_grpc", startup_timeout=0, initial_workers=1)
    try:
        assert server.describe("st_grpc")[0]["startupTimeout"] == 120
        assert server.predict("st_grpc", "loaded") == b"loaded"
    finally:
        server.unregister("st_grpc")


def test_scale_workers(server):
    assert call(server, "POST", "/models?url=echo.mar&model_name=hm_scale")[0] == 200
    # curl -v -X PUT "http://localhost:8081/models/noop?min_worker=3&synchronous=true" (2 here: 2 cores)
    answer = call(server, "PUT", "/models/hm_scale?min_worker=2&synchronous=true")
    assert answer[::2] == (200, {"status": "Workers scaled to 2 for model: hm_scale"})
    desc = described(server, "/models/hm_scale")[0]
    assert (desc["minWorkers"], desc["maxWorkers"]) == (2, 2)  # max_worker defaults to min_worker
    assert [w["status"] for w in desc["workers"]] == ["READY", "READY"]
    # curl -v -X PUT "http://localhost:8081/models/noop/2.0?min_worker=3&synchronous=true"
    answer = call(server, "PUT", "/models/hm_scale/1.0?min_worker=1&max_worker=2&synchronous=true")
    assert answer[::2] == (200, {"status": "Workers scaled to 1 for model: hm_scale, version: 1.0"})
    assert (described(server, "/models/hm_scale")[0]["maxWorkers"]) == 2
    # curl -v -X PUT "http://localhost:8081/models/noop?min_worker=3": asynchronous, 202
    answer = call(server, "PUT", "/models/hm_scale?min_worker=2")
    assert answer[::2] == (202, {"status": "Processing worker updates..."})
    ready_workers(server, "hm_scale", 2)
    # no min_worker: TorchServe's default, 1
    answer = call(server, "PUT", "/models/hm_scale?synchronous=true")
    assert answer[::2] == (200, {"status": "Workers scaled to 1 for model: hm_scale"})
    assert server.describe("hm_scale")[0]["minWorkers"] == 1  # the same core as gRPC
    # bad parameters, unknown model and version (TorchServe's testScaleModelNotFound / VersionNotFound)
    assert error(call(server, "PUT", "/models/hm_scale?min_worker=3&max_worker=1"))[:2] == (400, "BadRequestException")
    assert error(call(server, "PUT", "/models/hm_scale?min_worker=two"))[:2] == (400, "BadRequestException")
    assert error(call(server, "PUT", "/models/hm_scale?min_worker=-1"))[0] == 400
    assert error(call(server, "PUT", "/models/fake"))[:2] == (404, "ModelNotFoundException")
    assert error(call(server, "PUT", "/models/hm_scale/1.3.1?min_worker=2&synchronous=true"))[:2] == \
        (404, "ModelNotFoundException")
    assert call(server, "DELETE", "/models/hm_scale")[0] == 200


def test_versions_set_default_and_delete(server):
    assert call(server, "POST", "/models?url=echo.mar&model_name=hm_multi")[0] == 200
    assert call(server, "POST", "/models?url=echo_v2.mar&model_name=hm_multi")[::2] == \
        (200, {"status": 'Model "hm_multi" Version: 2.0' + ZERO_WORKERS})
    # curl http://localhost:8081/models/noop/all
    assert [(d["modelVersion"], d["isDefault"]) for d in described(server, "/models/hm_multi/all")] == \
        [("1.0", True), ("2.0", False)]
    assert described(server, "/models/hm_multi")[0]["modelVersion"] == "1.0"
    assert described(server, "/models/hm_multi/2.0")[0]["modelVersion"] == "2.0"
    assert error(call(server, "GET", "/models/hm_multi/1.3.1"))[:2] == (404, "ModelNotFoundException")
    # the default cannot go while another version exists: TorchServe's 403 (its testUnregisterModelFailure)
    status, kind, message = error(call(server, "DELETE", "/models/hm_multi/1.0"))
    assert (status, kind) == (403, "InvalidModelVersionException") and "default" in message
    # curl -v -X PUT http://localhost:8081/models/noop/2.0/set-default
    assert call(server, "PUT", "/models/hm_multi/2.0/set-default")[::2] == (200, {
        "status": 'Default version successfully updated for model "hm_multi" to "2.0"'})
    assert described(server, "/models/hm_multi")[0]["modelVersion"] == "2.0"
    assert server.describe("hm_multi")[0]["modelVersion"] == "2.0"  # gRPC sees the new default
    assert error(call(server, "PUT", "/models/hm_multi/3.3.3/set-default"))[:2] == (404, "ModelNotFoundException")
    assert error(call(server, "PUT", "/models/fake/1.0/set-default"))[:2] == (404, "ModelNotFoundException")
    assert error(call(server, "DELETE", "/models/hm_multi/1.3.1"))[:2] == (404, "ModelNotFoundException")
    assert call(server, "DELETE", "/models/hm_multi/1.0")[::2] == (200, {"status": 'Model "hm_multi" unregistered'})
    assert call(server, "DELETE", "/models/hm_multi")[0] == 200  # no version: the default
    assert error(call(server, "GET", "/models/hm_multi"))[:2] == (404, "ModelNotFoundException")
    assert error(call(server, "DELETE", "/models/fake"))[:2] == (404, "ModelNotFoundException")


def test_customized_describe_answers_the_description(server):
    plain = described(server, "/models/echo")
    for query in ("customized=true", "customized=false", "customized=TRUE"):
        customized = described(server, f"/models/echo?{query}")
        assert [d["modelName"] for d in customized] == ["echo"] and "customizedMetadata" not in customized[0]
        assert customized[0].keys() == plain[0].keys()
    assert error(call(server, "GET", "/models/echo?customized=yes"))[:2] == (400, "BadRequestException")


def test_list_models_pagination(server):
    names = ["hm_page_a", "hm_page_b", "hm_page_c"]
    for name in names:
        assert call(server, "POST", f"/models?url=echo.mar&model_name={name}")[0] == 200
    try:
        everything = sorted(["echo", *names])
        status, _, first = call(server, "GET", "/models?limit=2")
        assert status == 200 and first["nextPageToken"] == "2"
        assert [m["modelName"] for m in first["models"]] == everything[:2]
        # curl "http://localhost:8081/models?limit=2&next_page_token=2"
        status, _, last = call(server, "GET", "/models?limit=2&next_page_token=2")
        assert status == 200 and "nextPageToken" not in last
        assert [m["modelName"] for m in last["models"]] == everything[2:]
        # the same pages as gRPC's ListModels
        for limit, token in ((2, 0), (2, 2), (0, 0), (3, 1)):
            grpc_page = json.loads(server.management.ListModels(
                management_pb2.ListModelsRequest(limit=limit, next_page_token=token), timeout=30).msg)
            assert call(server, "GET", f"/models?limit={limit}&next_page_token={token}")[2] == grpc_page
        # as TorchServe's getModelList: a limit outside 1..100 is 100, a negative token the first page
        for query in ("limit=-1", "limit=1001", "next_page_token=-2", "limit=0"):
            status, _, page = call(server, "GET", f"/models?{query}")
            assert status == 200 and [m["modelName"] for m in page["models"]] == everything, query
        for query in ("limit=abc", "next_page_token=x", "limit=2.0"):
            assert error(call(server, "GET", f"/models?{query}"))[:2] == (400, "BadRequestException"), query
        # empty values (what a form sends for an unset field) are absent, as on TorchServe; a trailing
        # slash names the same resource
        status, _, page = call(server, "GET", "/models/?limit=&next_page_token=")
        assert status == 200 and [m["modelName"] for m in page["models"]] == everything
        assert call(server, "GET", "/models/hm_page_a/")[0] == 200
        assert call(server, "DELETE", "/models/hm_page_a/")[::2] == (200, {"status": 'Model "hm_page_a" unregistered'})
    finally:
        for name in names:
            call(server, "DELETE", f"/models/{name}")


def test_unknown_paths_and_methods(server):
    # TorchServe's testInvalidModelsMethod, testInvalidModelMethod, testInvalidManagementUri
    for method, path, allowed in (("PUT", "/models", "GET, POST"), ("POST", "/models/echo", "DELETE, GET, PUT"),
                                  ("GET", "/models/echo/1.0/set-default", "PUT")):
        answer = call(server, method, path)
        assert error(answer) == (405, "MethodNotAllowedException", NOT_ALLOWED), (method, path)
        assert answer[1].getheader("Allow") == allowed
    for path in ("/InvalidUrl", "/models/echo/1.0/other", "/models/a/b/c/d"):
        assert error(call(server, "GET", path)) == (404, "ResourceNotFoundException",
                                                  "Requested resource is not found, please refer to API document.")


def test_token_api_renews_one_key(server):
    def api_key() -> dict[str, str]:
        return {"Authorization": f"Bearer {json.loads(server.key_file.read_text())['API']['key']}"}

    old_management, old_inference = read_key(server.key_file, "management"), read_key(server.key_file, "inference")
    # curl localhost:8081/token?type=management -H "Authorization: Bearer {API Token}"
    status, _, body = call(server, "GET", "/token?type=management", key=None, headers=api_key())
    assert (status, body) == (200, {"status": "management key renewed: read it from key_file.json"})
    new_management = read_key(server.key_file, "management")
    assert new_management != old_management and read_key(server.key_file, "inference") == old_inference
    assert stat.S_IMODE(server.key_file.stat().st_mode) == 0o600
    stale = call(server, "GET", "/models", key=None, headers={"Authorization": f"Bearer {old_management}"})
    assert error(stale)[0] == 401  # the replaced key stops working at once
    assert call(server, "GET", "/models")[0] == 200
    with pytest.raises(grpc.RpcError) as err:  # gRPC's management port takes the same keys
        server.management.ListModels(management_pb2.ListModelsRequest(), timeout=30,
                                     metadata=(("authorization", f"Bearer {old_management}"),))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert server.describe("echo")[0]["modelName"] == "echo"  # the new key (re-read from the file) works
    # curl localhost:8081/token?type=inference (TorchServe takes any method)
    status, _, body = call(server, "POST", "/token?type=inference", key=None, headers=api_key())
    assert (status, body) == (200, {"status": "inference key renewed: read it from key_file.json"})
    assert read_key(server.key_file, "inference") != old_inference
    assert read_key(server.key_file, "management") == new_management
    with pytest.raises(grpc.RpcError) as err:
        server.inference.Predictions(inference_pb2.PredictionsRequest(model_name="echo", input={"data": b"x"}),
                                     timeout=30, metadata=(("authorization", f"Bearer {old_inference}"),))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert server.predict("echo", "new key") == b"new key"
    # the API key only; a type TorchServe does not know
    assert error(call(server, "GET", "/token?type=management"))[0] == 401  # the management key is not the API key
    for query in ("", "?type=API", "?type=Management"):
        assert error(call(server, "GET", f"/token{query}", key=None, headers=api_key()))[:2] == \
            (400, "BadRequestException"), query
    assert read_key(server.key_file, "management") == new_management
    assert "key renewed" in server.log() and new_management not in server.log()


def test_model_api_disabled_and_token_authorization_off(locked):
    # TorchServe 0.12's REST API answers 405 (its gRPC API: PERMISSION_DENIED "Model API disabled")
    for method, path, allowed in (("POST", "/models?url=echo.mar&model_name=other", "GET"),
                                  ("DELETE", "/models/echo", "GET, PUT"), ("DELETE", "/models/echo/1.0", "GET, PUT")):
        answer = call(locked, method, path, key=None)
        status, kind, message = error(answer)
        assert (status, kind) == (405, "MethodNotAllowedException") and message.startswith(NOT_ALLOWED)
        assert "Model API disabled" in message and "--enable-model-api" in message
        assert answer[1].getheader("Allow") == allowed
    assert locked.describe("echo")[0]["modelName"] == "echo"  # nothing was unregistered
    # describing, listing and scaling stay open, as TorchServe's; no key needed with authorization off
    assert [m["modelName"] for m in call(locked, "GET", "/models", key=None)[2]["models"]] == ["echo"]
    assert call(locked, "PUT", "/models/echo?min_worker=1&synchronous=true", key=None)[::2] == \
        (200, {"status": "Workers scaled to 1 for model: echo"})
    # without token authorization there is no token API (TorchServe: not found)
    assert error(call(locked, "GET", "/token?type=management", key=None))[0] == 404


def test_settings_and_flags():
    def settings(*args: str):
        return settings_from_args(build_parser().parse_args(list(args)))

    default = settings()
    assert (default.http_management_address, default.http_management_port) == ("127.0.0.1", 8081)
    assert default.management_http_url == "http://127.0.0.1:8081"
    flags = settings("--http-management-address", "::1", "--http-management-port", "0")
    assert flags.management_http_url == "http://[::1]:0"
    assert settings("--no-http-management").http_management_port is None
    off = settings("--no-http")
    assert off.http_port is None and off.http_management_port is None
    with pytest.raises(ConfigError, match="port 70000 is out of range"):
        settings("--http-management-port", "70000")


def test_management_address_from_config_properties(tmp_path):
    config = tmp_path / "config.properties"
    config.write_text("management_address=http://0.0.0.0:9081\n")
    parsed = settings_from_args(build_parser().parse_args(["--ts-config", str(config)]))
    assert (parsed.http_management_address, parsed.http_management_port, parsed.http_management_tls) == \
        ("0.0.0.0", 9081, False)
    wins = settings_from_args(build_parser().parse_args(["--ts-config", str(config), "--http-management-port", "0"]))
    assert (wins.http_management_address, wins.http_management_port) == ("0.0.0.0", 0)  # the flag wins
    config.write_text("management_address=https://127.0.0.1:8443\n")
    with pytest.raises(ConfigError, match="https:// management_address needs certificate_file"):
        settings_from_args(build_parser().parse_args(["--ts-config", str(config)]))
    config.write_text("management_address=unix:/tmp/management.sock\n")
    with pytest.raises(ConfigError, match="invalid value for management_address"):
        settings_from_args(build_parser().parse_args(["--ts-config", str(config)]))


def test_a_taken_port_fails_startup(server, store, tmp_path):
    taken = server.status["http_management_port"]
    proc = subprocess.run([sys.executable, "-m", "inference_service", "--foreground", "--ncs",
                           "--grpc-inference-port", "0", "--grpc-management-port", "0", "--http-port", "0",
                           "--http-management-port", str(taken), "--metrics-port", "0", "--model-store", str(store)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1
    assert f"cannot bind the HTTP management API to 127.0.0.1:{taken}" in proc.stderr
