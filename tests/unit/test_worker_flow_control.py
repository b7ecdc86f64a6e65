"""The worker's end of the IPC channel over a real socket pair: the window of intermediate
responses, CREDIT and CANCEL frames, and frames that arrive while a handler runs."""

from __future__ import annotations

import socket
import threading

import pytest

from inference_service.contracts import wire
from inference_service.worker.channel import WorkerChannel

DEADLINE_S = 10.0


@pytest.fixture
def pair():
    frontend, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    frontend.settimeout(DEADLINE_S)
    channel = WorkerChannel(worker)
    channel.window = 4
    yield frontend, channel
    frontend.close()
    worker.close()


def _read_frames(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    data = b""
    frames = []
    while len(frames) < count:
        while len(data) >= wire.HEADER.size:
            length, kind = wire.HEADER.unpack_from(data)
            if len(data) < 4 + length:
                break
            frames.append((kind, data[wire.HEADER.size:4 + length]))
            data = data[4 + length:]
        if len(frames) < count:
            data += sock.recv(1 << 16)
    return frames


def _send_in_thread(channel: WorkerChannel, request_id: str, count: int) -> tuple[threading.Thread, list[int]]:
    sent: list[int] = []

    def run() -> None:
        for i in range(count):
            channel.send_intermediate(request_id, str(i).encode())
            sent.append(i)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, sent


def test_the_window_blocks_the_handler_until_credit_arrives(pair):
    frontend, channel = pair
    channel.begin(["r1"])
    thread, sent = _send_in_thread(channel, "r1", 6)
    frames = _read_frames(frontend, 4)  # the window: 4 responses without credit
    assert [wire.decode_response(body) for _, body in frames] == [("r1", str(i).encode()) for i in range(4)]
    thread.join(0.3)  # bounded: the handler must still be waiting for credit
    assert thread.is_alive() and sent == [0, 1, 2, 3]
    frontend.sendall(wire.encode_credit("r1", 2))
    thread.join(DEADLINE_S)
    assert not thread.is_alive() and sent == list(range(6))
    assert [wire.decode_response(body)[1] for _, body in _read_frames(frontend, 2)] == [b"4", b"5"]


def test_a_cancel_releases_a_handler_waiting_for_credit(pair):
    frontend, channel = pair
    channel.begin(["r1"])
    thread, sent = _send_in_thread(channel, "r1", 5)
    _read_frames(frontend, 4)
    frontend.sendall(wire.frame(wire.CANCEL, b"r1"))
    thread.join(DEADLINE_S)
    assert not thread.is_alive()
    assert channel.is_cancelled("r1")


def test_credit_for_another_request_does_not_release_the_handler(pair):
    frontend, channel = pair
    channel.begin(["r1", "r2"])
    thread, sent = _send_in_thread(channel, "r1", 5)
    _read_frames(frontend, 4)
    frontend.sendall(wire.encode_credit("r2", 10) + wire.encode_credit("gone", 10))
    thread.join(0.3)
    assert thread.is_alive() and len(sent) == 4
    frontend.sendall(wire.encode_credit("r1", 1))
    thread.join(DEADLINE_S)
    assert not thread.is_alive() and len(sent) == 5


def test_frames_that_arrive_during_a_batch_wait_in_order(pair):
    frontend, channel = pair
    channel.begin(["r1"])
    frontend.sendall(wire.frame(wire.CANCEL, b"r1") + wire.frame(wire.BATCH, b"next")
                     + wire.frame(wire.STOP))
    # a handler's cancel check reads them without blocking: the cancel is taken, the rest kept
    deadline = threading.Event()
    for _ in range(100):
        channel.poll()
        if channel.is_cancelled("r1"):
            break
        deadline.wait(0.01)
    assert channel.is_cancelled("r1")
    channel.end(["r1"])
    assert not channel.is_cancelled("r1")
    assert channel.read_frame() == (wire.BATCH, b"next")
    assert channel.read_frame() == (wire.STOP, b"")


def test_without_a_window_nothing_waits(pair):
    frontend, channel = pair
    channel.window = 0
    channel.begin(["r1"])
    for _ in range(50):
        channel.send_intermediate("r1", b"x")
    assert len(_read_frames(frontend, 50)) == 50


def test_requests_outside_a_batch_are_not_flow_controlled(pair):
    frontend, channel = pair
    channel.begin(["r1"])
    channel.end(["r1"])
    for _ in range(10):  # a handler thread that outlived its batch must never block
        channel.send_intermediate("r1", b"late")
    assert len(_read_frames(frontend, 10)) == 10


def test_response_headers_go_before_a_chunk_when_they_changed(pair):
    frontend, channel = pair
    channel.begin(["r1"])
    channel.send_intermediate("r1", b"a", {"X-Step": 1})
    channel.send_intermediate("r1", b"b", {"X-Step": 1})  # unchanged: no second HEADERS frame
    channel.send_intermediate("r1", b"c", {"X-Step": 2})
    frames = _read_frames(frontend, 5)
    assert [kind for kind, _ in frames] == [wire.HEADERS, wire.CHUNK, wire.CHUNK, wire.HEADERS, wire.CHUNK]
    assert wire.decode_headers(frames[0][1]) == ("r1", {"X-Step": "1"})  # values become strings
    assert wire.decode_headers(frames[3][1]) == ("r1", {"X-Step": "2"})
    channel.end(["r1"])
    assert channel.headers_frames("r1", {"X-Step": "2"}) != []  # a request id's record ends with it
    assert channel.headers_frames("r2", {}) == []
    with pytest.raises(wire.ProtocolError):
        wire.decode_headers(wire.encode_response(wire.HEADERS, "r1", b"[1]")[wire.HEADER.size:])
