"""clients/torchserve_grpc_client.py against the running server, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
import time

from conftest import ROOT

CLIENT = str(ROOT / "clients" / "torchserve_grpc_client.py")


def _client(server, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, CLIENT, "--inference-port", str(server.inference_port),
                           "--management-port", str(server.management_port), "--key-file", str(server.key_file),
                           *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_register_infer_stream_unregister(server, tmp_path):
    reg = _client(server, "register", "cli_echo", "echo.mar")
    assert reg.returncode == 0, reg.stderr
    assert "cli_echo" in reg.stdout
    (tmp_path / "hello.txt").write_text("hello client")
    out = _client(server, "infer", "cli_echo", str(tmp_path / "hello.txt"))
    assert out.returncode == 0 and out.stdout.strip() == "hello client"
    (tmp_path / "stream.txt").write_text("stream:3:0.3")
    proc = subprocess.Popen([sys.executable, CLIENT, "--inference-port", str(server.inference_port),
                             "infer_stream", "cli_echo", str(tmp_path / "stream.txt"),
                             "--key-file", str(server.key_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    start = time.monotonic()
    first = proc.stdout.read(6)  # "part0;" is printed before the handler finishes (>= 0.9 s)
    first_at = time.monotonic() - start
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert first == b"part0;" and first_at < 5
    assert (first + rest).decode().strip() == "part0;part1;part2;end"
    unreg = _client(server, "unregister", "cli_echo")
    assert unreg.returncode == 0, unreg.stderr
    gone = _client(server, "infer", "cli_echo", str(tmp_path / "hello.txt"))
    assert gone.returncode == 1 and "NOT_FOUND" in gone.stderr and "Traceback" not in gone.stderr


def test_infer_stream2_sequence(server, tmp_path):
    assert _client(server, "register", "cli_seq", "seq.mar").returncode == 0
    files = []
    for i, value in enumerate(["2", "3", "4"]):
        path = tmp_path / f"in{i}.txt"
        path.write_text(value)
        files.append(str(path))
    out = _client(server, "infer_stream2", "cli_seq", "my-seq", ",".join(files))
    assert out.returncode == 0, out.stderr
    sums = [line.split(":")[1] for line in out.stdout.splitlines() if line.startswith("my-seq:")]
    assert sums == ["2", "5", "9"]
    assert _client(server, "unregister", "cli_seq").returncode == 0


def test_client_errors_exit_1(server, tmp_path):
    missing = _client(server, "register", "nothing", "nothing.mar")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
    (tmp_path / "x.txt").write_text("boom")
    failed = _client(server, "infer", "echo", str(tmp_path / "x.txt"))
    assert failed.returncode == 1 and "INTERNAL" in failed.stderr and "boom" in failed.stderr


def test_client_finds_the_server_from_its_status_file(server, tmp_path):
    """No port or key flag: the ports (ephemeral here) and key file come from the run directory's
    status.json, in the working directory or named by --run-dir."""
    (tmp_path / "hello.txt").write_text("found you")
    here = subprocess.run([sys.executable, CLIENT, "infer", "echo", str(tmp_path / "hello.txt")],
                          capture_output=True, text=True, timeout=120, cwd=server.workdir, check=False)
    assert here.returncode == 0, here.stderr
    assert here.stdout.strip() == "found you"
    run_dir = str(server.workdir / ".inference_service")
    managed = subprocess.run([sys.executable, CLIENT, "--run-dir", run_dir, "register", "found_echo", "echo.mar"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert managed.returncode == 0, managed.stderr
    unreg = subprocess.run([sys.executable, CLIENT, "unregister", "found_echo", "--run-dir", run_dir],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert unreg.returncode == 0, unreg.stderr
    # a flag wins over the status file: a wrong key is refused
    (tmp_path / "keys.json").write_text('{"inference": {"key": "wrong-key-0123456789"}}')
    wrong = subprocess.run([sys.executable, CLIENT, "--key-file", str(tmp_path / "keys.json"), "infer", "echo",
                            str(tmp_path / "hello.txt")],
                           capture_output=True, text=True, timeout=120, cwd=server.workdir, check=False)
    assert wrong.returncode == 1 and "UNAUTHENTICATED" in wrong.stderr


def test_client_run_dir_without_status_says_where_it_looked(tmp_path):
    (tmp_path / "hello.txt").write_text("x")
    out = subprocess.run([sys.executable, CLIENT, "--run-dir", str(tmp_path / "nothing"), "infer", "echo",
                          str(tmp_path / "hello.txt")], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 1
    assert f"no server status in {tmp_path / 'nothing' / 'status.json'}" in out.stderr
    assert "Traceback" not in out.stderr
