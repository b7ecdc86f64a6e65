"""Unit tests of the budgeted YAML loader for archive configs: same results as ``yaml.safe_load``
within the budget, alias bombs, recursive aliases, deep nesting and oversized files refused."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from inference_service.archive.yaml_budget import MAX_YAML_NODES, load_yaml_budgeted, read_yaml_budgeted
from inference_service.errors import InvalidArgument

SOURCE = "model config file 'model-config.yaml'"


def _laughs(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("text", [
    "",
    "minWorkers: 1\nmaxWorkers: 2\nbatchSize: 4\nhandler:\n  topk: 3\n  labels: [a, b, c]\n",
    "torchrun:\n  nproc-per-node: 2\ndeviceIds: [0, 1]\nparallelType: tp\n",
    "defaults: &d {topk: 3, threshold: 0.5}\nhandler: *d\n",
    "base: &b {x: 1, y: 2}\nhandler:\n  <<: *b\n  y: 3\n",  # merge keys
    "- &m ModelName\n- [*m, *m]\n",
    "just a string\n",
    _laughs(4),  # 10**4 scalars: within the budget
])
def test_same_result_as_safe_load_within_the_budget(text):
    assert load_yaml_budgeted(text, SOURCE) == yaml.safe_load(text)


def test_billion_laughs_is_refused_quickly():
    start = time.monotonic()
    with pytest.raises(InvalidArgument) as err:
        load_yaml_budgeted(_laughs(9), SOURCE)  # 10**9 scalars once expanded
    assert time.monotonic() - start < 1
    assert err.value.message.startswith(SOURCE)
    assert f"more than {MAX_YAML_NODES} YAML nodes" in err.value.message


def test_the_budget_counts_every_node_with_aliases_expanded():
    items = "[" + ", ".join(["1"] * 99) + "]"  # one sequence of 99 scalars: 100 nodes
    assert len(load_yaml_budgeted(items, SOURCE, max_nodes=100)) == 99
    with pytest.raises(InvalidArgument, match="more than 99 YAML nodes"):
        load_yaml_budgeted(items, SOURCE, max_nodes=99)
    aliased = "a: &a [1, 2, 3]\nb: [*a, *a]\n"  # 4 + (1 + 2 * 4) + 2 keys + the mapping = 16
    assert load_yaml_budgeted(aliased, SOURCE, max_nodes=16) == yaml.safe_load(aliased)
    with pytest.raises(InvalidArgument):
        load_yaml_budgeted(aliased, SOURCE, max_nodes=15)
    merges = "base: &b {" + ", ".join(f"k{i}: {i}" for i in range(1000)) + "}\n"
    merges += "".join(f"m{i}: {{<<: *b}}\n" for i in range(120))  # 120 merged copies of 2,000 nodes
    with pytest.raises(InvalidArgument, match="YAML nodes"):
        load_yaml_budgeted(merges, SOURCE)


@pytest.mark.parametrize("text", ["loop: &loop [1, *loop]\n", "&m {self: *m}\n"])
def test_recursive_aliases_are_refused(text):
    with pytest.raises(InvalidArgument, match=r"\*(loop|m) is used inside the node it names \(a recursive"):
        load_yaml_budgeted(text, SOURCE)


def test_deep_nesting_is_refused_not_a_crash():
    with pytest.raises(InvalidArgument, match="nested too deeply"):
        load_yaml_budgeted("[" * 5000 + "]" * 5000, SOURCE)


@pytest.mark.parametrize("text,words", [
    ('x: !!python/object/apply:os.system ["true"]\n', "not valid YAML"),
    ("a: [1, 2\n", "not valid YAML"),
    ("a: *nowhere\n", "not valid YAML"),  # an undefined alias stays the parser's own error
    ("a: &x 1\nb: &x 2\n", "not valid YAML"),  # so does a duplicate anchor
])
def test_invalid_yaml_keeps_its_message(text, words):
    with pytest.raises(InvalidArgument, match=words):
        load_yaml_budgeted(text, SOURCE)


def test_read_yaml_budgeted_caps_the_bytes_read(tmp_path: Path):
    path = tmp_path / "model-config.yaml"
    path.write_text("batchSize: 4\n")
    assert read_yaml_budgeted(path, SOURCE) == {"batchSize": 4}
    path.write_text("a: " + "x" * 2000 + "\n")
    with pytest.raises(InvalidArgument, match="larger than the 1000-byte limit"):
        read_yaml_budgeted(path, SOURCE, max_bytes=1000)
    with pytest.raises(InvalidArgument, match="larger than the"):  # endless: only max_bytes + 1 are read
        read_yaml_budgeted(Path("/dev/zero"), SOURCE)
    path.write_bytes(b"a: \xff\xfe\n")
    with pytest.raises(InvalidArgument, match="not valid YAML"):
        read_yaml_budgeted(path, SOURCE)
