"""The OpenVINO exporter's process as the converting process sees it: its environment, how long
it should take (:func:`estimate`; :func:`gguf_estimate` for a GGUF's conversion to a transformers
folder), its progress while it runs, its peak memory, and why it failed (:func:`failure_reason`).
:func:`inference_service.llm.openvino_ir.convert` runs it."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from inference_service.llm.ir_export import STOPPED_BY
from inference_service.llm.model import ModelPreparationError

log = logging.getLogger("inference_service.llm.openvino_ir")

#: Not inherited by the exporter and the check: the OpenVINO worker's ``USE_TORCH=0`` (they need torch).
_NOT_INHERITED = ("USE_TORCH",)
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b:?")
#: Seconds of conversion (the check included) per million parameters, by weight format: SmolLM2-135M
#: took 39 s in int8 and 69 s in int4 on 2 cores (benchmarks/RESULTS.md, "Conversion estimates").
SECONDS_PER_MILLION = {"fp32": 0.3, "int8": 0.3, "int4": 0.5}
#: Seconds of a GGUF's conversion to a transformers folder (its check against llama.cpp included) per
#: million parameters: SmolLM2-135M took about half a minute.
GGUF_SECONDS_PER_MILLION = 0.22
#: How often a running conversion logs its progress (s).
PROGRESS_S = 30.0
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def exporter_environment() -> dict[str, str]:
    """This process's environment, less what keeps the exporter from importing torch, offline
    and without progress bars or library notices."""
    env = {key: value for key, value in os.environ.items() if key not in _NOT_INHERITED}
    env.update(HF_HUB_OFFLINE="1", TQDM_DISABLE="1", TRANSFORMERS_VERBOSITY="error",
               TRANSFORMERS_NO_ADVISORY_WARNINGS="1", PYTHONUNBUFFERED="1")
    return env


def parameters(model_dir: Path) -> int | None:
    """About how many parameters a transformers folder holds: its weight files' bytes over the
    bytes of its ``torch_dtype`` (4 when it names none); ``None`` without weight files."""
    size = sum(p.stat().st_size for p in model_dir.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file())
    if not size:
        return None
    try:
        dtype = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("torch_dtype")
    except (OSError, ValueError, AttributeError):
        dtype = None
    return size // _DTYPE_BYTES.get(str(dtype), 4)


def estimate(model_dir: Path, weight_format: str) -> str:
    """``"135M parameters, about 40 s on 2 cores"``: what converting ``model_dir`` should take."""
    return _shown(parameters(model_dir), SECONDS_PER_MILLION.get(weight_format, 0.5))


def gguf_estimate(gguf: Path) -> str:
    """What converting ``gguf`` to a transformers folder should take, as :func:`estimate` says it
    (its parameters: the elements of its tensors)."""
    try:
        from gguf import GGUFReader

        count: int | None = sum(int(tensor.n_elements) for tensor in GGUFReader(str(gguf)).tensors)
    except Exception:  # noqa: BLE001 - an estimate: a file gguf cannot read is refused by the conversion
        count = None
    return _shown(count, GGUF_SECONDS_PER_MILLION)


def _shown(count: int | None, seconds_per_million: float) -> str:
    if count is None:
        return "its size unknown"
    seconds = count / 1e6 * seconds_per_million
    shown = f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M"
    took = f"about {seconds / 60:.0f} min" if seconds >= 120 else f"about {max(5, round(seconds, -1)):.0f} s"
    return f"{shown} parameters, {took} on 2 cores"


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory in bytes (``VmHWM``; 0 when unreadable)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def run_exporter(command: list[str], source: Path, timeout_s: float) -> tuple[int, str, int]:
    """Run the exporter's ``command`` in a session of its own; ``(exit status, its output, its peak
    RSS in bytes)``, a progress line logged every :data:`PROGRESS_S`. Its whole process group is
    killed if this call ends early (a timeout, an exception, an interrupt).

    Raises:
        ModelPreparationError: it ran past ``timeout_s``.
    """
    proc = subprocess.Popen(command, env=exporter_environment(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(proc.stdout or ()), name="exporter-output", daemon=True)
    reader.start()
    start = reported = time.monotonic()
    peak = 0
    try:
        while True:
            peak = max(peak, _peak_rss(proc.pid))  # read every second: a kill leaves no record of it
            try:
                proc.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if now - start > timeout_s:
                    raise ModelPreparationError(
                        f"converting {source} to OpenVINO took over {timeout_s:.0f} s; set 'engine: torch' "
                        "in the handler config to serve it with the torch engine") from None
                if now - reported >= PROGRESS_S:
                    reported = now
                    log.info("converting %s to OpenVINO IR: %.0f s so far, the exporter's peak memory %.2f GB",
                             source.name, now - start, peak / 1e9)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=5)
    return proc.returncode, "".join(chunks), peak


def failure_reason(output: str, returncode: int, peak_rss: int = 0) -> str:
    """Why the exporter failed, from its output: the last exception line of its traceback (else
    its last line), or the signal that killed it, with its peak memory and the next step."""
    stopped = next((line for line in output.splitlines() if line.startswith(STOPPED_BY)), None)
    if stopped is not None:  # it ended itself (its process group) on a SIGTERM
        return f"the exporter was stopped by a SIGTERM from {stopped.removeprefix(STOPPED_BY)}"[:400]
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
        seen = f" after reaching {peak_rss / 1e9:.2f} GB" if peak_rss else ""
        hint = (f"{seen} (out of memory? free memory, or convert on a larger machine and serve the IR; a GGUF "
                "can be served as it is with --engine llamacpp)") if -returncode == signal.SIGKILL else seen
        return f"the exporter was killed by {name}{hint}"
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    cause = next((line for line in reversed(lines) if _EXCEPTION_LINE.match(line)), None)
    if cause is None:
        cause = lines[-1] if lines else f"the exporter exited with status {returncode} and printed nothing"
    return cause[:400]
