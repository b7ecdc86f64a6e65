"""Where the log goes: ``--log-config`` (a logging dictConfig, YAML or JSON) routing the server's
loggers, ``--log-file`` rotated at ``--log-max-bytes``, one prefix per worker line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import ServerProcess, build_mar, wait_for

LOG_CONFIG = """\
version: 1
formatters:
  short: {{format: "%(name)s %(message)s"}}
handlers:
  access: {{class: logging.FileHandler, filename: "{access}", formatter: short}}
  model_metrics: {{class: logging.FileHandler, filename: "{metrics}", formatter: short}}
loggers:
  inference_service.access: {{handlers: [access], propagate: false}}
  inference_service.model_metrics: {{handlers: [model_metrics], propagate: false}}
"""


def test_log_config_routes_the_server_loggers(store: Path, tmp_path: Path) -> None:
    build_mar(store, "metered", "metrics_handler.py")
    access, metrics = tmp_path / "access.log", tmp_path / "model_metrics.log"
    config = tmp_path / "log.yaml"
    config.write_text(LOG_CONFIG.format(access=access, metrics=metrics))
    srv = ServerProcess(tmp_path / "work", store, ["--models", "metered=metered.mar", "--workers-per-model", "1",
                                                   "--log-config", str(config)])
    try:
        srv.wait_workers("metered", 1)
        assert srv.predict("metered", "hello") == b"hello"
        line = wait_for(lambda: [x for x in access.read_text().splitlines() if "Predictions model=metered" in x])
        assert line[0].startswith("inference_service.access Predictions model=metered ")
        assert wait_for(lambda: "EchoRequests.Count:1|" in metrics.read_text())
        assert "Predictions model=metered" not in srv.log() and "EchoRequests.Count" not in srv.log()
        # one prefix per worker line: the relayed record carries the level, the line its logger
        relayed = [x for x in srv.log().splitlines() if "[metered worker-" in x]
        assert relayed and not any(f"] {level} " in x for x in relayed for level in ("INFO", "WARNING", "DEBUG"))
    finally:
        assert srv.stop() == 0, srv.log()


def test_log_config_json_and_refusals(store: Path, tmp_path: Path) -> None:
    (tmp_path / "log.json").write_text(json.dumps({"version": 1, "root": {"level": "WARNING"}}))
    srv = ServerProcess(tmp_path / "work", store, ["--log-config", str(tmp_path / "log.json")])
    assert srv.stop() == 0, srv.log()
    (tmp_path / "bad.yaml").write_text("handlers: [unclosed\n")
    (tmp_path / "nodict.yaml").write_text("- version\n")
    for name, message in (("bad.yaml", "bad.yaml: "), ("nodict.yaml", "not a logging dictConfig"),
                          ("missing.yaml", "missing.yaml: ")):
        proc = subprocess.run([sys.executable, "-m", "inference_service", "--foreground", "--log-config",
                               str(tmp_path / name)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                              check=False)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_log_file_rotates_at_the_size_given(store: Path, tmp_path: Path) -> None:
    log = tmp_path / "logs" / "server.log"
    srv = ServerProcess(tmp_path / "work", store, ["--models", "echo=echo.mar", "--workers-per-model", "1",
                                                   "--log-file", str(log), "--log-max-bytes", "4000"])
    try:
        srv.wait_workers("echo", 1)

        def rotated() -> bool:
            srv.predict("echo", "x" * 200)
            return (log.parent / "server.log.2").exists()

        wait_for(rotated, timeout=60)
        files = sorted(log.parent.iterdir())
        assert {f.name for f in files} <= {"server.log", *(f"server.log.{i}" for i in range(1, 6))}
        assert all(f.stat().st_size <= 4000 for f in files if f.name != "server.log"), files
        assert "Predictions model=echo" in (log.parent / "server.log.1").read_text()
    finally:
        assert srv.stop() == 0
    # the process's own stderr followed the current file: the shutdown lines are in it
    assert "shutting down" in log.read_text()


def test_progress_bars_and_library_warnings_stay_out(store: Path, tmp_path: Path) -> None:
    build_mar(store, "noisy", "noisy_handler.py")
    for level in ("INFO", "DEBUG"):
        srv = ServerProcess(tmp_path / level, store, ["--models", "noisy=noisy.mar", "--workers-per-model", "1",
                                                      "--log-level", level])
        try:
            srv.wait_workers("noisy", 1)
            assert srv.predict("noisy", "x") == b"x"
        finally:
            assert srv.stop() == 0, srv.log()
        log = srv.log()
        assert "noisy progress" not in log and "it/s" not in log
        warned = [line for line in log.splitlines() if "noisy library warning" in line]
        if level == "INFO":
            assert not warned and "noisy transformers warning" not in log
        else:  # once, at DEBUG
            assert len(warned) == 1 and " DEBUG " in warned[0], warned
            assert "noisy transformers warning" in log
