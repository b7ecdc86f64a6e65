"""Stateful inference over HTTP, as TorchServe 0.12's stateful HTTP examples drive it
(test_example_stateful_sequence_batching_http.py, ..._continuous_batching_http.py): a request
without ``ts_request_sequence_id`` opens a sequence and the answer names it in that header; the
sequence's requests reach one worker's state; the handler ends it (``ts_request_sequence_end``);
idle and total limits close it. Here an ended or expired sequence of the server's own minting is
refused with 404, where TorchServe would open a new one on whichever worker."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import pytest
from test_concurrency import _parallel

from conftest import build_mar, read_key, wait_for

SEQ_ID = "ts_request_sequence_id"
IDLE_S = 1.5  # sequenceMaxIdleMSec of "runsum_idle"
TOTAL_S = 3.0  # sequenceTimeoutMSec of "runsum_total"


@pytest.fixture(scope="module")
def models(server, store: Path):
    configs = {
        # TorchServe's sequence_batching example config
        "seqsum": "minWorkers: 2\nmaxWorkers: 2\nbatchSize: 4\nmaxNumSequence: 4\nsequenceMaxIdleMSec: 5000\n"
                  "maxSequenceJobQueueSize: 10\nsequenceBatching: true\n",
        # TorchServe's sequence_continuous_batching example config, its limits shortened
        "runsum_cb": "minWorkers: 2\nmaxWorkers: 2\nbatchSize: 1\nmaxNumSequence: 2\nsequenceMaxIdleMSec: 30000\n"
                     "sequenceTimeoutMSec: 60000\nmaxSequenceJobQueueSize: 10\nsequenceBatching: true\n"
                     "continuousBatching: true\n",
        "runsum_idle": f"minWorkers: 1\nmaxWorkers: 1\nbatchSize: 1\nmaxNumSequence: 2\n"
                       f"sequenceMaxIdleMSec: {int(IDLE_S * 1000)}\nsequenceBatching: true\ncontinuousBatching: true\n",
        "runsum_total": f"minWorkers: 1\nmaxWorkers: 1\nbatchSize: 1\nmaxNumSequence: 2\n"
                        f"sequenceMaxIdleMSec: 30000\nsequenceTimeoutMSec: {int(TOTAL_S * 1000)}\n"
                        "sequenceBatching: true\ncontinuousBatching: true\n",
    }
    for name, config in configs.items():
        (store / f"{name}.yaml").write_text(config)
        build_mar(store, name, "stateful_cb_handler.py", config=str(store / f"{name}.yaml"))
        server.register(f"{name}.mar", initial_workers=int(config.split("minWorkers: ")[1].split("\n")[0]))
    yield server
    for name in configs:
        server.unregister(name)


def _post(srv, model: str, body: bytes, seq: str | None = None, *, json_body: bool = False,
          timeout: float = 30) -> tuple[int, dict[str, str], list[bytes]]:
    """One request: (status, response headers lower-cased, the body's chunks as they came)."""
    headers = {"Authorization": f"Bearer {read_key(srv.key_file, 'inference')}"}
    if seq is not None:
        headers[SEQ_ID] = seq
    if json_body:
        headers["Content-Type"] = "application/json"
    conn = http.client.HTTPConnection("127.0.0.1", srv.status["http_port"], timeout=timeout)
    try:
        conn.request("POST", f"/predictions/{model}", body=body, headers=headers)
        response = conn.getresponse()
        chunks = []
        while chunk := response.read1(65536) if response.chunked else response.read():
            chunks.append(chunk)
            if not response.chunked:
                break
        return response.status, {k.lower(): v for k, v in response.getheaders()}, chunks
    finally:
        conn.close()


def _run_sequence(srv, model: str, numbers: list[int], seq: str | None = None) -> tuple[str, str]:
    """Send ``numbers`` in one sequence (the first opens it unless ``seq`` is given): (answers, id)."""
    answers = []
    for number in numbers:
        status, headers, chunks = _post(srv, model, str(number).encode(), seq)
        assert status == 200, (status, chunks)
        assert seq is None or headers[SEQ_ID] == seq
        seq = headers[SEQ_ID]
        answers.append(b"".join(chunks).decode())
    assert seq is not None
    return " ".join(answers), seq


def test_client_named_sequences_keep_their_sums_in_batch_mode(models):
    # TorchServe's sequence batching test: ids chosen by the client, batchSize 4, two workers
    got = _parallel(_run_sequence, [(models, "seqsum", [1, 3, 5, 7, 9], "seq_0"),
                                    (models, "seqsum", [2, 4, 6, 8, 10], "seq_1")])
    assert [answers for answers, _ in got] == ["1 4 9 16 25", "2 6 12 20 30"]


def test_a_request_without_an_id_opens_a_sequence_named_in_the_answer(models):
    got = _parallel(_run_sequence, [(models, "runsum_cb", [2, 4, 6, 8, 10]),
                                    (models, "runsum_cb", [4, 8, 12, 16, 20])])
    assert [answers for answers, _ in got] == ["2 6 12 20 30", "4 12 24 40 60"]  # TorchServe's expected sums
    ids = [seq for _, seq in got]
    assert all(seq.startswith("ts-seq-") for seq in ids) and ids[0] != ids[1]
    # maxNumSequence is 2: both are still open (no end), so a third is refused until they end
    status, _, chunks = _post(models, "runsum_cb", b"2")
    assert status == 503 and b"maxNumSequence" in b"".join(chunks), (status, chunks)
    for seq in ids:
        assert _run_sequence(models, "runsum_cb", [0], seq)[0] in ("30", "60")


def test_the_handler_ends_a_sequence_and_its_id_is_refused_after(models):
    answers, seq = _run_sequence(models, "runsum_cb", [2, 4, 6, 8, 0])
    assert answers == "2 6 12 20 20"  # TorchServe's test_infer_stateful_end
    status, _, chunks = _post(models, "runsum_cb", b"2", seq)
    body = json.loads(b"".join(chunks))
    assert status == 404 and body["code"] == 404, (status, body)
    assert seq in body["message"] and "it ended" in body["message"]
    # its place is free: two new sequences open (maxNumSequence 2), then end
    for _ in range(2):
        assert _run_sequence(models, "runsum_cb", [2, 0])[0] == "2 2"


def _stream(srv, model: str, seq: str, streamed: list, started: threading.Event) -> None:
    """POST ``{"input": 3}`` in sequence ``seq``: ``streamed`` gets the Transfer-Encoding, then each
    chunk as it arrives; ``started`` is set at the first."""
    headers = {"Authorization": f"Bearer {read_key(srv.key_file, 'inference')}", SEQ_ID: seq,
               "Content-Type": "application/json"}
    conn = http.client.HTTPConnection("127.0.0.1", srv.status["http_port"], timeout=30)
    try:
        conn.request("POST", f"/predictions/{model}", body=json.dumps({"input": 3}), headers=headers)
        response = conn.getresponse()
        streamed.append(response.getheader("Transfer-Encoding"))
        while chunk := response.read1(65536):
            streamed.append(chunk.decode())
            started.set()
    finally:
        conn.close()


def test_a_request_of_the_sequence_cancels_its_running_stream(models):
    # TorchServe's test_infer_stateful_cancel: more rounds than maxNumSequence, each ended after
    for _ in range(3):
        first, seq = _run_sequence(models, "runsum_cb", [2])
        assert first == "2"
        streamed: list = []
        started = threading.Event()
        thread = threading.Thread(target=_stream, args=(models, "runsum_cb", seq, streamed, started))
        thread.start()
        assert started.wait(30), "the stream's first chunk"
        assert _run_sequence(models, "runsum_cb", [-1], seq)[0] == "-1"
        thread.join(30)
        assert not thread.is_alive()
        assert streamed[0] == "chunked" and streamed[1] == "5", streamed
        assert len(streamed) - 1 < 11, streamed  # cut short by the cancel
        assert _run_sequence(models, "runsum_cb", [0], seq)[0] == "5"  # the client closes it


def test_an_idle_sequence_is_closed_and_its_place_freed(models):
    _, first = _run_sequence(models, "runsum_idle", [2])
    _, second = _run_sequence(models, "runsum_idle", [2])
    opened = time.monotonic()
    # both places are held; a third sequence opens once the two were idle sequenceMaxIdleMSec
    status, _, _ = _post(models, "runsum_idle", b"2")
    assert status == 503
    wait_for(lambda: _post(models, "runsum_idle", b"0")[0] == 200, timeout=IDLE_S + 20, interval=0.2,
             what="a new sequence after the idle limit")
    assert time.monotonic() - opened >= IDLE_S * 0.9
    for seq in (first, second):
        status, _, chunks = _post(models, "runsum_idle", b"2", seq)
        assert status == 404 and b"sequenceMaxIdleMSec" in b"".join(chunks), (status, chunks)


def test_a_sequence_closes_at_its_total_limit_though_in_use(models):
    _, seq = _run_sequence(models, "runsum_total", [2])
    opened = time.monotonic()
    deadline = opened + TOTAL_S + 20
    while True:  # in use every 0.2 s, far below the idle limit
        status, _, chunks = _post(models, "runsum_total", b"2", seq)
        if status != 200:
            break
        assert time.monotonic() < deadline, "the sequence never reached sequenceTimeoutMSec"
        time.sleep(0.2)
    assert time.monotonic() - opened >= TOTAL_S * 0.9
    assert status == 404 and b"sequenceTimeoutMSec" in b"".join(chunks), (status, chunks)


def test_a_model_without_sequences_answers_no_sequence_header(models):
    status, headers, chunks = _post(models, "echo", b"hello", "ts-seq-anything")
    assert status == 200 and SEQ_ID not in headers
