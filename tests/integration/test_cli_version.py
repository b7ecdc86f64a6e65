"""``--version``: prints the version and exits 0 without starting anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from inference_service import __version__

CONSOLE_SCRIPT = Path(sys.executable).parent / "inference-service"


@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "inference_service"],
    [str(CONSOLE_SCRIPT)],
], ids=["python -m", "console script"])
def test_version_prints_and_starts_nothing(command, tmp_path):
    assert Path(command[0]).exists(), f"{command[0]} is not installed (scripts/install installs it)"
    # --foreground and a model store that does not exist: anything but --version would start or fail
    proc = subprocess.run([*command, "--version", "--foreground", "--model-store", str(tmp_path / "nowhere")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"inference-service {__version__}\n"
    assert proc.stderr == ""
    assert list(tmp_path.iterdir()) == []  # no run directory, status file, log or key file
