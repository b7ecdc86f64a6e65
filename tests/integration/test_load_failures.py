"""A model whose workers cannot load answers at once with UNAVAILABLE and the load error
(instead of queueing requests until maxRetryTimeoutInSec), and serves again as soon as a
worker loads."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from conftest import build_mar, wait_for


def test_requests_fail_fast_while_no_worker_loads_then_recover(server, store: Path, tmp_path: Path):
    flag = tmp_path / "broken-now"
    flag.write_text("")
    config = tmp_path / "flaky-config.yaml"
    config.write_text(f"maxRetryTimeoutInSec: 600\nhandler:\n  fail_while: {flag}\n")
    build_mar(store, "flaky", "flaky_load_handler.py", config=str(config))
    server.register("flaky.mar", synchronous=False)
    try:
        wait_for(lambda: "cannot load while" in server.log(), timeout=30, what="a failed load")
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            server.predict("flaky", "hello", timeout=60)
        assert time.monotonic() - started < 5  # not held until the retry window ends
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "cannot load while" in err.value.details()
        flag.unlink()  # the next restart loads
        wait_for(lambda: server.describe("flaky")[0]["workers"][0]["status"] == "READY", timeout=60,
                 what="a worker that loads")
        assert server.predict("flaky", "hello", timeout=10) == b"loaded"
    finally:
        server.unregister("flaky")
