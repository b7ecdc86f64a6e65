"""Symbolic links in the model store are followed; names given over the API stay confined to it.

TorchServe follows links in its model store (its test harness fills the store with them, and
Kubernetes volume mounts present files as links). A link is placed by whoever can write the
store; a name given over the API (RegisterModel's ``url``, ``--models``) may not leave it.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from conftest import ServerProcess, build_dir, wait_for


@pytest.fixture(scope="module")
def linked(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    """A store holding only links to archives elsewhere (a .mar, a .tar.gz, a no-archive directory,
    and a ConfigMap-style ``..data`` indirection), and a server started on it."""
    root = tmp_path_factory.mktemp("links")
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(store / "echo.mar", elsewhere / "echo.mar")
    shutil.copy(store / "echo_tgz.tar.gz", elsewhere / "echo_tgz.tar.gz")
    build_dir(elsewhere, "echo_dir", "echo_handler.py", model_name="echo_dir")
    linked_store = root / "store"
    linked_store.mkdir()
    (linked_store / "linked.mar").symlink_to(elsewhere / "echo.mar")
    (linked_store / "linked_tgz.tar.gz").symlink_to(elsewhere / "echo_tgz.tar.gz")
    (linked_store / "linked_dir").symlink_to(elsewhere / "echo_dir", target_is_directory=True)
    # what a Kubernetes ConfigMap / projected volume looks like: file -> ..data/file, ..data -> ..<stamp>/
    stamp = elsewhere / "..2025_01_01_00_00_00.000000000"
    stamp.mkdir()
    shutil.copy(store / "echo.mar", stamp / "mounted.mar")
    (linked_store / "..data").symlink_to(stamp, target_is_directory=True)
    (linked_store / "mounted.mar").symlink_to("..data/mounted.mar")
    srv = ServerProcess(root / "work", linked_store,
                        ["--enable-model-api", "--workers-per-model", "1", "--models", "linked=linked.mar",
                         "mounted=mounted.mar", "escaped=../elsewhere/echo.mar"])
    try:
        yield srv, elsewhere
    finally:
        code = srv.stop()
        assert code == 0, srv.log()


def _refusal(srv: ServerProcess, url: str) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        srv.register(url, model_name="nope", initial_workers=0)
    return err.value.code(), err.value.details() or ""


def test_startup_archives_linked_into_the_store_are_served(linked):
    srv, _ = linked
    srv.wait_workers("linked", 1, timeout=60)
    srv.wait_workers("mounted", 1, timeout=60)
    assert srv.predict("linked", "through a link") == b"through a link"
    assert srv.predict("mounted", "through ..data") == b"through ..data"
    assert srv.describe("linked")[0]["modelUrl"] == "linked.mar"


def test_registered_links_to_a_tgz_and_a_directory_are_served(linked):
    srv, _ = linked
    srv.register("linked_tgz.tar.gz", model_name="tgz")
    srv.register("linked_dir", model_name="dir")
    assert srv.predict("tgz", "tgz link") == b"tgz link"
    assert srv.predict("dir", "dir link") == b"dir link"
    srv.unregister("tgz")
    srv.unregister("dir")


def test_api_names_stay_confined_to_the_store(linked):
    srv, elsewhere = linked
    for url in ["../elsewhere/echo.mar", "linked_dir/../../elsewhere/echo.mar", f"file://{srv.store}/../x.mar",
                f"file://{srv.store}/%2e%2e/elsewhere/echo.mar"]:
        code, details = _refusal(srv, url)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (url, code, details)
        assert details.startswith(f"Relative path is not allowed in url: {url}"), (url, details)
    for url in [str(elsewhere / "echo.mar"), f"file://{elsewhere}/echo.mar", "/etc/passwd"]:
        code, details = _refusal(srv, url)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "outside the model store" in details, (url, details)
    # the same name given at startup (--models) was refused too, with the cause in the log
    wait_for(lambda: "Relative path is not allowed in url: ../elsewhere/echo.mar" in srv.log(), 30,
             what="the refused startup model logged")
    with pytest.raises(grpc.RpcError) as err:
        srv.describe("escaped")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
