"""The per-CPU default of the OpenVINO engine: the CPU kind read from ``/proc/cpuinfo``'s flags, the
table's rows (every format a row names is offered), and the choice between the row and a
configured weight format (tests/e2e/test_llm_quality.py holds each offered format to the bar)."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference_service.contracts.handler_config import HandlerConfig, HandlerConfigError
from inference_service.contracts.wire import EngineInfo
from inference_service.llm.cpu_defaults import (
    CPU_KINDS,
    OTHER,
    TABLE,
    CpuInfo,
    choose_weight_format,
    defaults_for,
    parse_cpuinfo,
    this_cpu,
)
from inference_service.llm.openvino_engine import QUALITY_PROPERTIES
from inference_service.llm.openvino_ir import DEFAULT_WEIGHT_FORMAT, WEIGHT_FORMATS

#: ``flags`` lines cut down to what matters, of real CPUs of each kind.
FLAGS = {
    "amx": "fpu sse2 avx avx2 fma avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8",  # Sapphire Rapids
    "avx512_vnni": "fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni avx512_bf16",  # AMD Zen 4
    "avx_vnni": "fpu sse2 avx avx2 fma avx_vnni",  # Alder Lake
    "avx2": "fpu sse2 avx avx2 fma",  # AMD Zen 3
    OTHER: "fpu sse2 avx",
}


def _cpuinfo(flags: str, model: str = "Some CPU") -> str:
    block = f"processor\t: 0\nvendor_id\t: X\nmodel name\t: {model}\nflags\t\t: {flags}\n"
    return block + "\n" + block.replace(": 0", ": 1").replace(model, "second")


@pytest.mark.parametrize("kind", list(FLAGS))
def test_the_kind_is_the_best_instruction_set_in_the_flags(kind: str) -> None:
    cpu = parse_cpuinfo(_cpuinfo(FLAGS[kind], "AMD EPYC 7B13"))
    assert cpu.kind == kind
    assert cpu.model == "AMD EPYC 7B13"  # the first processor's
    assert str(cpu).startswith("AMD EPYC 7B13 (")


def test_a_cpuinfo_without_flags_or_model_is_an_other_cpu() -> None:
    arm = parse_cpuinfo("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes\n")
    assert (arm.model, arm.kind, str(arm)) == ("unknown", OTHER, "unknown (none of avx2/avx_vnni)")
    assert parse_cpuinfo("").kind == OTHER


def test_this_machine_is_read_once_and_a_missing_file_is_other(tmp_path: Path) -> None:
    assert this_cpu() is this_cpu()
    assert this_cpu().kind in {kind for kind, _ in CPU_KINDS} | {OTHER}
    missing = this_cpu(str(tmp_path / "cpuinfo"))
    assert missing == CpuInfo("unknown", frozenset())


def test_every_row_names_an_offered_format_and_unmeasured_kinds_keep_the_old_default() -> None:
    for kind, row in TABLE.items():
        assert row.kind == kind and row.weight_format in WEIGHT_FORMATS and row.measured
        assert set(row.properties) <= {"KV_CACHE_PRECISION", "DYNAMIC_QUANTIZATION_GROUP_SIZE"}
    for kind in [k for k, _ in CPU_KINDS if k not in TABLE] + [OTHER]:
        row = defaults_for(kind)
        assert (row.weight_format, dict(row.properties), row.measured) == (DEFAULT_WEIGHT_FORMAT, {}, "")
    assert set(QUALITY_PROPERTIES) == set(WEIGHT_FORMATS)  # each offered format has its quality settings


@pytest.mark.parametrize("configured", [None, "auto"])
def test_auto_or_absent_is_the_rows_format_with_its_reason(configured: str | None) -> None:
    for kind, flags in FLAGS.items():
        cpu = parse_cpuinfo(_cpuinfo(flags))
        choice = choose_weight_format(configured, cpu)
        row = defaults_for(kind)
        assert (choice.weight_format, choice.row, choice.cpu) == (row.weight_format, row, cpu)
        assert choice.properties == row.properties
        assert choice.reason.startswith(f"the default for this CPU, {cpu} (row {kind}, ")
        assert ("measured on " in choice.reason) == bool(row.measured)
        assert ("not measured" in choice.reason) == (not row.measured)


def test_a_configured_format_wins_and_takes_the_rows_properties_only_when_it_is_the_rows() -> None:
    cpu = parse_cpuinfo(_cpuinfo(FLAGS["avx2"]))
    row = defaults_for("avx2")
    for weight_format in WEIGHT_FORMATS:
        choice = choose_weight_format(weight_format, cpu)
        assert (choice.weight_format, choice.reason) == (weight_format, "set in the handler config")
        assert choice.properties == (row.properties if weight_format == row.weight_format else {})


def test_the_handler_config_takes_auto_and_refuses_a_format_not_offered() -> None:
    assert HandlerConfig.parse({"weight_format": "AUTO"}).weight_format == "auto"
    assert HandlerConfig.parse({}).weight_format is None
    with pytest.raises(HandlerConfigError, match="'weight_format' must be one of auto, ") as refused:
        HandlerConfig.parse({"weight_format": "int3"})
    assert refused.value.key == "weight_format"


def test_the_engine_info_travels_in_ready_and_shows_its_set_fields() -> None:
    info = EngineInfo("openvino", "int8", "the default for this CPU", "AMD EPYC (avx2), kind avx2")
    assert EngineInfo.from_json({"name": "openvino", "weight_format": "int8", "reason": "the default for this CPU",
                                 "cpu": "AMD EPYC (avx2), kind avx2"}) == info
    assert info.as_json() == {"name": "openvino", "weightFormat": "int8", "reason": "the default for this CPU",
                              "cpu": "AMD EPYC (avx2), kind avx2"}
    assert EngineInfo("torch").as_json() == {"name": "torch"}
    for bad in (None, "openvino", {}, {"weight_format": "int8"}, {"name": "openvino", "cpu": 3}):
        assert EngineInfo.from_json(bad) is None
