"""Handler entry points in TorchServe 0.12's order (``ts/model_loader.py``), against a real server.

``module:function`` first; else a module-level ``handle`` function (called once with
``data=None`` at load); else exactly one class (or the class ``__handler__`` names). The
generator form of this project works for a module-level ``handle`` too.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from conftest import HANDLERS, ServerProcess, build_mar


def _package_dir(store: Path) -> str:
    """A no-archive model whose handler is the dotted module ``forms_pkg.entry`` (a package in the archive)."""
    target = store / "dotted_dir"
    (target / "MAR-INF").mkdir(parents=True)
    (target / "forms_pkg").mkdir()
    (target / "forms_pkg" / "__init__.py").write_text("")
    shutil.copy(HANDLERS / "module_handle_only.py", target / "forms_pkg" / "entry.py")
    (target / "MAR-INF" / "MANIFEST.json").write_text(json.dumps(
        {"runtime": "python", "model": {"modelName": "dotted", "handler": "forms_pkg.entry", "modelVersion": "1.0"}}))
    return "dotted_dir"


@pytest.fixture(scope="module")
def forms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    store = tmp_path_factory.mktemp("forms_store")
    build_mar(store, "documented", "module_entry_point.py")
    build_mar(store, "only", "module_handle_only.py")
    build_mar(store, "named", "module_entry_point:shout")
    build_mar(store, "modgen", "module_generator_handle.py")
    (store / "nothing.py").write_text("def predict(data, context):\n    return data\n")
    build_mar(store, "nothing", str(store / "nothing.py"))
    models = ["documented=documented.mar", "only=only.mar", "named=named.mar", "modgen=modgen.mar",
              f"dotted={_package_dir(store)}"]
    srv = ServerProcess(tmp_path_factory.mktemp("forms_server"), store,
                        ["--enable-model-api", "--workers-per-model", "1", "--models", *models])
    try:
        for name in ("documented", "only", "named", "modgen", "dotted"):
            srv.wait_workers(name, 1, timeout=60)
        yield srv
    finally:
        code = srv.stop()
        assert code == 0, srv.log()


def test_module_level_handle_wins_over_the_class(forms):
    # TorchServe's documented pattern: a class plus a module-level handle(); the function is the
    # entry point, called once with data=None at load (1 load call in this worker)
    assert forms.predict("documented", "abc") == b"module:1:cba"


def test_module_with_only_a_handle_function(forms):
    assert forms.predict("only", "hi") == b"only:1:hi"  # refused before: "exactly one class (found 0)"
    assert forms.predict("dotted", "pkg") == b"only:1:pkg"  # the same through a dotted module


def test_module_function_entry_point_wins_over_handle(forms):
    assert forms.predict("named", "quiet") == b"QUIET"


def test_module_level_generator_handle_streams(forms):
    assert forms.stream("modgen", "a b c") == [b"a ", b"b ", b"c ", b"<loaded=True>"]


def test_module_without_handle_or_class_is_refused_with_the_rule(forms):
    with pytest.raises(grpc.RpcError) as err:
        forms.register("nothing.mar", timeout=60)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "module-level function handle(data, context) or exactly one class (found 0)" in err.value.details()
