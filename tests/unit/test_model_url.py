"""Unit tests of the url text checks shared by the model store lookup and remote downloads."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference_service.archive.model_archive import UrlPolicy, resolve_in_store
from inference_service.archive.model_url import refuse_control_characters
from inference_service.errors import InvalidArgument

CONTROL = ["\r\n", "\n", "\r", "\t", "\x00", "\x1b", "\x7f", "\x85"]


@pytest.mark.parametrize("ch", CONTROL)
def test_control_characters_are_refused_everywhere(tmp_path: Path, ch: str):
    (tmp_path / "echo.mar").write_bytes(b"")
    with pytest.raises(InvalidArgument, match="contains control characters") as err:
        refuse_control_characters(f"echo.mar{ch}X: y")
    assert ch not in err.value.message  # shown escaped
    with pytest.raises(InvalidArgument, match="contains control characters"):
        resolve_in_store(f"echo.mar{ch}", tmp_path)
    # urllib.parse drops TAB, CR and LF: the policy must not match a URL other than the one fetched
    # (also for redirect targets, which go through the same check)
    policy = UrlPolicy(allowed_urls=(r"http://host/ok/.*",))
    with pytest.raises(InvalidArgument, match="contains control characters"):
        policy.check(f"http://host/ok/a{ch}b.mar")


def test_percent_encoded_control_characters_in_a_file_url(tmp_path: Path):
    with pytest.raises(InvalidArgument, match="contains control characters once percent-decoded"):
        resolve_in_store(f"file://{tmp_path}/echo.mar%0d%0a", tmp_path)
    UrlPolicy(allowed_urls=(r"http://host/ok/.*",)).check("http://host/ok/a%0Ab.mar")  # encoded: the server's


def test_ordinary_names_pass(tmp_path: Path):
    (tmp_path / "caf\u00e9 model;1.mar").write_bytes(b"")
    refuse_control_characters("caf\u00e9 model;1.mar")
    assert resolve_in_store("caf\u00e9 model;1.mar", tmp_path) == tmp_path / "caf\u00e9 model;1.mar"
