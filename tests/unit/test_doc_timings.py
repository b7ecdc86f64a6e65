"""Every timing the README and the docs state sits next to the measurement it came from.

A timing is a number, or a range of numbers, followed by a unit of time (:data:`TIMING`:
``0.43 s``, ``34-61 ms``, ``24 to 27 s``, ``2 min``, ``17 minutes``). The test reads the prose of
``README.md`` and of every page of ``mkdocs.yml``'s ``nav``: everything outside fenced code blocks,
with inline code spans (literal text, such as a log line) removed, plus the ``# needs:`` comments
of ``bash`` blocks (the reader sees them, and they may promise a duration).

Each timing needs one of two things:

1. **A marker in its paragraph** (a run of non-blank lines; a table is one paragraph):
   ``<!-- measured: PATH "Section" -->`` in prose, ``(measured: PATH "Section")`` in a ``# needs:``
   comment; ``set in: PATH`` instead of ``measured: PATH`` for a constant of the code (the file
   that sets it). ``PATH`` is a file of the repository; ``"Section"`` (optional) names a Markdown
   heading of it (its text contains Section), and the section runs to the next heading of the
   same or a higher level. Every number of every timing of the paragraph must appear in one of
   its markers' sections (as a number: ``47`` does not match ``470`` or ``4.7``; ``10`` matches
   ``10.0``). Write the figure as the source has it (``26.9 ms``, not ``27 ms``): a rounded one
   is not found. So a changed measurement shows up here as a doc to update.
2. **Or a setting**: the line that holds it names one, with an inline code span (`` `drain_timeout_sec` ``)
   or the word "default", and does not say "measured". Defaults, flags and constants of the code
   are values the reader may set or rely on, not measurements.

Otherwise the test fails: write the measurement down (``benchmarks/RESULTS.md``, "Documented
timings", says how each was taken) and mark the claim, or drop the number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

_NUMBER = r"\d+(?:\.\d+)?"
#: A number or a range (``34-61``, ``24 to 27``) and a unit of time.
TIMING = re.compile(rf"(?<![\w.,])({_NUMBER}(?:\s*(?:-|to)\s*{_NUMBER})?)\s*"
                    r"(ms|µs|s|seconds?|min|minutes?|h|hours?)\b")
MARKER = re.compile(r"(?:measured|set in):\s*(\S+?)(?:\s+\"([^\"]+)\")?\s*(?:-->|\))")
CODE_SPAN = re.compile(r"`[^`\n]*`")
NEEDS = re.compile(r"#\s*needs:.*$")
HEADING = re.compile(r"^(#+)\s+(.*)$")


@dataclass
class Paragraph:
    page: str
    line: int  #: its first line
    lines: list[str]

    def where(self, index: int = 0) -> str:
        return f"{self.page}:{self.line + index}"


def nav_pages() -> list[Path]:
    """The docs pages of ``mkdocs.yml``'s ``nav``, nested sections too."""
    pages: list[Path] = []

    def walk(entry: object) -> None:
        if isinstance(entry, dict):
            for value in entry.values():
                walk(value)
        elif isinstance(entry, list):
            for item in entry:
                walk(item)
        elif isinstance(entry, str):
            pages.append(DOCS / entry)

    walk(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    return pages


def paragraphs(text: str, page: str) -> list[Paragraph]:
    """The prose paragraphs of ``text`` and, each as a paragraph of its own, its ``# needs:`` comments."""
    found: list[Paragraph] = []
    current: Paragraph | None = None
    fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence, current = not fence, None
            continue
        if fence:
            needs = NEEDS.search(line)
            if needs:
                found.append(Paragraph(page, number, [needs[0]]))
            continue
        if not line.strip():
            current = None
            continue
        if current is None:
            current = Paragraph(page, number, [])
            found.append(current)
        current.lines.append(line)
    return found


def section(path: Path, title: str | None) -> str:
    """The text of ``path``, or of its heading whose text contains ``title`` up to the next heading
    of the same or a higher level ("" when there is no such heading)."""
    text = path.read_text()
    if title is None:
        return text
    lines = text.splitlines()
    headings: list[tuple[int, int, str]] = []  # (line index, level, text), outside fenced code
    fence = False
    for index, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence and (heading := HEADING.match(line)):
            headings.append((index, len(heading[1]), heading[2]))
    for n, (start, level, heading_text) in enumerate(headings):
        if title in heading_text:
            end = next((i for i, lv, _ in headings[n + 1:] if lv <= level), len(lines))
            return "\n".join(lines[start:end])
    return ""


def has_number(text: str, number: str) -> bool:
    """Whether ``number`` is in ``text`` as a number (``10`` matches ``10.0``, not ``100`` or ``10.5``)."""
    return re.search(rf"(?<![\d.]){re.escape(number)}(?:\.0+)?(?!\d|\.\d)", text) is not None


def names_setting(line: str) -> bool:
    return (CODE_SPAN.search(line) is not None or re.search(r"\bdefaults?\b", line) is not None) \
        and "measured" not in line


def problems(paragraph: Paragraph) -> list[str]:
    """What is wrong with the timings of one paragraph (an empty list: nothing)."""
    where = paragraph.where()
    sources = []
    for marker in MARKER.finditer("\n".join(paragraph.lines)):
        path = ROOT / marker[1]
        if not path.is_file():
            return [f"{where}: the marker names {marker[1]}, which does not exist"]
        text = section(path, marker[2])
        if not text:
            return [f"{where}: {marker[1]} has no heading containing {marker[2]!r}"]
        sources.append(text)
    found = []
    for index, line in enumerate(paragraph.lines):
        where = paragraph.where(index)
        prose = CODE_SPAN.sub("", line)
        for timing in TIMING.finditer(prose):
            if sources:
                missing = [n for n in re.findall(_NUMBER, timing[1]) if not any(has_number(s, n) for s in sources)]
                if missing:
                    found.append(f"{where}: {timing[0]!r}: {', '.join(missing)} is not in its marker's source")
            elif not names_setting(line):
                found.append(f"{where}: {timing[0]!r} has no marker and names no setting:\n    {line.strip()}")
    return found


def test_timing_pattern_finds_numbers_with_time_units():
    found = [m[0] for m in TIMING.finditer("in 0.43 s, 34-61 ms, 24 to 27 s, 2 min 47 s, 17 minutes; "
                                            "118 tokens/s, 8 streams, 1.5x, 64 KiB, 2 steps, v2.0 s")]
    assert found == ["0.43 s", "34-61 ms", "24 to 27 s", "2 min", "47 s", "17 minutes"]


def test_markers_are_checked_against_their_section():
    page = "a page"
    ok = Paragraph(page, 1, ["It took 3 min 14 s <!-- measured: benchmarks/RESULTS.md \"Documented timings\" -->"])
    assert problems(ok) == []
    wrong = Paragraph(page, 1, ["It took 9999 s <!-- measured: benchmarks/RESULTS.md \"Documented timings\" -->"])
    assert "9999 is not in its marker's source" in problems(wrong)[0]
    assert "does not exist" in problems(Paragraph(page, 1, ["1 s <!-- measured: no/such.md -->"]))[0]
    assert problems(Paragraph(page, 1, ["`drain_timeout_sec` (30 s)", "the default is 5 minutes"])) == []
    assert problems(Paragraph(page, 1, ["it takes 20 s"])) != []
    assert problems(Paragraph(page, 1, ["`x` took 20 s, measured"])) != []
    needs = paragraphs("```bash\nx   # needs: 17 minutes (measured: README.md)\n```\n", page)
    assert [p.lines for p in needs] == [["# needs: 17 minutes (measured: README.md)"]]


def test_every_documented_timing_names_its_measurement():
    found = []
    for path in [ROOT / "README.md", *nav_pages()]:
        for paragraph in paragraphs(path.read_text(), str(path.relative_to(ROOT))):
            found += problems(paragraph)
    assert found == [], "timings without their measurement (see this test's docstring):\n" + "\n".join(found)
