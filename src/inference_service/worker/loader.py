"""Resolve a manifest's ``handler`` entry point into a callable, as TorchServe does.

Accepted forms (TorchServe's):
- ``file.py`` or ``module``: a module (in the model directory, else importable,
  else a built-in ``ts.torch_handler.<name>``) that defines exactly one class;
  an instance of it is the service (``initialize(context)`` then
  ``handle(data, context)``). A module-level ``__handler__ = SomeClass`` names
  the class instead (an inference-service rule, used by the built-in
  ``ts.torch_handler.*`` modules, which re-export classes defined elsewhere).
- ``file.py:function`` or ``module:function``: ``function(data, context)`` is
  the service; it is called once with ``data=None`` at load.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from inference_service.handler.context import Context


class HandlerLoadError(Exception):
    """The entry point cannot be resolved or its initialisation failed (message says why)."""


@dataclass
class Service:
    """A loaded handler: ``handle(data, context)`` plus what it came from."""

    handle: Callable[[Any, Context], Any]
    description: str
    instance: Any = None  #: the handler object (``None`` for a ``module:function`` entry point)


def _import_handler_module(name: str, model_dir: str) -> ModuleType:
    module_name = name[:-3] if name.endswith(".py") else name
    module_name = module_name.replace(os.sep, ".")
    local = os.path.join(model_dir, module_name.replace(".", os.sep) + ".py")
    candidates = [module_name] if os.path.isfile(local) else [module_name, f"ts.torch_handler.{module_name}"]
    errors = []
    for candidate in candidates:
        try:
            return importlib.import_module(candidate)
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if missing != candidate and not candidate.startswith(missing + "."):
                # The module exists but one of its own imports is missing.
                raise HandlerLoadError(f"handler module {candidate!r} failed to import: {exc}") from exc
            errors.append(candidate)
        except Exception as exc:  # noqa: BLE001 - any import-time error is a load failure
            raise HandlerLoadError(
                f"handler module {candidate!r} failed to import: {type(exc).__name__}: {exc}"
            ) from exc
    raise HandlerLoadError(
        f"handler {name!r} not found: no {module_name}.py in the model archive and no module "
        f"named {' or '.join(repr(c) for c in errors)}"
    )


def load_service(handler: str, model_dir: str, context: Context) -> Service:
    """Import and initialise the handler named by ``handler``.

    Args:
        handler: the manifest's (or RegisterModel's) handler entry point.
        model_dir: the extracted archive directory (put first on ``sys.path``).
        context: the worker's context, passed to ``initialize``.

    Returns:
        The ready :class:`Service`.

    Raises:
        HandlerLoadError: not found, ambiguous (not exactly one class), or its
            import or ``initialize`` raised (the message carries the cause).
    """
    if not handler:
        raise HandlerLoadError("no handler given: set the manifest's handler or RegisterModel's handler")
    if model_dir not in sys.path:
        sys.path.insert(0, model_dir)
    module_part, _, function_name = handler.partition(":")
    module = _import_handler_module(module_part, model_dir)
    if function_name:
        fn = getattr(module, function_name, None)
        if not callable(fn):
            raise HandlerLoadError(f"handler module {module.__name__!r} has no function {function_name!r}")
        try:
            fn(None, context)
        except Exception as exc:
            raise HandlerLoadError(f"handler {handler!r} failed to initialize: {type(exc).__name__}: {exc}") from exc
        return Service(fn, f"{module.__name__}:{function_name}")
    explicit = getattr(module, "__handler__", None)
    if inspect.isclass(explicit):
        classes = [explicit]
    else:
        classes = [
            obj for _, obj in inspect.getmembers(module, inspect.isclass) if obj.__module__ == module.__name__
        ]
    if len(classes) != 1:
        raise HandlerLoadError(
            f"handler module {module.__name__!r} must define exactly one class (found {len(classes)}) "
            "or be given as module:function"
        )
    try:
        instance = classes[0]()
        init = getattr(instance, "initialize", None)
        if callable(init):
            init(context)
    except Exception as exc:
        raise HandlerLoadError(
            f"handler {classes[0].__name__} failed to initialize: {type(exc).__name__}: {exc}"
        ) from exc
    if not callable(getattr(instance, "handle", None)):
        raise HandlerLoadError(f"handler class {classes[0].__name__} has no handle(data, context) method")
    return Service(instance.handle, f"{module.__name__}.{classes[0].__name__}", instance)
