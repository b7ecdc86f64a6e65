"""Resolve a manifest's ``handler`` entry point into a callable, as TorchServe does.

The order is TorchServe 0.12's ``ts/model_loader.py`` (``TsModelLoader.load``): ``module:function``;
a module-level ``handle`` (checked before any class); else the module's class (named by
``__handler__ = SomeClass``, our addition, or its only class). A function entry point is called
once with ``(None, context)`` at load; a generator or coroutine it returns is run to its end
(TorchServe would never run it). See docs/own-model.md.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

from inference_service.handler import envelopes
from inference_service.handler.context import Context

log = logging.getLogger(__name__)

#: The function a module without ``:function`` is served by, when it has one (TorchServe's default).
DEFAULT_FUNCTION = "handle"


class HandlerLoadError(Exception):
    """The entry point cannot be resolved or its initialisation failed (message says why)."""


@dataclass
class Service:
    """A loaded handler: ``handle(data, context)`` plus what it came from."""

    handle: Callable[[Any, Context], Any]
    description: str
    instance: Any = None  #: the handler object (``None`` for a function entry point)


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


def _module_function(module: ModuleType, name: str) -> Callable[..., Any] | None:
    """``module.<name>`` when it is a function (or other non-class callable), else ``None``."""
    fn = getattr(module, name, None)
    return fn if callable(fn) and not inspect.isclass(fn) else None


def _initialize_function(fn: Callable[..., Any], context: Context) -> None:
    """TorchServe's load-time call ``fn(None, context)``; a generator, coroutine or async generator it
    returns is run to its end."""
    result = fn(None, context)
    if inspect.isgenerator(result):
        for _ in result:
            pass
    elif inspect.iscoroutine(result):
        asyncio.run(result)
    elif inspect.isasyncgen(result):
        agen = result

        async def drain() -> None:
            async for _ in agen:
                pass

        asyncio.run(drain())


def load_service(handler: str, model_dir: str, context: Context, envelope: str | None = None) -> Service:
    """Import and initialise the handler entry point (``model_dir`` first on ``sys.path``), wrapped in
    the request ``envelope`` if named, as TorchServe's loader does.

    Raises:
        HandlerLoadError: not found; ``module:function`` naming no function; no ``handle``
            function and not exactly one class; or its import, load-time call or ``initialize``
            raised (the message carries the cause).
    """
    service = _load(handler, model_dir, context)
    if not envelope:
        return service
    if getattr(service.instance, "accepts_generation_requests", False):
        # an LLM handler takes the typed request every door translates to (the Open Inference
        # doors too); an envelope around its stream would keep only the final, empty message
        log.info("the %s envelope is not applied to the LLM handler: the /v2 doors translate its requests",
                 envelope)
        return service
    try:
        wrapped = envelopes.wrap(service.handle, envelope)
    except ValueError as exc:
        raise HandlerLoadError(str(exc)) from exc
    return replace(service, handle=wrapped, description=f"{service.description} in the {envelope} envelope")


def _load(handler: str, model_dir: str, context: Context) -> Service:
    if not handler:
        raise HandlerLoadError("no handler given: set the manifest's handler or RegisterModel's handler")
    if model_dir not in sys.path:
        sys.path.insert(0, model_dir)
    module_part, _, function_name = handler.partition(":")
    module = _import_handler_module(module_part, model_dir)
    if function_name:
        fn = _module_function(module, function_name)
        if fn is None:
            raise HandlerLoadError(f"handler module {module.__name__!r} has no function {function_name!r}")
    else:
        fn = _module_function(module, DEFAULT_FUNCTION)
        function_name = DEFAULT_FUNCTION
    if fn is not None:
        try:
            _initialize_function(fn, context)
        except Exception as exc:
            raise HandlerLoadError(
                f"handler {module.__name__}:{function_name} failed to initialize: {type(exc).__name__}: {exc}"
            ) from exc
        return Service(fn, f"{module.__name__}:{function_name}")
    explicit = getattr(module, "__handler__", None)
    classes: list[type[Any]]
    if inspect.isclass(explicit):
        classes = [explicit]
    else:
        classes = [
            obj for _, obj in inspect.getmembers(module, inspect.isclass) if obj.__module__ == module.__name__
        ]
    if len(classes) != 1:
        raise HandlerLoadError(
            f"handler module {module.__name__!r} must define a module-level function handle(data, context) "
            f"or exactly one class (found {len(classes)}), or be given as module:function"
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
