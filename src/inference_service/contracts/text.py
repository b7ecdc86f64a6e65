"""Text a tokenizer can take. A Python string may hold a lone surrogate (U+D800 to U+DFFF:
``json.loads`` reads a ``"\\ud800"`` escape into one) that UTF-8 cannot encode and tokenizers raise
on. The handlers check a request's text with :func:`lone_surrogate` before batching it, so such a
request is refused alone (400) and its batch-mates are served."""

from __future__ import annotations

from typing import Any


def lone_surrogate(value: Any, path: str = "") -> tuple[str, int] | None:
    """Where the first lone surrogate of ``value`` is: the path of its string (``messages[0].content``,
    ``path`` for ``value`` itself, dict keys included) and its character index; ``None`` if there is
    none. ``value`` is a string, or dicts and lists of values (anything else is skipped)."""
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as exc:
                    return where, exc.start
        elif isinstance(item, dict):
            for key, sub in reversed(list(item.items())):
                inner = f"{where}.{key}" if where else str(key)
                stack += [(inner, sub), (f"{inner} (the key)", key)]
        elif isinstance(item, list):
            stack += [(f"{where}[{i}]", sub) for i, sub in reversed(list(enumerate(item)))]
    return None


def lone_surrogate_message(where: str | None, index: int) -> str:
    """The refusal of a lone surrogate found by :func:`lone_surrogate` (``where``: ``None`` when the
    error names the field already)."""
    return (f"{f'{where!r} is ' if where else ''}not valid text: a lone surrogate (U+D800 to U+DFFF) at "
            f"character {index}, which UTF-8 cannot encode; send valid Unicode text")
