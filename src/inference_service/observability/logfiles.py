"""Where the server's log goes: a file rotated by size, or a logging configuration of your own.

The file rotates at ``--log-max-bytes`` (TorchServe's ``ts_log.log`` size) and keeps 5 old
ones; stdout and stderr follow it, so a crash's traceback lands beside the last log lines.
``--log-config FILE`` is a :func:`logging.config.dictConfig` (YAML or JSON) applied after the
defaults, ``disable_existing_loggers`` defaulting to false. See docs/observability.md.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
import sys
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import Any

import yaml

#: Size at which the log file rotates (``--log-max-bytes``): TorchServe's 100 MB.
DEFAULT_LOG_MAX_BYTES = 100 * 1024**2
#: Rotated files kept (``.1`` to ``.5``), as TorchServe's log4j2 ``DefaultRolloverStrategy``.
LOG_BACKUPS = 5


class RotatingLog(RotatingFileHandler):
    """A :class:`RotatingFileHandler` whose file also receives the process's stdout and stderr."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        super().__init__(path, maxBytes=max_bytes, backupCount=LOG_BACKUPS, encoding="utf-8")
        self._redirect()

    def doRollover(self) -> None:  # noqa: N802 - the standard library's name
        """Rotate, then point stdout and stderr at the new file."""
        super().doRollover()
        self._redirect()

    def _redirect(self) -> None:
        stream = self.stream
        if stream is None:
            return
        for out in (sys.stdout, sys.stderr):
            out.flush()
            os.dup2(stream.fileno(), out.fileno())


def log_to_file(path: Path, max_bytes: int) -> None:
    """Replace the root logger's handlers by a :class:`RotatingLog` on ``path`` (formats kept)."""
    root = logging.getLogger()
    formatter = root.handlers[0].formatter if root.handlers else None
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = RotatingLog(path, max_bytes)
    handler.setFormatter(formatter)
    root.addHandler(handler)


def read_log_config(path: Path) -> dict[str, Any]:
    """The dictConfig in ``path`` (JSON for ``.json``, else YAML); ValueError unless a ``version: 1`` mapping."""
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"--log-config {path}: {exc}") from exc
    if not isinstance(data, dict) or data.get("version") != 1:
        raise ValueError(f"--log-config {path}: not a logging dictConfig (a mapping with 'version: 1')")
    data.setdefault("disable_existing_loggers", False)
    return data


def apply_log_config(config: dict[str, Any], path: Path) -> None:
    """Apply a dictConfig from :func:`read_log_config`; ValueError naming the file if refused."""
    try:
        logging.config.dictConfig(config)
    except (ValueError, TypeError, AttributeError, ImportError) as exc:
        raise ValueError(f"--log-config {path}: {exc}") from exc
