"""Entry point of a worker process: ``python -m inference_service.worker.main --fd N`` (or
``--connect PATH`` per torchrun rank). CPU settings are applied before anything imports torch;
the main thread reads the socket itself (no thread hand-off per request)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import json
import logging
import os
import socket
import sys
import traceback
import warnings

from inference_service.contracts import wire
from inference_service.contracts.handler_config import HandlerConfig
from inference_service.worker.async_runner import AsyncRunner
from inference_service.worker.channel import WorkerChannel
from inference_service.worker.continuous import ContinuousRunner
from inference_service.worker.cpu import apply_cpu_settings
from inference_service.worker.loader import HandlerLoadError
from inference_service.worker.runtime import Worker

log = logging.getLogger("inference_service.worker")

COMPAT_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "compat")


#: Libraries that keep a pool of compute threads (sized by ``OMP_NUM_THREADS``): a worker whose
#: handler has loaded one when it is ready counts in the server's CPU budget.
THREADED_LIBRARIES = ("torch", "openvino", "onnxruntime", "tensorflow", "numpy")
#: Libraries whose own warnings reach the log only at DEBUG.
LIBRARY_LOGGERS = ("transformers", "huggingface_hub", "torch", "optimum", "nncf", "openvino", "accelerate")


def quiet_libraries(level: str) -> None:
    """Keep progress bars and library warnings out of the server's log: no tqdm bars, Python
    warnings once each at DEBUG (logger ``py.warnings``), the libraries' own loggers at ERROR
    unless ``level`` is DEBUG. Call before the handler imports them (tqdm reads its switch then,
    and transformers sets its logger's level from ``TRANSFORMERS_VERBOSITY`` at import)."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if level != "DEBUG":
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warned = logging.getLogger("py.warnings")

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: object = None, line: str | None = None) -> None:
        warned.debug("%s:%d: %s: %s", filename, lineno, category.__name__, message)

    warnings.showwarning = show
    if level != "DEBUG":
        for name in LIBRARY_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)


def _report_load_failure(channel: WorkerChannel, message: str) -> None:
    """Tell the server why loading failed; a server that has already let this worker go (the
    model unregistered, its load given up) closed the channel, and then there is no one to tell."""
    with contextlib.suppress(OSError):
        channel.send(wire.frame(wire.LOAD_FAILED, message.encode()))


def main(argv: list[str] | None = None) -> int:
    """Run a worker on the socket inherited as ``--fd``. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="inference_service.worker.main")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--fd", type=int, help="inherited socket (a single worker)")
    where.add_argument("--connect", help="Unix socket of the frontend (a rank of a torchrun group)")
    args = parser.parse_args(argv)
    if args.fd is not None:
        sock = socket.socket(fileno=args.fd)
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(args.connect)
    channel = WorkerChannel(sock)
    first = channel.read_frame()
    if first is None or first[0] != wire.INIT:
        return 2
    spec = wire.WorkerSpec.from_body(first[1])
    channel.window = spec.stream_window
    faulthandler.enable()
    # The frontend relays each stderr line at the level it starts with, under its own
    # timestamp and the worker's model and id (worker/process.py).
    level = (os.environ.get("INFERENCE_SERVICE_LOG_LEVEL") or spec.log_level or "INFO").upper()
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    quiet_libraries(level)
    if COMPAT_PATH not in sys.path:
        sys.path.insert(0, COMPAT_PATH)
    for path in reversed(spec.extra_paths):
        sys.path.insert(0, path)
    os.environ.setdefault("TS_MODEL_DIR", spec.model_dir)
    worker = Worker(channel, spec)
    try:
        handler_config = HandlerConfig.parse((spec.model_yaml_config or {}).get("handler"))
        cpu = apply_cpu_settings(handler_config)
    except ValueError as exc:  # a refused setting is one line, not a traceback
        log.error("model %s failed to load: %s", spec.model_name, exc)
        _report_load_failure(channel, str(exc))
        return 1
    try:
        log.info("cpu: %d intra-op threads, wait policy %s, affinity %s",
                 cpu["threads"], cpu["wait_policy"], cpu["affinity"] or "inherited")
        if handler_config.torch_threads is not None:  # capped: the handler sees what applies
            handler_config = handler_config.with_threads(cpu["threads"])
            section = (spec.model_yaml_config or {}).get("handler")
            if isinstance(section, dict):
                section["torch_threads"] = cpu["threads"]  # custom handlers read the section itself
        worker.context.handler_config = handler_config
        worker.load()
    except HandlerLoadError as exc:
        log.error("model %s failed to load: %s", spec.model_name, exc)
        _report_load_failure(channel, str(exc))
        return 1
    except BaseException as exc:  # noqa: BLE001 - report any load failure, even SystemExit
        log.error("model %s failed to load:\n%s", spec.model_name, traceback.format_exc())
        _report_load_failure(channel, f"{type(exc).__name__}: {exc}")
        return 1
    rank = int(os.environ.get("RANK", "0"))
    generation = bool(getattr(worker.handler_object, "accepts_generation_requests", False))
    threads = any(name in sys.modules for name in THREADED_LIBRARIES)
    engine = getattr(worker.handler_object, "engine_info", None)
    ready = wire.frame(wire.READY, json.dumps({
        "pid": os.getpid(), "rank": rank, "generation": generation, "threads": threads,
        "engine": dataclasses.asdict(engine) if isinstance(engine, wire.EngineInfo) else None}).encode())
    channel.send(b"".join(channel.pending_metrics() + [ready]))  # metrics recorded by initialize() first
    if spec.mode == wire.MODE_CONTINUOUS:
        ContinuousRunner(worker).serve()
    elif spec.mode == wire.MODE_ASYNC:
        AsyncRunner(worker).serve()
    else:
        worker.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
