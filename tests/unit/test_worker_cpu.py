"""worker/cpu.py: the CPU quota a worker reads, its thread default and the settings it applies."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from inference_service.contracts.handler_config import HandlerConfig, HandlerConfigError
from inference_service.worker.cpu import (
    apply_cpu_settings,
    cgroup_cpu_limit,
    default_threads,
    parse_affinity,
    usable_cpus,
)


def write(root: Path, name: str, text: str) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota(tmp_path: Path) -> None:
    write(tmp_path, "cpu.max", "150000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.5


def test_cgroup_v2_unlimited(tmp_path: Path) -> None:
    write(tmp_path, "cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None


def test_cgroup_v1_quota_and_none(tmp_path: Path) -> None:
    write(tmp_path, "cpu/cpu.cfs_quota_us", "50000\n")
    write(tmp_path, "cpu/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(tmp_path) == 0.5
    write(tmp_path, "cpu/cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_limit(tmp_path) is None


def test_no_cgroup_files_mean_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path) is None
    assert usable_cpus(tmp_path) == len(os.sched_getaffinity(0))


def test_garbage_cpu_max_is_no_quota(tmp_path: Path) -> None:
    write(tmp_path, "cpu.max", "lots\n")
    assert cgroup_cpu_limit(tmp_path) is None


def test_quota_caps_usable_cpus_and_threads(tmp_path: Path) -> None:
    write(tmp_path, "cpu.max", "100000 100000\n")
    assert usable_cpus(tmp_path) == 1.0
    assert default_threads(1, tmp_path) == 1
    assert default_threads(4, tmp_path) == 1  # never 0
    write(tmp_path, "cpu.max", "20000 100000\n")  # a fifth of a CPU still gets one thread
    assert usable_cpus(tmp_path) == 1.0


def test_threads_split_between_workers(tmp_path: Path) -> None:
    write(tmp_path, "cpu.max", "400000 100000\n")
    cpus = min(4, len(os.sched_getaffinity(0)))
    assert default_threads(2, tmp_path) == max(1, cpus // 2)


@pytest.mark.parametrize(("value", "cpus"), [
    ([0], {0}), ("0", {0}), ("0-2,5", {0, 1, 2, 5}), (None, None), ("", None),
])
def test_parse_affinity(value: object, cpus: set[int] | None) -> None:
    assert parse_affinity(value) == cpus


@pytest.mark.parametrize("value", ["a-b", "3-1", "-1", "0-", "1,", [0, -1], [True], 1.5, []])
def test_parse_affinity_rejects(value: object) -> None:
    with pytest.raises(ValueError, match="cpu_affinity"):
        parse_affinity(value)


def test_apply_defaults_to_passive_and_inherited_threads() -> None:
    env = {"OMP_NUM_THREADS": "3"}
    applied = apply_cpu_settings(HandlerConfig(), env)
    assert applied == {"threads": 3, "wait_policy": "passive", "affinity": None}
    assert env == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3", "OMP_WAIT_POLICY": "PASSIVE"}


def test_apply_inherits_server_wait_policy() -> None:
    env = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "active"}
    assert apply_cpu_settings(HandlerConfig(), env)["wait_policy"] == "active"
    assert env["OMP_WAIT_POLICY"] == "ACTIVE"


def test_apply_model_config_wins() -> None:
    env = {"OMP_NUM_THREADS": "4", "OMP_WAIT_POLICY": "PASSIVE"}
    applied = apply_cpu_settings(HandlerConfig.parse({"torch_threads": 2, "omp_wait_policy": "ACTIVE"}), env)
    assert applied["threads"] == 2 and env["OMP_NUM_THREADS"] == "2" and env["OMP_WAIT_POLICY"] == "ACTIVE"


def test_apply_affinity_caps_threads() -> None:
    before = os.sched_getaffinity(0)
    cpu = min(before)
    try:
        applied = apply_cpu_settings(HandlerConfig.parse({"cpu_affinity": [cpu], "torch_threads": 8}), {})
        assert applied == {"threads": 1, "wait_policy": "passive", "affinity": [cpu]}
        assert os.sched_getaffinity(0) == {cpu}
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.parametrize(("config", "message"), [
    ({"torch_threads": 0}, "torch_threads"),
    ({"torch_threads": True}, "torch_threads"),
    ({"omp_wait_policy": "spin"}, "omp_wait_policy"),
    ({"omp_wait_policy": 1}, "omp_wait_policy"),
    ({"cpu_affinity": [100000]}, "'cpu_affinity' must name CPUs from 0 to"),
])
def test_bad_cpu_values_are_refused_by_name(config: dict[str, object], message: str) -> None:
    with pytest.raises(HandlerConfigError, match=message) as err:
        HandlerConfig.parse(config)
    assert err.value.key == next(iter(config))
