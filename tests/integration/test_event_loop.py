"""The frontend's event loop (``event_loop``: uvloop by default, or asyncio) and how workers are
started under it: never with ``fork()`` from a process whose gRPC threads are busy."""

from __future__ import annotations

import threading

import pytest

from conftest import ServerProcess, wait_for

FORK_WARNING = "fork() handlers"  # gRPC's "Other threads are currently calling into gRPC, skipping fork() handlers"


def _stream_until(server: ServerProcess, stop: threading.Event, counts: list[int], errors: list[BaseException]) -> None:
    try:
        while not stop.is_set():
            counts.append(len(server.stream("echo", "stream:200")))
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_workers_start_under_load_without_fork(store, tmp_path, loop):
    """Workers registered and scaled while streams run load, answer, and no fork() happened
    while gRPC's threads were busy (whose handlers gRPC then skips, with a warning on stderr)."""
    srv = ServerProcess(tmp_path, store, ["--enable-model-api", "--models", "echo=echo.mar",
                                          "--workers-per-model", "1", "--event-loop", loop])
    stop, counts, errors = threading.Event(), [], []
    loaders = [threading.Thread(target=_stream_until, args=(srv, stop, counts, errors)) for _ in range(2)]
    try:
        srv.wait_workers("echo", 1)
        for thread in loaders:
            thread.start()
        wait_for(lambda: len(counts) >= 2, timeout=30)
        srv.register("echo_v2.mar", initial_workers=2, synchronous=True)
        srv.scale("echo", 3)
        assert srv.predict("echo_v2", "hi") == b"hi"
        assert len(srv.wait_workers("echo", 3)) == 3
        stop.set()
        for thread in loaders:
            thread.join(timeout=60)
        assert not errors, errors
        assert counts and all(count == 201 for count in counts), counts  # 200 intermediate + the final one
        assert FORK_WARNING not in srv.log()
        assert f"event loop: {loop}" in srv.log()
    finally:
        stop.set()
        assert srv.stop() == 0, srv.log()


def test_unknown_event_loop_is_refused(store, tmp_path):
    (tmp_path / "config.properties").write_text("event_loop=tornado\n")
    srv = None
    with pytest.raises(RuntimeError, match="event_loop"):
        srv = ServerProcess(tmp_path, store, ["--ts-config", str(tmp_path / "config.properties")])
    assert srv is None
