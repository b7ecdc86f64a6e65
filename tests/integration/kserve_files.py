"""KServe's TorchServe files (tests/data/kserve, see its README) and what the tests build from them:
the ``torchserve`` command as pip installs it, the MNIST archive of KServe's sample (its model file,
seeded random weights, its handler), and the digit that archive answers for a sample request."""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import sys
import tomllib
from pathlib import Path
from typing import Any

from conftest import ROOT, build_mar

KSERVE = ROOT / "tests" / "data" / "kserve"


def console_script(name: str, bin_dir: Path) -> Path:
    """``bin_dir/name``: the console script ``[project.scripts]`` declares, written as pip writes it."""
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"][name]
    module, function = entry.split(":")
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / name
    script.write_text(f"#!{sys.executable}\nimport re\nimport sys\nfrom {module} import {function}\n"
                      "if __name__ == '__main__':\n"
                      "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
                      f"    sys.exit({function}())\n")
    script.chmod(0o755)
    return script


def _mnist_module() -> Any:
    spec = importlib.util.spec_from_file_location("kserve_mnist", KSERVE / "mnist.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mnist_weights(path: Path) -> Path:
    """KServe's ``Net`` with seeded random weights (the sample's trained weights are not in its repository)."""
    import torch

    torch.manual_seed(0)
    torch.save(_mnist_module().Net().state_dict(), path)
    return path


def build_mnist(store: Path, weights: Path) -> str:
    """``mnist.mar`` as KServe's model-archiver README builds it (the handler adapted, see its docstring)."""
    return build_mar(store, "mnist", "kserve_mnist_handler.py", serialized=str(weights),
                     model_file=str(KSERVE / "mnist.py"))


def expected_digit(weights: Path, tensor: list[Any]) -> int:
    """The digit the archive answers for an image as the model takes it (1 x 28 x 28; a v2
    tensor input goes in as it is, as TorchServe's vision handlers take a tensor)."""
    import torch

    net = _mnist_module().Net()
    net.load_state_dict(torch.load(weights))
    net.eval()
    with torch.no_grad():
        return int(net(torch.tensor([tensor], dtype=torch.float32)).argmax(1).item())


def v1_tensor() -> list[Any]:
    """The image of KServe's v1 sample (v1/mnist.json, a base64 PNG) as the handler feeds it to the
    model: 1 x 28 x 28, scaled to [0, 1] and normalized with MNIST's mean and deviation."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    png = base64.b64decode(json.loads((KSERVE / "v1" / "mnist.json").read_text())["instances"][0]["data"])
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("L"), dtype=np.float32) / 255.0
    tensor: list[Any] = [((pixels - 0.1307) / 0.3081).tolist()]
    return tensor


def v2_tensor() -> list[Any]:
    """The 1 x 28 x 28 image of KServe's v2 tensor sample (v2/mnist_v2.json)."""
    tensor: list[Any] = json.loads((KSERVE / "v2" / "mnist_v2.json").read_text())["inputs"][0]["data"]
    return tensor


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def config_with_ports(protocol: str, ports: dict[int, int]) -> str:
    """KServe's ``protocol`` (v1, v2) config.properties with its port numbers replaced, nothing else."""
    text = (KSERVE / protocol / "config.properties").read_text()
    return re.sub(r"(?<=[:=])(8085|8082|7070|7071)\b", lambda m: str(ports[int(m[1])]), text)
