"""TorchServe 0.12.0's own protos, taken from its PyPI wheel at test time (nothing of TorchServe is committed).

The wheel is downloaded once into ``<repo>/.cache/wheels`` (``pip download --no-deps``);
``inference.proto`` and ``management.proto`` come out of the ``model-server.jar`` inside it.
Used by the wire tests (``test_torchserve_protos.py``: stubs generated from them drive the
server; ``test_wire_breaking.py``: ``buf breaking`` against them).
"""

from __future__ import annotations

import fcntl
import io
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "wheels"
TORCHSERVE_VERSION = "0.12.0"
PROTO_NAMES = ("inference.proto", "management.proto")


def torchserve_wheel() -> Path:
    """The ``torchserve==0.12.0`` wheel, downloaded from PyPI into ``.cache/wheels`` on first use."""
    CACHE.mkdir(parents=True, exist_ok=True)
    pattern = f"torchserve-{TORCHSERVE_VERSION}-*.whl"
    # test processes running in parallel download it once: the others wait here, then find it
    with open(CACHE / "torchserve.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = sorted(CACHE.glob(pattern))
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                            f"torchserve=={TORCHSERVE_VERSION}", "-d", str(CACHE)], check=True, timeout=300)
            found = sorted(CACHE.glob(pattern))
    assert found, f"torchserve {TORCHSERVE_VERSION} wheel not downloaded"
    return found[0]


def extract_torchserve_protos(dest: Path, names: tuple[str, ...] = PROTO_NAMES) -> list[Path]:
    """Write TorchServe's ``names`` protos from the wheel's ``model-server.jar`` into ``dest``; returns their paths."""
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    with zipfile.ZipFile(torchserve_wheel()) as wheel:
        jar_name = next(n for n in wheel.namelist() if n.endswith("model-server.jar"))
        with zipfile.ZipFile(io.BytesIO(wheel.read(jar_name))) as jar:
            for name in names:
                member = next(n for n in jar.namelist() if n.endswith("/" + name) or n == name)
                path = dest / name
                path.write_bytes(jar.read(member))
                out.append(path)
    return out
