"""Every command of the README and of the docs site runs as written, in a fresh working directory.

The ```` ```bash ```` blocks of the README, then of each page of ``docs/`` in the order of
``mkdocs.yml``'s ``nav`` (a page may use what an earlier one set up), are run in order, as a
reader following them would, by one
``bash`` in a fresh copy of the repository's tracked files (the installed ``.venv/`` and
``clients/node/node_modules`` are linked in, ``$HOME`` and its model cache are the user's). The
commands run inside a network namespace of their own (``unshare -rn``, loopback only): the
default ports (7070, 7071, 8080, 8082) are free there whatever else runs on the machine, and
nothing can reach the network, so a command that silently needs it fails here. Servers the
commands start are real servers (``.venv/bin/inference-service --start``); the one still
running at the end is stopped.

Skip rule: a block is skipped only when it carries a ``# needs: <what>`` comment, which the
page shows to its reader: blocks that need a cluster, TLS material, TorchServe, external
tools or the network, placeholders to fill in, or minutes of their own (``scripts/test``).
At most :data:`MAX_SKIPPED` blocks may be skipped.

Checks: every command exits 0 (the run stops at the first that does not, and the failure shows
its output and the server log). Each LLM example (a request to ``smollm2``) must return
non-empty text whose last message states why it ended (``"finish_reason"`` ``"stop"``: end of
sequence, or ``"length"``: the token limit; the examples ask for it with ``"include_usage":
true``); ``scripts/demo`` must print a non-empty answer (it does not ask for the reason).

Loads the real SmolLM2 model (marked ``llm``); a few minutes on 2 cores (82 commands, several
server starts with the LLM), bounded by :data:`RUN_TIMEOUT_S`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, _alive

pytestmark = [pytest.mark.llm, pytest.mark.slow]

README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: Most blocks the README and the docs may mark ``# needs:`` (and so skip here).
MAX_SKIPPED = 9  # the ninth: a GGUF of the reader's own (docs/llm.md, "A GGUF of your own")
#: Wall-clock bound of the whole run (s).
RUN_TIMEOUT_S = 900
NEEDS = re.compile(r"#\s*needs:\s*(.+)$", re.M)
HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")
FINISH_REASONS = ("stop", "length")


@dataclass
class Block:
    """One ```` ```bash ```` block of the README or of a docs page."""

    line: int  #: line of its opening fence
    body: str
    needs: str | None  #: why it is skipped (its ``# needs:`` comment), or None: it runs
    page: str = "README.md"  #: the file it is in, relative to the repository root


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    """The ```` ```bash ```` blocks of ``text`` (the file ``page``), in order."""
    blocks = []
    for match in re.finditer(r"^```bash\n(.*?)^```", text, re.S | re.M):
        needs = NEEDS.search(match[1])
        blocks.append(Block(text[:match.start()].count("\n") + 1, match[1], needs[1].strip() if needs else None,
                            page))
    return blocks


def nav_pages() -> list[Path]:
    """The docs pages in the order of ``mkdocs.yml``'s ``nav`` (entries ``{title: page}``, nested sections too)."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages: list[Path] = []

    def walk(entries: list[object]) -> None:
        for entry in entries:
            if isinstance(entry, dict):
                for value in entry.values():
                    walk(value if isinstance(value, list) else [value])
            elif isinstance(entry, str):
                pages.append(DOCS / entry)

    walk(config["nav"])
    return pages


def all_blocks() -> list[Block]:
    """The README's blocks, then each docs page's, in the order a reader follows them."""
    blocks = readme_blocks(README.read_text())
    for page in nav_pages():
        blocks += readme_blocks(page.read_text(), str(page.relative_to(ROOT)))
    return blocks


def split_commands(body: str) -> list[str]:
    """The shell commands of a block: a line with its ``\\`` continuations, or a heredoc with its body.

    Blank lines and comment lines are dropped.
    """
    lines = body.splitlines()
    commands = []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        command = [line]
        while command[-1].rstrip().endswith("\\") and i < len(lines):
            command.append(lines[i])
            i += 1
        heredoc = HEREDOC.search(command[0])
        if heredoc:
            while i < len(lines):
                command.append(lines[i])
                i += 1
                if command[-1].strip() == heredoc[2]:
                    break
        commands.append("\n".join(command))
    return commands


