"""The wire-drift guard: ``buf breaking`` at WIRE_JSON level against TorchServe 0.12.0's own protos.

TorchServe's ``inference.proto`` and ``management.proto`` come out of its PyPI wheel at test
time (see ``torchserve_wheel.py``); the ``google/rpc/status.proto`` they import is the copy
vendored in ``protos/``. WIRE_JSON (not just WIRE) because clients also speak the JSON
mapping (grpc-gateway, ``grpcurl``, proto-loader's objects): a renamed field keeps the binary
wire but breaks them. Equivalent command line, from ``protos/``::

    buf breaking . --against <dir with TorchServe's protos> \\
        --config '{"version":"v2","breaking":{"use":["WIRE_JSON"]}}'
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from torchserve_wheel import extract_torchserve_protos

pytestmark = pytest.mark.external

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
BUF = Path(sys.executable).parent / "buf"
WIRE_JSON = json.dumps({"version": "v2", "breaking": {"use": ["WIRE_JSON"]}})


@pytest.fixture(scope="module")
def torchserve_protos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with TorchServe 0.12.0's protos and the google/rpc/status.proto they import."""
    out = tmp_path_factory.mktemp("torchserve_protos")
    extract_torchserve_protos(out)
    (out / "google" / "rpc").mkdir(parents=True)
    shutil.copy(PROTOS / "google" / "rpc" / "status.proto", out / "google" / "rpc" / "status.proto")
    return out


def buf_breaking(module: Path, against: Path, config: str = WIRE_JSON) -> subprocess.CompletedProcess[str]:
    """``buf breaking`` of the protos in ``module`` against those in ``against`` (JSON lines on stdout)."""
    assert BUF.exists(), "buf is not installed: run scripts/install --dev"
    # run from inside the module so the repository's buf.yaml (whose module is protos/) is not in the way
    return subprocess.run([str(BUF), "breaking", ".", "--against", str(against), "--config", config,
                           "--error-format", "json"], cwd=module, capture_output=True, text=True, timeout=60)


def _violations(proc: subprocess.CompletedProcess[str]) -> list[dict]:
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def test_protos_are_wire_json_compatible_with_torchserve(torchserve_protos):
    names = sorted(p.name for p in torchserve_protos.glob("*.proto"))
    assert names == ["inference.proto", "management.proto"]
    proc = buf_breaking(PROTOS, torchserve_protos)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _violations(proc) == []


def test_the_guard_catches_drift(torchserve_protos, tmp_path):
    drifted = tmp_path / "protos"
    shutil.copytree(PROTOS, drifted)
    source = (drifted / "inference.proto").read_text()
    # A JSON-only break: the binary wire is the same, the JSON field name is not.
    (drifted / "inference.proto").write_text(source.replace("string health = 1;", "string healthy = 1;"))
    wire_only = buf_breaking(drifted, torchserve_protos, json.dumps({"version": "v2", "breaking": {"use": ["WIRE"]}}))
    assert wire_only.returncode == 0, wire_only.stdout + wire_only.stderr
    renamed = buf_breaking(drifted, torchserve_protos)
    assert renamed.returncode != 0
    kinds = {(v["type"], v["path"]) for v in _violations(renamed)}
    assert ("FIELD_SAME_JSON_NAME", "inference.proto") in kinds, renamed.stdout

    # A binary break: a field number moved.
    management = (drifted / "management.proto").read_text()
    assert "string model_name = 1;" in management
    (drifted / "management.proto").write_text(management.replace("string model_name = 1;", "string model_name = 9;", 1))
    moved = buf_breaking(drifted, torchserve_protos)
    assert moved.returncode != 0
    messages = [v["message"] for v in _violations(moved) if v["path"] == "management.proto"]
    assert any('"model_name"' in m for m in messages), moved.stdout
