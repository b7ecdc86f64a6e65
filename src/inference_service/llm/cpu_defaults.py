"""The OpenVINO engine's defaults per CPU kind: the weight format and the OpenVINO settings that
touch speed, from a table measured on each kind (docs/llm.md, "Engines"; benchmarks/RESULTS.md,
"Issue 40").

The kind is the best instruction set in ``/proc/cpuinfo``'s ``flags``: ``amx`` (``amx_int8`` or
``amx_bf16``), ``avx512_vnni`` (``avx512_vnni`` or ``avx512_bf16``), ``avx_vnni``, ``avx2``, else
``other``. A row not measured keeps the defaults from before the table. Every weight format a row
names holds the quality bar with the row's properties (tests/e2e/test_llm_quality.py).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from inference_service.llm.openvino_ir import DEFAULT_WEIGHT_FORMAT

#: CPU kinds, best first, each with the ``/proc/cpuinfo`` flags that make it.
CPU_KINDS: tuple[tuple[str, frozenset[str]], ...] = (
    ("amx", frozenset({"amx_int8", "amx_bf16"})),
    ("avx512_vnni", frozenset({"avx512_vnni", "avx512_bf16"})),
    ("avx_vnni", frozenset({"avx_vnni"})),
    ("avx2", frozenset({"avx2"})),
)
OTHER = "other"
#: The flags named in the log line and DescribeModel (those the kinds are read from, and AVX-512).
SHOWN_FLAGS = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")


@dataclass(frozen=True)
class CpuInfo:
    """The CPU a process runs on: ``/proc/cpuinfo``'s first ``model name`` and ``flags``."""

    model: str
    flags: frozenset[str]

    @property
    def kind(self) -> str:
        """Its row of :data:`TABLE`."""
        return next((kind for kind, flags in CPU_KINDS if flags & self.flags), OTHER)

    def __str__(self) -> str:
        shown = [flag for flag in SHOWN_FLAGS if flag in self.flags]
        return f"{self.model} ({', '.join(shown) or 'none of ' + '/'.join(SHOWN_FLAGS[:2])})"


def parse_cpuinfo(text: str) -> CpuInfo:
    """The first processor's ``model name`` (``"unknown"`` when absent, as on ARM) and ``flags``."""
    model, flags = "unknown", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip() or "unknown"
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        if model != "unknown" and flags:
            break
    return CpuInfo(model, flags)


@functools.cache
def this_cpu(path: str = "/proc/cpuinfo") -> CpuInfo:
    """This machine's :class:`CpuInfo`, read once per process (no file: an ``other`` CPU)."""
    try:
        return parse_cpuinfo(Path(path).read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return CpuInfo("unknown", frozenset())


@dataclass(frozen=True)
class CpuDefaults:
    """One row of :data:`TABLE`.

    Args:
        kind: the CPU kind (:data:`CPU_KINDS`).
        weight_format: the default weight format (:data:`~inference_service.llm.openvino_ir.WEIGHT_FORMATS`).
        properties: OpenVINO CPU properties of ``weight_format`` on this kind, over its
            :data:`~inference_service.llm.openvino_engine.QUALITY_PROPERTIES` (another format keeps its own).
        max_num_batched_tokens: tokens per step; ``None``: the engine's default.
        cache_size_gb: the paged KV cache (GB); ``None``: the engine's default (enough for
            ``batchSize`` requests at the model's full context).
        threads: ``INFERENCE_NUM_THREADS``; ``None``: every CPU the worker has.
        measured: where the row's figures are (``""``: not measured, the defaults from before the table).
    """

    kind: str
    weight_format: str
    properties: Mapping[str, Any]
    max_num_batched_tokens: int | None = None
    cache_size_gb: float | None = None
    threads: int | None = None
    measured: str = ""


def _unmeasured(kind: str) -> CpuDefaults:
    """The defaults from before the table: int8 with its quality properties."""
    return CpuDefaults(kind, DEFAULT_WEIGHT_FORMAT, MappingProxyType({}))


#: The measured rows, by CPU kind; a kind absent here gets :func:`_unmeasured`'s row.
#: avx2: int8 against int4 in-process, 5 alternating rounds under load (benchmarks/cpu_defaults.py):
#: int4 was faster at 8 streams but not at 1, and int8 is closer to fp32 (+0.9 % against +1.6 %).
#: A step of 64 tokens instead of 256 (benchmarks/llm_peers.py, ``ours_chunk64``): a decode step
#: takes in half a 128-token prompt, not all of it; at 8 streams ITL p99 and TTFT p50 fell by
#: half or more, tokens/s held or rose at 1, 8 and 32 streams and beside a busy core.
TABLE: Mapping[str, CpuDefaults] = MappingProxyType({
    "avx2": CpuDefaults("avx2", "int8", MappingProxyType({}), max_num_batched_tokens=64,
                        measured='AMD EPYC, 2 cores (benchmarks/RESULTS.md, "Issue 40", "Prefill chunks")'),
})


def defaults_for(kind: str) -> CpuDefaults:
    """The row of ``kind`` (measured, or the defaults from before the table)."""
    return TABLE.get(kind) or _unmeasured(kind)


@dataclass(frozen=True)
class FormatChoice:
    """The weight format a worker serves, why, and the OpenVINO settings that go with it."""

    weight_format: str
    reason: str
    properties: Mapping[str, Any]
    row: CpuDefaults
    cpu: CpuInfo


def choose_weight_format(configured: str | None, cpu: CpuInfo | None = None) -> FormatChoice:
    """``configured`` when it names a format (the row's properties only when it is the row's own),
    else (``None`` or ``"auto"``) the default of ``cpu``'s row (default: this machine's)."""
    cpu = cpu or this_cpu()
    row = defaults_for(cpu.kind)
    source = f"measured on {row.measured}" if row.measured else "not measured: the defaults from before the table"
    if configured is None or configured == "auto":
        reason = f"the default for this CPU, {cpu} (row {row.kind}, {source})"
        return FormatChoice(row.weight_format, reason, row.properties, row, cpu)
    properties = row.properties if configured == row.weight_format else MappingProxyType({})
    return FormatChoice(configured, "set in the handler config", properties, row, cpu)