def build_script(commands: list[str], stderr_dir: Path) -> str:
    """One bash script running ``commands`` in order, stopping at the first that fails; a server
    left running is stopped on exit.

    Each command's stdout goes between ``@@begin i`` / ``@@end i <rc> <start> <end>`` markers,
    its stderr to ``stderr_dir/<i>`` (curl's progress meter, for one, is no part of an answer).
    """
    parts = ["set -o pipefail", "trap '.venv/bin/inference-service --stop >/dev/null 2>&1 || true' EXIT"]
    for i, command in enumerate(commands):
        stderr = shlex.quote(str(stderr_dir / str(i)))
        parts += [f"echo '@@begin {i}'; __t=$EPOCHREALTIME", "{", command, f"}} 2>{stderr}",
                  f"__rc=$?; echo; echo \"@@end {i} $__rc $__t $EPOCHREALTIME\"; [ \"$__rc\" = 0 ] || exit \"$__rc\""]
    return "\n".join(parts) + "\n"


def outputs(log: str) -> dict[int, tuple[str, int | None]]:
    """``{command index: (output, exit status or None if it did not end)}`` from the run's output."""
    found: dict[int, tuple[str, int | None]] = {}
    for match in re.finditer(r"^@@begin (\d+)\n(.*?)(?:^@@end \1 (\d+) [^\n]*$|\Z)", log, re.S | re.M):
        found[int(match[1])] = (match[2], int(match[3]) if match[3] is not None else None)
    return found


def stream_text(output: str) -> str:
    """What a streamed answer printed, with ``--jsonl`` lines (``{"index", "prediction"}``) joined."""
    pieces = []
    for line in output.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            return output
        if not isinstance(record, dict) or "prediction" not in record:
            return output
        pieces.append(record["prediction"])
    return "".join(pieces)


def llm_answer(output: str, errors: str = "") -> tuple[str, str]:
    """``(text, finish_reason)`` of a streamed LLM answer: its last message is the
    ``include_usage`` JSON object (``{"text", "finish_reason", "usage"}``), or, for the bundled
    client, which prints clean text, ``errors`` (its stderr) holds ``finish_reason: <reason>``."""
    text = stream_text(output).strip()
    start = text.rfind('{"text"')
    if start < 0:
        found = re.search(r"finish_reason: (\w+)", errors)
        assert found, f"no final {{\"text\", \"finish_reason\"}} message in:\n{output}\n--- stderr:\n{errors}"
        return text, found.group(1)
    final, _ = json.JSONDecoder().raw_decode(text[start:])
    return (text[:start] + final["text"]).strip(), final["finish_reason"]


def is_llm_request(command: str) -> bool:
    """Whether ``command`` sends a request to the bundled LLM (not a health check or a start, nor a
    Python program of the docs, which prints what it shows)."""
    return ("smollm2" in command and "--start" not in command and " health " not in command
            and "python - <<" not in command
            and any(word in command for word in (" stream ", "/predictions/", "infer_stream")))


