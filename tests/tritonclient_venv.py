"""A virtual environment with NVIDIA's ``tritonclient[grpc,http]``, made at test time.

tritonclient pins ``protobuf<7`` while this project runs protobuf 7, so it cannot live in
``.venv``: the Open Inference Protocol tests create ``<repo>/.cache/venv-tritonclient`` once
(``python -m venv`` + ``pip install "tritonclient[grpc,http]"`` from PyPI; later runs reuse it)
and run small client scripts with its interpreter as subprocesses against the real server.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".cache" / "venv-tritonclient"
REQUIREMENT = "tritonclient[grpc,http]"


def _works(python: Path) -> bool:
    if not python.exists():
        return False
    probe = subprocess.run([str(python), "-c", "import tritonclient.grpc, tritonclient.http"],
                           capture_output=True, timeout=120)
    return probe.returncode == 0


def tritonclient_python() -> Path:
    """The interpreter of ``.cache/venv-tritonclient``, created and filled on first use.

    Raises:
        subprocess.CalledProcessError: the venv or the install failed (pip's output in the message).
    """
    python = VENV / "bin" / "python"
    VENV.parent.mkdir(parents=True, exist_ok=True)
    # test processes running in parallel make it once: the others wait here, then find it working
    with open(VENV.parent / "venv-tritonclient.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _make(python)


def _make(python: Path) -> Path:
    if _works(python):
        return python
    if VENV.exists():  # a half-made venv from an interrupted run
        shutil.rmtree(VENV)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, capture_output=True, timeout=300)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", REQUIREMENT],
                   check=True, capture_output=True, timeout=900)
    assert _works(python), f"{REQUIREMENT} did not install into {VENV}"
    return python


def run_client(script: str, *args: str, cwd: Path | None = None,
               timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (Python source) with the tritonclient venv's interpreter and ``args`` (in ``cwd``)."""
    return subprocess.run([str(tritonclient_python()), "-c", script, *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)
