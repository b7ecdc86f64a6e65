"""Several requests in flight on one worker: TorchServe's ``continuousBatching: true`` (requests
join and leave a running batch, stopping criteria decide when each ends) and
``asyncCommunication: true`` (one ``async def handle`` task per request), with the per-request
guarantees of the server: streaming as produced, cancelling one request, errors of one request."""

from __future__ import annotations

import http.client
import json
import queue
import threading
import time
from pathlib import Path

import grpc
import pytest

from conftest import build_mar, read_key
from inference_service._proto import inference_pb2


@pytest.fixture(scope="module")
def models(server, store: Path):
    (store / "cb-config.yaml").write_text("continuousBatching: true\nbatchSize: 3\nmaxBatchDelay: 0\n"
                                          "minWorkers: 1\nmaxWorkers: 1\nresponseTimeout: 30\n")
    build_mar(store, "cb", "cb_handler.py", config=str(store / "cb-config.yaml"))
    (store / "async-config.yaml").write_text("asyncCommunication: true\nminWorkers: 1\nmaxWorkers: 1\n")
    build_mar(store, "asyncparts", "async_handler.py", config=str(store / "async-config.yaml"))
    (store / "stateful-config.yaml").write_text(
        "minWorkers: 2\nmaxWorkers: 2\nbatchSize: 1\nmaxNumSequence: 2\nsequenceBatching: true\n"
        "continuousBatching: true\nsequenceMaxIdleMSec: 30000\n")
    build_mar(store, "runsum", "stateful_cb_handler.py", config=str(store / "stateful-config.yaml"))
    server.register("cb.mar")
    server.register("asyncparts.mar")
    server.register("runsum.mar", initial_workers=2)
    yield server
    for name in ("cb", "asyncparts", "runsum"):
        server.unregister(name)


def _stream(server, model: str, body: dict, timeout: float = 30):
    req = inference_pb2.PredictionsRequest(model_name=model, input={"data": json.dumps(body).encode()})
    return server.inference.StreamPredictions(req, timeout=timeout)


def _parallel(fn, args_list):
    results: list = [None] * len(args_list)
    errors: list = []

    def run(i, args):
        try:
            results[i] = fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def _pid(server, model: str) -> int:
    return server.describe(model)[0]["workers"][0]["pid"]


# --- continuous batching ------------------------------------------------------------------
def test_concurrent_streams_share_one_worker_and_each_gets_its_steps(models):
    def run(steps):
        return [json.loads(r.prediction) for r in _stream(models, "cb", {"steps": steps, "delay": 0.05})]

    results = _parallel(run, [(8,), (8,), (8,), (5,), (5,)])
    for messages, steps in zip(results, [8, 8, 8, 5, 5], strict=True):
        assert [m["step"] for m in messages] == list(range(steps))
        assert all(m["batch"] <= 3 for m in messages)  # batchSize bounds the running batch
    # the streams were answered from shared handler calls, not one after another
    assert max(m["batch"] for messages in results for m in messages) == 3


def test_a_request_joins_a_running_batch_at_the_next_call(models):
    first = _stream(models, "cb", {"steps": 40, "delay": 0.05})
    got = [json.loads(next(first).prediction) for _ in range(3)]
    assert [m["batch"] for m in got] == [1, 1, 1]
    second = [json.loads(r.prediction) for r in _stream(models, "cb", {"steps": 3, "delay": 0.05})]
    assert [m["batch"] for m in second] == [2, 2, 2]  # it ran beside the first one
    rest = [json.loads(r.prediction) for r in first]
    assert [m["step"] for m in got + rest] == list(range(40))


