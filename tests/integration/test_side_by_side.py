"""Two servers in one working directory: one default instance and one with its own --run-dir
(as scripts/demo starts it) keep their own key file, log and snapshots; stopping one leaves the
other's clients working."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import ServerProcess


def test_a_second_instance_never_touches_the_first_ones_files(store: Path, tmp_path: Path):
    workdir = tmp_path / "shared"
    first = ServerProcess(workdir, store, ["--models", "echo=echo.mar", "--workers-per-model", "1"])
    try:
        first.wait_workers("echo", 1)
        keys_before = (workdir / "key_file.json").read_text()
        run_dir = workdir / ".inference_service" / "second"
        second = subprocess.run(
            [sys.executable, "-m", "inference_service", "--start", "--run-dir", str(run_dir), "--model-store",
             str(store), "--models", "echo=echo.mar", "--workers-per-model", "1", "--grpc-inference-port", "0",
             "--grpc-management-port", "0", "--http-port", "0", "--http-management-port", "0", "--metrics-port", "0",
             "--wait-ready", "120"],
            cwd=workdir, capture_output=True, text=True, timeout=180)
        assert second.returncode == 0, second.stdout + second.stderr
        assert (run_dir / "key_file.json").exists() and (run_dir / "logs" / "inference_service.log").exists()
        assert (workdir / "key_file.json").read_text() == keys_before  # not overwritten
        stop = subprocess.run([sys.executable, "-m", "inference_service", "--stop", "--run-dir", str(run_dir)],
                              cwd=workdir, capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0, stop.stderr
        assert (workdir / "key_file.json").read_text() == keys_before  # not deleted either
        assert first.predict("echo", "still mine") == b"still mine"  # its clients read the same key
        assert json.loads((workdir / "key_file.json").read_text())["inference"]["key"]
    finally:
        assert first.stop() == 0, first.log()