def _fresh_workdir(target: Path) -> Path:
    """A copy of the repository's tracked files, with the installed .venv and node packages linked in."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in tracked.decode().split("\0"):
        source = ROOT / name
        if name and source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    (target / ".venv").symlink_to(ROOT / ".venv", target_is_directory=True)
    node_modules = ROOT / "clients" / "node" / "node_modules"
    if node_modules.is_dir():
        (target / "clients" / "node" / "node_modules").symlink_to(node_modules, target_is_directory=True)
    return target


def _own_processes(workdir: Path) -> list[int]:
    """Processes running in ``workdir`` (started by the README's commands)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if Path(os.readlink(proc / "cwd")).is_relative_to(workdir):
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def _netns_usable() -> bool:
    try:
        return subprocess.run(["unshare", "-rn", "ip", "link", "set", "lo", "up"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_readme_blocks_are_split_into_commands():
    body = "a \\\n  b\n# comment\n\ncat > f <<'EOF'\nx\nEOF\nc   # trailing\n"
    assert split_commands(body) == ["a \\\n  b", "cat > f <<'EOF'\nx\nEOF", "c   # trailing"]
    assert llm_answer('{"index":0,"prediction":"Par"}\n{"index":1,"prediction":"{\\"text\\": \\"is\\", '
                      '\\"finish_reason\\": \\"stop\\"}"}') == ("Paris", "stop")
    assert llm_answer('Paris.{"text": "", "finish_reason": "length", "usage": {}}\n\n') == ("Paris.", "length")
    assert llm_answer("The capital is Paris.\n", "finish_reason: stop, prompt_tokens: 9, completion_tokens: 5\n") \
        == ("The capital is Paris.", "stop")
    assert llm_answer('{"index":0,"prediction":"Hi"}\n\n{"index":1,"prediction":"{\\"text\\": \\"\\", '
                      '\\"finish_reason\\": \\"stop\\"}"}\n\n') == ("Hi", "stop")


def test_every_docs_page_is_in_the_nav():
    # a page left out of mkdocs.yml's nav would be published without its commands ever running
    published = {p for p in DOCS.rglob("*.md") if "_incoming" not in p.relative_to(DOCS).parts}
    listed = nav_pages()
    assert sorted(published - set(listed)) == [], "docs pages missing from mkdocs.yml's nav"
    assert [p for p in listed if not p.is_file()] == [], "mkdocs.yml's nav names pages that do not exist"
    assert len(listed) == len(set(listed)), "a page is listed twice in mkdocs.yml's nav"


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_readme_commands_run_as_written(tmp_path):
    # the README's default ports must be free: its commands run in a network namespace of their own
    assert shutil.which("unshare") and shutil.which("ip") and _netns_usable(), (
        "needs a network namespace of its own (unshare -rn and ip; scripts/install --dev installs them)")
    blocks = all_blocks()
    skipped = [(b.page, b.line, b.needs) for b in blocks if b.needs]
    assert len(skipped) <= MAX_SKIPPED, f"too many blocks marked '# needs:': {skipped}"
    commands = [(f"{b.page}:{b.line}", c) for b in blocks if not b.needs for c in split_commands(b.body)]
    # the copy links this checkout's .venv/: bring it up to date here, where an install belongs (in
    # the copy, scripts/install refuses a linked .venv/ that is not up to date)
    install = subprocess.run([str(ROOT / "scripts" / "install"), "--dev"], cwd=ROOT, capture_output=True,
                             text=True, timeout=1800, check=False)
    assert install.returncode == 0, f"scripts/install --dev failed:\n{install.stdout}\n{install.stderr}"
    workdir = _fresh_workdir(tmp_path / "clone")
    script = tmp_path / "readme.sh"
    stderr_dir = tmp_path / "stderr"
    stderr_dir.mkdir()
    script.write_text(build_script([c for _, c in commands], stderr_dir))
    runner = f"ip link set lo up && cd {shlex.quote(str(workdir))} && exec bash {shlex.quote(str(script))}"
    try:
        proc = subprocess.run(["unshare", "-rn", "bash", "-c", runner], capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S, check=False)
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        log = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        log += f"\n(the run took more than {RUN_TIMEOUT_S} s)"
    finally:
        for pid in _own_processes(workdir):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    (tmp_path / "readme-run.log").write_text(log)
    results = outputs(log)
    server_log = workdir / "logs" / "inference_service.log"
    for i, (line, command) in enumerate(commands):
        output, rc = results.get(i, ("", None))
        errors = (stderr_dir / str(i)).read_text(errors="replace") if (stderr_dir / str(i)).exists() else ""
        assert rc == 0, (
            f"block at {line}: command failed (exit {rc}):\n{command}\n--- output:\n{output[-3000:]}"
            f"\n--- stderr:\n{errors[-3000:]}"
            + (f"\n--- server log:\n{server_log.read_text(errors='replace')[-3000:]}" if server_log.exists() else "")
            + ("\n(scripts/install needs the network unless .venv/ is up to date: run scripts/install first)"
               if command.startswith("scripts/install") else "")
            + (f"\n--- the run's output ended with:\n{log[-2000:]}" if rc is None else ""))
        if command.startswith("scripts/demo"):
            answer = output.split("== answer (streamed):", 1)[-1].split("==", 1)[0].strip()
            assert answer, f"scripts/demo printed no answer:\n{output}"
        elif is_llm_request(command):
            text, reason = llm_answer(output, errors)
            assert text, f"{line}: the LLM answered nothing:\n{command}\n{output}"
            assert reason in FINISH_REASONS, f"{line}: finish_reason {reason!r}:\n{output}"
    assert len(results) == len(commands)
