"""Bad archives are refused with a clear status; nothing escapes the extraction directory."""

from __future__ import annotations

import json
import stat
import time
import zipfile
from pathlib import Path

import grpc
import pytest

from conftest import HANDLERS, ServerProcess


def _manifest(handler: str = "h.py") -> bytes:
    return json.dumps({"runtime": "python", "model": {"modelName": "bad", "handler": handler,
                                                      "modelVersion": "1.0"}}).encode()


def _zip(path: Path, members: dict[str, bytes], link: str | None = None) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        if link:
            info = zipfile.ZipInfo(link)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, "/etc/passwd")


@pytest.fixture(scope="module")
def bad_store(tmp_path_factory):
    store = tmp_path_factory.mktemp("bad_store")
    (store / "notzip.mar").write_bytes(b"this is not an archive")
    _zip(store / "nomanifest.mar", {"h.py": b""})
    _zip(store / "nohandler.mar", {"MAR-INF/MANIFEST.json": _manifest("missing_handler.py")})
    _zip(store / "importfail.mar", {"MAR-INF/MANIFEST.json": _manifest(),
                                    "h.py": b"import module_that_does_not_exist\n"})
    _zip(store / "syntax.mar", {"MAR-INF/MANIFEST.json": _manifest(), "h.py": b"def broken(:\n"})
    _zip(store / "twoclasses.mar", {"MAR-INF/MANIFEST.json": _manifest(), "h.py": b"class A: pass\nclass B: pass\n"})
    _zip(store / "slip.mar", {"MAR-INF/MANIFEST.json": _manifest(), "../../escaped.py": b"x"})
    _zip(store / "abs.mar", {"MAR-INF/MANIFEST.json": _manifest(), "/tmp/escaped_abs.py": b"x"})
    _zip(store / "link.mar", {"MAR-INF/MANIFEST.json": _manifest()}, link="h.py")
    _zip(store / "big.mar", {"MAR-INF/MANIFEST.json": _manifest(), "weights.bin": b"0" * 200_000})
    return store


@pytest.fixture(scope="module")
def bsrv(bad_store, store, tmp_path_factory):
    config = tmp_path_factory.mktemp("cfg") / "config.properties"
    config.write_text("max_archive_size=100000\n")
    import shutil

    shutil.copy(store / "echo.mar", bad_store / "echo.mar")
    srv = ServerProcess(tmp_path_factory.mktemp("bad"), bad_store,
                        ["--ts-config", str(config), "--enable-model-api", "--models", "echo=echo.mar",
                         "--workers-per-model", "1"])
    srv.wait_workers("echo", 1)
    yield srv
    assert srv.stop() == 0


@pytest.mark.parametrize("url,code,fragment", [
    ("notzip.mar", grpc.StatusCode.INVALID_ARGUMENT, "not a model archive"),
    ("nomanifest.mar", grpc.StatusCode.INVALID_ARGUMENT, "MANIFEST"),
    ("nohandler.mar", grpc.StatusCode.INTERNAL, "missing_handler"),
    ("importfail.mar", grpc.StatusCode.INTERNAL, "module_that_does_not_exist"),
    ("syntax.mar", grpc.StatusCode.INTERNAL, "SyntaxError"),
    ("twoclasses.mar", grpc.StatusCode.INTERNAL, "exactly one class"),
    ("slip.mar", grpc.StatusCode.INVALID_ARGUMENT, "outside the archive"),
    ("abs.mar", grpc.StatusCode.INVALID_ARGUMENT, "outside the archive"),
    ("link.mar", grpc.StatusCode.INVALID_ARGUMENT, "symbolic link"),
    ("big.mar", grpc.StatusCode.INVALID_ARGUMENT, "100000-byte limit"),
])
def test_bad_archive_refused(bsrv, bad_store, url, code, fragment):
    with pytest.raises(grpc.RpcError) as err:
        bsrv.register(url)
    assert err.value.code() == code
    assert fragment in err.value.details()
    assert not (bad_store.parent / "escaped.py").exists() and not Path("/tmp/escaped_abs.py").exists()
    assert bsrv.predict("echo", "still serving") == b"still serving"
    # nothing of the failed registration is left in the extraction directory
    leftovers = [p for p in (bsrv.workdir / ".inference_service").glob("models-*/*") if p.name.startswith("bad")
                 or p.name.startswith(url.split(".")[0])]
    assert leftovers == []


def _laughs(levels: int) -> str:
    """A "billion laughs" YAML: ``levels`` anchors of ten aliases each, 10**levels scalars once expanded."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _echo_zip(path: Path, config_yaml: str) -> None:
    """A zip archive of the echo handler whose manifest names ``model-config.yaml`` = ``config_yaml``."""
    manifest = {"runtime": "python", "model": {"modelName": path.stem, "handler": "echo_handler.py",
                                               "modelVersion": "1.0", "configFile": "model-config.yaml"}}
    _zip(path, {"MAR-INF/MANIFEST.json": json.dumps(manifest).encode(),
                "echo_handler.py": (HANDLERS / "echo_handler.py").read_bytes(),
                "model-config.yaml": config_yaml.encode()})


def test_yaml_alias_bomb_is_refused_quickly_and_the_server_keeps_serving(bsrv, bad_store):
    bomb = _laughs(6)  # 10**6 scalars from a few hundred bytes
    assert len(bomb) < 400
    _echo_zip(bad_store / "laughs.mar", bomb)
    _echo_zip(bad_store / "recursive.mar", "minWorkers: 1\nloop: &loop [1, *loop]\n")
    _echo_zip(bad_store / "anchors.mar", "defaults: &d {topk: 3}\nhandler: *d\nminWorkers: 1\n")
    for url, fragment in [("laughs.mar", "more than 100000 YAML nodes"), ("recursive.mar", "recursive")]:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            bsrv.register(url, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "model config file 'model-config.yaml'" in err.value.details()
        assert fragment in err.value.details()
        assert time.monotonic() - start < 5
        assert bsrv.predict("echo", "still serving") == b"still serving"
        assert not list((bsrv.workdir / ".inference_service").glob(f"models-*/{url.split('.')[0]}-*"))
    # anchors and aliases within the budget still work
    bsrv.register("anchors.mar", initial_workers=1)
    assert bsrv.predict("anchors", "anchored") == b"anchored"
    bsrv.unregister("anchors")
