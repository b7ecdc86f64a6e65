"""``python -m inference_service.launch.fetch_models`` (the Kubernetes initContainer's command): archives
from URLs that ``allowed_urls`` allows land in the model store under their names; anything else
fails the command and leaves the store as it was."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import build_mar
from inference_service.launch.fetch_models import FetchError, archive_name


class _Repository:
    """A local HTTP server serving a directory; counts the requests it got."""

    def __init__(self, root: Path) -> None:
        self.requests: list[str] = []
        repository = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(root), **kwargs)

            def log_message(self, format, *args):  # noqa: A002 (the base class's name)
                repository.requests.append(self.path)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


@pytest.fixture
def repository(tmp_path: Path) -> Iterator[_Repository]:
    """A repository serving ``/releases/echo.mar`` (an archive) and ``/releases/page.mar`` (HTML)."""
    root = tmp_path / "repository" / "releases"
    root.mkdir(parents=True)
    build_mar(root, "echo", "echo_handler.py")
    (root / "page.mar").write_text("<html>not an archive</html>")
    served = _Repository(tmp_path / "repository")
    try:
        yield served
    finally:
        served.close()


def _config(tmp_path: Path, repository: _Repository, store: Path | None = None) -> Path:
    host = repository.url.replace(".", "\\\\.")
    lines = [f"allowed_urls={host}/releases/[^/]+"]
    if store is not None:
        lines.append(f"model_store={store}")
    path = tmp_path / "config.properties"
    path.write_text("\n".join(lines) + "\n")
    return path


def _fetch(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inference_service.launch.fetch_models", *map(str, args)],
                          capture_output=True, text=True, timeout=60, check=False)


def test_allowed_archives_land_in_the_store_under_their_names(tmp_path, repository):
    store = tmp_path / "store"
    config = _config(tmp_path, repository, store)
    url = f"{repository.url}/releases/echo.mar"
    proc = _fetch("--ts-config", config, url, f"renamed.mar={url}")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in store.iterdir()) == ["echo.mar", "renamed.mar"]
    original = (tmp_path / "repository" / "releases" / "echo.mar").read_bytes()
    for name in ("echo.mar", "renamed.mar"):
        assert (store / name).read_bytes() == original
        assert (store / name).stat().st_mode & 0o777 == 0o644
    assert f"fetched {url} -> {store / 'echo.mar'}" in proc.stdout
    # fetched again (a restarted initContainer): replaced in place
    again = _fetch("--ts-config", config, "--model-store", store, url)
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in store.iterdir()) == ["echo.mar", "renamed.mar"]


@pytest.mark.parametrize("path, message", [
    ("http://127.0.0.1:9/releases/echo.mar", "does not match any allowed URL"),  # another host
    ("{url}/other/echo.mar", "does not match any allowed URL"),
    ("{url}/releases/missing.mar", "404"),
    ("{url}/releases/page.mar", "neither a zip (.mar) nor a tar archive"),
    ("{url}/releases/%2e%2e/echo.mar", "Relative path is not allowed"),
    ("{url}/releases/echo.bin", "must be a plain file name ending in .mar, .tar.gz, .tgz"),
    (".hidden.mar={url}/releases/echo.mar", "must be a plain file name"),
])
def test_refused_or_failed_fetches_leave_the_store_as_it_was(tmp_path, repository, path, message):
    store = tmp_path / "store"
    store.mkdir()
    (store / "kept.mar").write_bytes(b"already there")
    proc = _fetch("--ts-config", _config(tmp_path, repository), "--model-store", store,
                  path.format(url=repository.url))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert sorted(p.name for p in store.iterdir()) == ["kept.mar"]
    if "404" not in message and "archive" not in message:
        assert repository.requests == []  # refused before anything was fetched


def test_usage_and_config_errors_exit_2(tmp_path, repository):
    url = f"{repository.url}/releases/echo.mar"
    no_store = _fetch("--ts-config", _config(tmp_path, repository), url)
    assert no_store.returncode == 2 and "no model store" in no_store.stderr
    bad = tmp_path / "bad.properties"
    bad.write_text("allowed_urls=(unclosed\n")
    assert _fetch("--ts-config", bad, "--model-store", tmp_path / "s", url).returncode == 2
    assert _fetch("--ts-config", tmp_path / "missing.properties", "--model-store", tmp_path / "s",
                  url).returncode == 2
    assert _fetch("--ts-config", bad).returncode == 2  # no URL: argparse's usage error


def test_archive_names():
    assert archive_name("http://h/r/echo.mar") == ("echo.mar", "http://h/r/echo.mar")
    assert archive_name("m.tar.gz=http://h/x?a=b") == ("m.tar.gz", "http://h/x?a=b")
    assert archive_name("http://h/r/m%2Dv1.tgz?sig=a=b") == ("m-v1.tgz", "http://h/r/m%2Dv1.tgz?sig=a=b")
    for spec in ("http://h/r/", "http://h/r/a.zip", "http://h/r/my%20model.mar", "../x.mar=http://h/x.mar",
                 "a/b.mar=http://h/x", "http://h/r/%2e%2e%2fx.mar"):
        with pytest.raises(FetchError):
            archive_name(spec)