def test_cancelling_one_stream_leaves_the_others_running(models, tmp_path):
    log = tmp_path / "dropped.log"
    pid = _pid(models, "cb")
    doomed = _stream(models, "cb", {"steps": 500, "delay": 0.02, "log": str(log)})
    next(doomed)
    survivor = _stream(models, "cb", {"steps": 30, "delay": 0.02})
    next(survivor)
    doomed.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(doomed)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    assert len(list(survivor)) == 29
    deadline = time.monotonic() + 10
    while not (log.exists() and "dropped" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert log.read_text().startswith("dropped "), "the handler was told the request left"
    assert _pid(models, "cb") == pid  # the worker lived on


def test_unary_call_on_a_continuous_batch_gets_every_message(models):
    payload = models.predict("cb", json.dumps({"steps": 4, "delay": 0}))
    messages = payload.decode().replace("}{", "}\n{").splitlines()
    assert [json.loads(m)["step"] for m in messages] == [0, 1, 2, 3]


def test_one_rejected_request_fails_alone(models):
    def run(body):
        try:
            return [r.prediction for r in _stream(models, "cb", body)]
        except grpc.RpcError as err:
            return err.code(), err.details()

    good, bad = _parallel(run, [({"steps": 6, "delay": 0.05},), ({"steps": 6, "reject": True, "delay": 0.05},)])
    assert len(good) == 6
    assert bad == (grpc.StatusCode.INVALID_ARGUMENT, "rejected as asked")


def test_stopping_criterion_none_answers_once(models):
    messages = [r.prediction for r in _stream(models, "cb", {"steps": 5, "single": True})]
    assert len(messages) == 1 and json.loads(messages[0])["step"] == 0


# --- async handlers -----------------------------------------------------------------------
def test_async_handler_runs_requests_concurrently(models):
    def run():
        return json.loads(models.predict("asyncparts", json.dumps({"parts": 0, "delay": 0.4})))

    started = time.monotonic()
    results = _parallel(run, [()] * 4)
    assert max(r["max"] for r in results) == 4
    assert time.monotonic() - started < 4 * 0.4  # well under one after another


def test_async_handler_streams_its_intermediate_messages(models):
    messages = [r.prediction for r in _stream(models, "asyncparts", {"parts": 3, "delay": 0.01})]
    assert messages[:3] == [b"part0", b"part1", b"part2"]
    assert json.loads(messages[3])["concurrent"] >= 1


def test_async_handler_status_keeps_its_http_status(models):
    # the handler's status reaches gRPC through TorchServe's table and HTTP as it is, as in batch mode
    for status, code in ((418, grpc.StatusCode.FAILED_PRECONDITION), (429, grpc.StatusCode.RESOURCE_EXHAUSTED),
                         (503, grpc.StatusCode.UNAVAILABLE)):
        with pytest.raises(grpc.RpcError) as err:
            models.predict("asyncparts", json.dumps({"status": status}))
        assert (err.value.code(), err.value.details()) == (code, "handler says no")
        conn = http.client.HTTPConnection("127.0.0.1", models.status["http_port"], timeout=30)
        try:
            conn.request("POST", "/predictions/asyncparts", body=json.dumps({"status": status}),
                         headers={"Authorization": f"Bearer {read_key(models.key_file, 'inference')}",
                                  "Content-Type": "application/json"})
            response = conn.getresponse()
            assert (response.status, json.loads(response.read())["message"]) == (status, "handler says no")
        finally:
            conn.close()
    assert json.loads(models.predict("asyncparts", json.dumps({"parts": 0})))["concurrent"] == 1  # still serving


def test_async_cancel_reaches_the_handler_task(models, tmp_path):
    log = tmp_path / "cancel.log"
    call = _stream(models, "asyncparts", {"parts": 200, "delay": 0.05, "log": str(log)})
    assert next(call).prediction == b"part0"
    call.cancel()
    deadline = time.monotonic() + 10
    while not (log.exists() and log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert log.read_text().startswith("cancelled ")
    assert json.loads(models.predict("asyncparts", json.dumps({"parts": 0})))["concurrent"] == 1


# --- sequences under continuous batching (StreamPredictions2) -------------------------------
def _session(server, requests: list):
    """Open a StreamPredictions2 call; ``requests`` are put on it as the test goes."""
    pending: queue.Queue = queue.Queue()
    call = server.inference.StreamPredictions2(iter(pending.get, None), timeout=60)
    return pending, call


def _seq_request(value: str, sequence_id: str | None = None) -> inference_pb2.PredictionsRequest:
    if sequence_id is None:
        return inference_pb2.PredictionsRequest(
            model_name="runsum", input={"data": value.encode(), "ts_request_sequence_start": b"true"})
    return inference_pb2.PredictionsRequest(model_name="runsum", sequence_id=sequence_id,
                                            input={"data": value.encode()})


def test_two_sequences_keep_their_own_state(models):
    def session(step: int) -> str:
        pending, call = _session(models, [])
        answers, seq = [], None
        for i in range(1, 6):
            pending.put(_seq_request(str(step * i), seq))
            response = next(call)
            seq = response.sequence_id
            answers.append(response.prediction.decode())
        pending.put(None)
        return " ".join(answers)

    assert _parallel(session, [(2,), (4,)]) == ["2 6 12 20 30", "4 12 24 40 60"]  # TorchServe's expected sums


def test_a_sequence_request_cancels_that_sequences_running_stream(models):
    pending, call = _session(models, [])
    pending.put(_seq_request("2"))
    first = next(call)
    seq = first.sequence_id
    assert first.prediction == b"2"
    stream_q, stream = _session(models, [])
    stream_q.put(_seq_request("3", seq))
    stream_q.put(None)
    streamed = [next(stream).prediction]  # the stream runs: 2 + 3
    cancel_q, cancel = _session(models, [])
    cancel_q.put(_seq_request("-1", seq))
    cancel_q.put(None)
    assert [r.prediction for r in cancel] == [b"-1"]  # answered while the stream still runs
    streamed += [r.prediction for r in stream]
    assert streamed[0] == b"5" and set(streamed) == {b"5"}
    assert len(streamed) < 10  # the stream ended early, as in TorchServe's example
    pending.put(None)


def test_describe_model_reports_the_modes_with_torchserve_keys(models):
    described = models.describe("cb")[0]
    expected = {"modelName": str, "modelVersion": str, "modelUrl": str, "runtime": str, "minWorkers": int,
                "maxWorkers": int, "batchSize": int, "maxBatchDelay": int, "responseTimeout": int,
                "startupTimeout": int, "maxRetryTimeoutInSec": int, "clientTimeoutInMills": int,
                "parallelType": str, "parallelLevel": int, "deviceType": str, "continuousBatching": bool,
                "useJobTicket": bool, "useVenv": bool, "stateful": bool, "sequenceMaxIdleMSec": int,
                "sequenceTimeoutMSec": int, "maxNumSequence": int, "maxSequenceJobQueueSize": int,
                "loadedAtStartup": bool, "workers": list, "jobQueueStatus": dict}
    for key, kind in expected.items():
        assert isinstance(described[key], kind), (key, described.get(key))
    assert (described["continuousBatching"], described["batchSize"], described["stateful"]) == (True, 3, False)
    assert models.describe("runsum")[0]["stateful"] is True
    assert models.describe("asyncparts")[0]["continuousBatching"] is False
