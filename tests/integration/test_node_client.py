"""The Node.js client (clients/node, @grpc/grpc-js + @grpc/proto-loader) against the real server.

``node clients/node/client.js`` runs as a subprocess, loading ``protos/inference.proto`` at run
time; its packages come from ``npm ci`` in clients/node (``scripts/install --dev``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ServerProcess, read_key


@pytest.fixture
def server(shared_server: ServerProcess) -> ServerProcess:
    """This module only reads: tests/conftest.py's session-wide echo server."""
    return shared_server


ROOT = Path(__file__).resolve().parents[2]
CLIENT_DIR = ROOT / "clients" / "node"
CLIENT = CLIENT_DIR / "client.js"
NODE = shutil.which("node")


@pytest.fixture(scope="module", autouse=True)
def node_installed() -> None:
    """Fail with what to run when Node.js or the client's packages are missing."""
    if NODE is None:
        pytest.fail("node is not on PATH: the Node client tests need Node.js 18+ (scripts/install --dev)")
    if not (CLIENT_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("clients/node/node_modules is missing: run scripts/install --dev (npm ci in clients/node)")


def node(server, *args: str, key: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run the client against ``server``'s inference port (with ``--key-file`` unless ``key`` is false)."""
    auth = ["--key-file", str(server.key_file)] if key else []
    return subprocess.run([NODE, str(CLIENT), "--port", str(server.inference_port), *auth, *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_ping_and_token_authorization(server):
    proc = node(server, "ping")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"status": "Healthy", "code": 200}
    denied = node(server, "ping", key=False)
    assert denied.returncode == 1 and denied.stderr.startswith("error: UNAUTHENTICATED: Token Authorization failed")
    wrong = node(server, "--token", "not-the-key-" * 4, "ping", key=False)
    assert wrong.returncode == 1 and "UNAUTHENTICATED" in wrong.stderr
    token = node(server, "--token", read_key(server.key_file, "inference"), "ping", key=False)
    assert token.returncode == 0 and "Healthy" in token.stdout


def test_health_checks(server):
    for service in ([], ["org.pytorch.serve.grpc.inference.InferenceAPIsService"], ["model/echo"]):
        proc = node(server, "health", *service, key=False)  # grpc.health.v1 needs no key
        assert (proc.returncode, proc.stdout) == (0, "SERVING\n"), (service, proc.stderr)
    unknown = node(server, "health", "model/no-such-model", key=False)
    assert unknown.returncode == 1 and unknown.stderr.strip() == "error: NOT_FOUND"


def test_predict_text_file_and_version(server, tmp_path):
    proc = node(server, "predict", "echo", "hello from node")
    assert (proc.returncode, proc.stdout) == (0, "hello from node\n"), proc.stderr
    payload = tmp_path / "input.txt"
    payload.write_text("from a file\n")
    proc = node(server, "predict", "echo", f"@{payload}")
    assert (proc.returncode, proc.stdout) == (0, "from a file\n"), proc.stderr
    proc = node(server, "--model-version", "1.0", "--input-name", "body", "predict", "echo", "versioned")
    assert (proc.returncode, proc.stdout) == (0, "versioned\n"), proc.stderr


def test_errors_and_usage(server):
    missing = node(server, "predict", "no-such-model", "x")
    assert missing.returncode == 1
    assert missing.stderr.strip() == "error: NOT_FOUND: model 'no-such-model' is not registered"
    failing = node(server, "predict", "echo", "boom")
    assert failing.returncode == 1 and failing.stderr.strip() == "error: INTERNAL: boom: the handler failed"
    late = node(server, "--timeout", "0.3", "predict", "echo", "sleep:2")
    assert late.returncode == 1 and late.stderr.startswith("error: DEADLINE_EXCEEDED")
    for args in (["bogus"], ["predict", "echo"], []):
        usage = node(server, *args)
        assert usage.returncode == 2 and "usage: client.js" in usage.stderr, args


def test_stream_prints_each_message_as_it_arrives(server):
    # the handler sends part0, part1, part2 0.4 s apart, then its final "end"
    cmd = [NODE, str(CLIENT), "--port", str(server.inference_port), "--key-file", str(server.key_file),
           "--jsonl", "stream", "echo", "stream:3:0.4"]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        lines = []
        for line in proc.stdout:  # read as node writes: one line per message
            lines.append((time.monotonic() - started, json.loads(line)))
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert [msg["prediction"] for _, msg in lines] == ["part0;", "part1;", "part2;", "end"]
    assert [msg["index"] for _, msg in lines] == [0, 1, 2, 3]
    arrivals = [at for at, _ in lines]
    # the first message reached this process while the handler still had 1.2 s of work left
    assert arrivals[-1] - arrivals[0] > 0.8, arrivals
    elapsed = [msg["elapsed_ms"] for _, msg in lines]
    assert elapsed == sorted(elapsed) and elapsed[-1] - elapsed[0] > 800, elapsed

    # default output: the pieces concatenated, then a newline
    plain = node(server, "stream", "echo", "stream:2")
    assert (plain.returncode, plain.stdout) == (0, "part0;part1;end\n"), plain.stderr


def test_finds_the_server_from_its_status_file(server, tmp_path):
    """No --port or --key-file: both come from .inference_service/status.json of the working
    directory, or of --run-dir."""
    here = subprocess.run([NODE, str(CLIENT), "predict", "echo", "found"], capture_output=True, text=True,
                          timeout=60, cwd=server.workdir)
    assert (here.returncode, here.stdout) == (0, "found\n"), here.stderr
    run_dir = str(server.workdir / ".inference_service")
    there = subprocess.run([NODE, str(CLIENT), "--run-dir", run_dir, "ping"], capture_output=True, text=True,
                           timeout=60, cwd=tmp_path)
    assert there.returncode == 0 and json.loads(there.stdout)["status"] == "Healthy", there.stderr
    nowhere = subprocess.run([NODE, str(CLIENT), "--run-dir", str(tmp_path / "none"), "ping"], capture_output=True,
                             text=True, timeout=60, cwd=tmp_path)
    assert nowhere.returncode == 2 and f"no server status in {tmp_path / 'none' / 'status.json'}" in nowhere.stderr
