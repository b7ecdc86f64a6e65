"""StreamPredictions2: TorchServe's stateful inference over one bidirectional stream per sequence."""

from __future__ import annotations

import queue
import threading

import grpc
import pytest

from inference_service._proto import inference_pb2


class Sequence:
    """Drive one StreamPredictions2 call: send a request, read its answer, in lockstep."""

    def __init__(self, server, timeout: float = 30) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._responses = server.inference.StreamPredictions2(iter(self._requests.get, None), timeout=timeout)

    def send(self, model: str, body: str, sequence_id: str | None = None, **flags: str):
        inputs = {"data": body.encode(), **{k: v.encode() for k, v in flags.items()}}
        req = inference_pb2.PredictionsRequest(model_name=model, input=inputs)
        if sequence_id is not None:
            req.sequence_id = sequence_id
        self._requests.put(req)
        return next(self._responses)

    def close(self) -> None:
        self._requests.put(None)
        assert list(self._responses) == []


@pytest.fixture(scope="module")
def seq_server(server):
    server.register("seq.mar", initial_workers=2)
    server.wait_workers("seq", 2)
    yield server
    server.unregister("seq")


def test_sequence_start_mints_id_and_state_is_kept(seq_server):
    s = Sequence(seq_server)
    first = s.send("seq", "5", ts_request_sequence_start="true")
    assert first.sequence_id.startswith("ts-seq-")
    assert not first.HasField("status")
    seq = first.sequence_id
    second = s.send("seq", "7", sequence_id=seq)
    third = s.send("seq", "1", sequence_id=seq, ts_request_sequence_end="true")
    s.close()
    sums = [r.prediction.decode().split(":") for r in (first, second, third)]
    assert [int(p[1]) for p in sums] == [5, 12, 13]
    assert {p[0] for p in sums} == {seq}
    assert len({p[2] for p in sums}) == 1, "every request of a sequence must reach the same worker"
    assert sums[2][3] == "end"
    assert second.sequence_id == seq and third.sequence_id == seq


def test_two_concurrent_sequences_each_pinned(seq_server):
    results: dict[str, list[list[str]]] = {}

    def run(name: str) -> None:
        s = Sequence(seq_server)
        first = s.send("seq", "1", ts_request_sequence_start="true")
        out = [first.prediction.decode().split(":")]
        for value in ("2", "3", "4"):
            out.append(s.send("seq", value, sequence_id=first.sequence_id).prediction.decode().split(":"))
        s.close()
        results[name] = out

    threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(results) == {"a", "b"}
    for out in results.values():
        assert [int(p[1]) for p in out] == [1, 3, 6, 10]
        assert len({p[2] for p in out}) == 1
    # the two sequences are spread over the two workers
    assert results["a"][0][2] != results["b"][0][2]
    assert results["a"][0][0] != results["b"][0][0]


def test_missing_sequence_id_is_answered_in_band(seq_server):
    s = Sequence(seq_server)
    bad = s.send("seq", "1")
    assert bad.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert bad.status.message == "Parameter sequenceId is required."
    ok = s.send("seq", "2", ts_request_sequence_start="true")  # the stream stays open
    assert not ok.HasField("status") and ok.prediction.decode().split(":")[1] == "2"
    s.close()


def test_model_without_sequence_batching_fails_precondition_in_band(seq_server):
    s = Sequence(seq_server)
    r = s.send("echo", "x", ts_request_sequence_start="true")
    assert r.status.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "sequenceBatching" in r.status.message
    r = s.send("nope", "x", sequence_id="ts-seq-given")
    assert r.status.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert r.sequence_id == "ts-seq-given"
    s.close()


def test_client_given_sequence_id_is_used(seq_server):
    s = Sequence(seq_server)
    r = s.send("seq", "3", sequence_id="my-seq-1")
    assert r.sequence_id == "my-seq-1" and r.prediction.decode().startswith("my-seq-1:3:")
    s.close()
