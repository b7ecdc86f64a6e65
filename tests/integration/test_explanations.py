"""TorchServe's explanations API against the real server: ``/explanations/{model}[/{version}]``,
KServe v1 ``:explain`` and v2 ``/explain`` run the handler with ``explain: True``, so that an
unchanged TorchServe handler answers its ``explain_handle``; one without explanations answers 501.

The handler is tests/handlers/explain_handler.py (see its docstring for its answers).
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from open_inference_models import build_models

from conftest import ServerProcess, build_mar, read_key
from inference_service._proto import inference_pb2

EXPLAIN_MODELS = {"explain": "", "explain_batch": "batchSize: 3\nmaxBatchDelay: 20000\n",
                  "explain_kserve": "handler:\n  envelope: kserve\n",
                  "explain_v2": "handler:\n  envelope: kservev2\n"}


@pytest.fixture(scope="module")
def srv(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The explain_handler models of EXPLAIN_MODELS, the doubler (a BaseHandler without explanations)
    and oip_kservev2 (the same in the kservev2 envelope), one worker each."""
    work = tmp_path_factory.mktemp("explain")
    models = build_models(store, ("oip_kservev2",)) + ["doubler=doubler.mar"]
    for name, config in EXPLAIN_MODELS.items():
        path = work / f"{name}.yaml"
        path.write_text(config + "minWorkers: 1\nmaxWorkers: 1\n")
        models.append(f"{name}={build_mar(store, name, 'explain_handler.py', config=str(path))}")
    server = ServerProcess(work, store, ["--workers-per-model", "1", "--models", *models])
    try:
        for model in models:
            server.wait_workers(model.split("=")[0], 1, timeout=120)
        yield server
    finally:
        assert server.stop() == 0, server.log()


def http(server: ServerProcess, path: str, body: bytes, content_type: str = "text/plain", method: str = "POST",
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One call; ``(status, the JSON answer)``."""
    sent = {"Content-Type": content_type, "Authorization": f"Bearer {read_key(server.key_file, 'inference')}",
            **(headers or {})}
    request = urllib.request.Request(f"http://127.0.0.1:{server.status['http_port']}{path}", data=body,
                                     method=method, headers=sent)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def explanation(text: str, batch: int = 1, url_path: str = "") -> dict[str, Any]:
    return {"explanation": text, "batch": batch, "explain": True, "url_path": url_path}


def test_explanations_route_version_and_url_path(srv):
    assert http(srv, "/explanations/explain", b"why") == (200, explanation("why"))
    assert http(srv, "/explanations/explain", b"why", method="PUT") == (200, explanation("why"))  # curl -T
    assert http(srv, "/explanations/explain/1.0", b"why") == (200, explanation("why"))
    assert http(srv, "/explanations/explain/1.0/a/b", b"why") == (200, explanation("why", url_path="a/b"))


def test_predictions_stay_predictions_whatever_the_client_sends(srv):
    answer = {"prediction": "what", "batch": 1, "explain": False}
    assert http(srv, "/predictions/explain", b"what") == (200, answer)
    # the flag is the route's: a client's own explain header never reaches the handler
    assert http(srv, "/predictions/explain", b"what", headers={"explain": "True"}) == (200, answer)
    assert json.loads(srv.predict("explain", "what")) == answer  # gRPC has no explanations (TorchServe's neither)
    request = inference_pb2.PredictionsRequest(model_name="explain", input={"data": b"what"})
    assert json.loads(srv.inference.Predictions(request, timeout=30, metadata=(("explain", "True"),)).prediction) \
        == answer


def test_unknown_model_and_version_are_404(srv):
    status, body = http(srv, "/explanations/nope", b"x")
    assert (status, body["code"], body["type"]) == (404, 404, "ModelNotFoundException")
    assert http(srv, "/explanations/explain/9.9", b"x")[0] == 404
    assert http(srv, "/v1/models/nope:explain", b"{}")[0] == 404
    status, body = http(srv, "/v2/models/nope/explain", b'{"inputs": []}', "application/json")
    assert status == 404 and "nope" in body["error"]


def test_handler_without_explanations_is_501(srv):
    status, body = http(srv, "/explanations/doubler", b"[1, 2]", "application/json")
    assert (status, body["code"]) == (501, 501), body
    assert body["message"] == ("DoublingHandler gives no explanations: it defines neither explain_handle nor "
                               "get_insights")
    assert http(srv, "/predictions/doubler", b"[1, 2]", "application/json")[0] == 200  # it still predicts
    v2 = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1, 2]}]}).encode()
    status, body = http(srv, "/v2/models/oip_kservev2/explain", v2, "application/json")
    assert status == 501 and body == {"error": "KServeV2Doubler gives no explanations: it defines neither "
                                               "explain_handle nor get_insights"}


def test_kserve_v1_explain_answers_explanations(srv):
    body = json.dumps({"instances": ["a", {"data": "b"}]}).encode()
    assert http(srv, "/v1/models/explain_kserve:explain", body, "application/json") == (
        200, {"explanations": [explanation("a", 2), explanation("b", 2)]})
    assert http(srv, "/v1/models/explain_kserve:predict", body, "application/json") == (
        200, {"predictions": [{"prediction": "a", "batch": 2, "explain": False},
                              {"prediction": "b", "batch": 2, "explain": False}]})
    # without an envelope the handler gets the body as it came, as TorchServe hands it over
    assert http(srv, "/v1/models/explain:explain", b'{"instances": []}', "application/json") == (
        200, explanation('{"instances": []}'))


def test_kserve_v2_explain(srv):
    body = json.dumps({"id": "e", "inputs": [{"name": "x", "datatype": "FP32", "shape": [3],
                                              "data": [2, 4, 8]}]}).encode()
    for path in ("/v2/models/explain_v2/explain", "/v2/models/explain_v2/versions/1.0/explain"):
        assert http(srv, path, body, "application/json") == (200, {
            "model_name": "explain_v2", "model_version": "1.0", "id": "e",
            "outputs": [{"name": "x", "datatype": "FP64", "shape": [3], "data": [1.0, 2.0, 4.0]}]})
    status, answer = http(srv, "/v2/models/explain_v2/infer", body, "application/json")
    assert status == 200 and answer["outputs"][0]["data"] == [4, 8, 16]


def test_an_explanation_is_a_batch_of_its_own(srv):
    """Two predictions wait in explain_batch's batching window (batchSize 3); an explanation arriving
    then does not join them: they leave as a batch of two, and it runs alone."""
    answers: dict[str, tuple[int, Any]] = {}

    def send(key: str, route: str) -> None:
        answers[key] = http(srv, f"/{route}/explain_batch", key.encode())

    threads = [threading.Thread(target=send, args=(key, "predictions")) for key in ("p1", "p2")]
    for thread in threads:
        thread.start()
    srv.wait_described("explain_batch", lambda d: d["jobQueueStatus"]["pendingRequests"] == 2, 30,
                       "two predictions waiting for their batch")
    threads.append(threading.Thread(target=send, args=("e", "explanations")))
    threads[-1].start()
    for thread in threads:
        thread.join(60)
    assert answers == {"p1": (200, {"prediction": "p1", "batch": 2, "explain": False}),
                       "p2": (200, {"prediction": "p2", "batch": 2, "explain": False}),
                       "e": (200, explanation("e"))}
