"""Which Python runs a model's workers: the server's own, or an environment of the engine's own
(``engine: vllm``, whose pins conflict with ours; docs/install.md, "Running on a GPU")."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from inference_service.contracts.handler_config import HandlerConfig

#: The environment ``scripts/install --engine vllm`` makes, beside the project's ``.venv``.
VLLM_VENV = ".venv-vllm"


class InterpreterError(ValueError):
    """The handler config names no Python that can run the model's workers (the message says why)."""


def _project_dirs() -> list[Path]:
    """Where a ``.venv-vllm`` is looked for: beside the server's environment, and in the project's root
    (a source checkout: ``src/inference_service`` two levels below it)."""
    dirs = [Path(sys.prefix).parent]
    source_root = Path(__file__).resolve().parents[3]
    if (source_root / "pyproject.toml").is_file() and source_root not in dirs:
        dirs.append(source_root)
    return dirs


def worker_python(config: HandlerConfig) -> str:
    """The interpreter of the model's workers: ``python`` when set (``~`` expanded, relative to the
    working directory); for ``engine: vllm`` the first ``.venv-vllm/bin/python`` of
    :func:`_project_dirs`, else the server's own when vLLM is installed beside it.

    Raises:
        InterpreterError: ``python`` is not an executable file, or ``engine: vllm`` finds no Python with vLLM.
    """
    if config.python is not None:
        path = os.path.abspath(os.path.expanduser(config.python))
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise InterpreterError(f"handler config: 'python' must name an executable file, got {config.python!r}")
        return path
    if config.engine != "vllm":
        return sys.executable
    for directory in _project_dirs():
        candidate = directory / VLLM_VENV / "bin" / "python"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise InterpreterError(
        f"handler config: 'engine: vllm' needs vLLM's own Python environment: none at "
        f"{' or '.join(str(d / VLLM_VENV) for d in _project_dirs())}; run scripts/install --engine vllm, "
        "or name its interpreter with 'python'")
