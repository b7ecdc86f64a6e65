"""TorchServe 0.12's management regression cases, replayed in order against one server with
``http_management_status_codes=torchserve``: each gets TorchServe's HTTP status.

The cases (``tests/data/torchserve_management_cases.json``) are TorchServe's register, scale,
describe, list, set-default and unregister requests with the status it answers. Its archives
(squeezenet1_1, mnist, densenet161, resnet-18, resnet-152-batch) are the echo handler archived under
those names, so register, scale, describe and unregister semantics are what is checked, not the
models. Token authorization is off, as in TorchServe's run of these cases.

Two cases name a torchserve.pytorch.org URL, unreachable here; they are replayed as they are:

* 3, registering densenet161 again from its remote URL: TorchServe finds ``densenet161.mar`` in
  its model store before downloading and answers 500 ("Model file already exists"); this server
  does the same under the option, so the case holds offline.
* 57, an archive the host does not have: TorchServe's download fails (400); here the download
  fails too (no network), and the option answers the same 400.
"""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import ServerProcess, build_mar

CASES = json.loads((Path(__file__).parents[1] / "data" / "torchserve_management_cases.json").read_text())["cases"]
ARCHIVES = ("squeezenet1_1", "mnist", "densenet161", "resnet-18", "resnet-152-batch")


@pytest.fixture(scope="module")
def ts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    store = tmp_path_factory.mktemp("ts_cases_store")
    for name in ARCHIVES:
        build_mar(store, name, "echo_handler.py")
    work = tmp_path_factory.mktemp("ts_cases")
    config = work / "config.properties"
    config.write_text("enable_model_api=true\ndisable_token_authorization=true\n"
                      "http_management_status_codes=torchserve\n"
                      "allowed_urls=file://.*|http(s)?://.*\n"  # TorchServe's default
                      "download_timeout=20\n")  # bounds the remote case's failing download
    srv = ServerProcess(work, store, ["--ts-config", str(config)])
    try:
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def send(srv: ServerProcess, method: str, path: str, timeout: float = 120) -> tuple[int, str]:
    """One request without a key on a fresh connection: (status, body text)."""
    path = re.sub(r"\{archive:([^}]+)\}", r"\1.mar", path)
    conn = http.client.HTTPConnection("127.0.0.1", srv.status["http_management_port"], timeout=timeout)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        conn.close()


def test_every_case_gets_torchserves_status(ts: ServerProcess) -> None:
    differ = []
    for case in CASES:
        status, body = send(ts, case["method"], case["path"])
        if status != case["status"]:
            differ.append((case["n"], case["method"], case["path"], case["status"], status, body[:200]))
        elif status >= 400:  # TorchServe's error shape, its code the status
            error = json.loads(body)
            assert set(error) == {"code", "type", "message"} and error["code"] == status, (case, error)
    assert not differ, "\n".join(map(str, differ))
    assert json.loads(send(ts, "GET", "/models")[1])["models"] == []  # the cases leave nothing registered
