"""Error messages are filled in: no ``{placeholder}`` reaches a client unformatted.

Two mistakes of the same class are caught over the whole package, by reading its source:

- a plain string with ``{name}`` passed to an exception constructor (an f-string missing its
  ``f``: the client would read the braces);
- a ``PydanticCustomError`` template whose placeholders pydantic cannot fill: pydantic replaces
  ``{name}`` from the context dict only, so ``{name!r}``, ``{name:>4}`` or a name missing from the
  context reach the client as written (the ``got {kind!r}`` of an OpenAI image content part did).
"""

from __future__ import annotations

import ast
import re
import string
from pathlib import Path

import pytest
from pydantic_core import PydanticCustomError

from inference_service.frontends.openai.schemas import _text_of_parts

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "inference_service"
PLACEHOLDER = re.compile(r"\{[A-Za-z_][A-Za-z0-9_.\[\]]*(![rsa])?(:[^{}]*)?\}")


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "_proto" not in p.parts)


def _name(func: ast.expr) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _calls(path: Path) -> list[ast.Call]:
    return [node for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path)))
            if isinstance(node, ast.Call)]


def _is_error(name: str) -> bool:
    return name.endswith(("Error", "Exception", "Exhausted", "Argument", "NotFound", "Unavailable",
                          "Denied", "Precondition", "Exists", "Exceeded", "Cancelled"))


def test_no_exception_message_is_an_f_string_without_its_f():
    found = []
    for path in _modules():
        for call in _calls(path):
            name = _name(call.func)
            if not _is_error(name) or name == "PydanticCustomError":
                continue
            for arg in call.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and PLACEHOLDER.search(arg.value):
                    found.append(f"{path.relative_to(PACKAGE)}:{call.lineno}: {name}({arg.value!r})")
    assert not found, "\n".join(found)


def test_every_pydantic_template_is_filled_by_its_context():
    found, seen = [], 0
    for path in _modules():
        for call in _calls(path):
            if _name(call.func) != "PydanticCustomError":
                continue
            seen += 1
            where = f"{path.relative_to(PACKAGE)}:{call.lineno}"
            template = call.args[1] if len(call.args) > 1 else None
            if not (isinstance(template, ast.Constant) and isinstance(template.value, str)):
                found.append(f"{where}: the template is not a string literal")
                continue
            context = call.args[2] if len(call.args) > 2 else None
            keys = {k.value for k in context.keys if isinstance(k, ast.Constant)} \
                if isinstance(context, ast.Dict) else set()
            for _text, field, spec, conversion in string.Formatter().parse(template.value):
                if field is None:
                    continue
                if conversion or spec:
                    found.append(f"{where}: {{{field}!{conversion or ''}:{spec or ''}}}: pydantic fills only {{name}}")
                if field not in keys:
                    found.append(f"{where}: {{{field}}} is not a key of the context {sorted(keys)}")
    assert seen, "no PydanticCustomError found: the check reads the wrong files"
    assert not found, "\n".join(found)


def test_the_image_content_part_error_names_the_part():
    with pytest.raises(PydanticCustomError) as err:
        _text_of_parts([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}])
    assert err.value.message() == "only text content parts are supported, got 'image_url'"
    assert "{" not in err.value.message()
