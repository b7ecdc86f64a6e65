"""``BaseHandler``: the default handler life cycle, compatible with TorchServe's (same attributes:
``self.context``, ``self.manifest``, ``self.model``, ``self.device``...). See docs/own-model.md."""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import pickle
import sys
import time
import zipfile
from collections.abc import Mapping
from typing import Any

from inference_service.contracts.explain import is_explanation
from inference_service.handler.context import Context
from inference_service.handler.explanations import no_explanations, request_target
from inference_service.handler.timer import timed
from inference_service.handler.util import load_label_mapping

log = logging.getLogger(__name__)


class ModelLoadError(Exception):
    """A model file named by the manifest could not be loaded (message names file and cause)."""


class BaseHandler:
    """Load a TorchScript or eager PyTorch model and run preprocess -> inference -> postprocess.

    Quick start::

        from ts.torch_handler.base_handler import BaseHandler

        class Doubler(BaseHandler):
            def preprocess(self, data):
                return [float(row.get("data") or row.get("body")) for row in data]
            def inference(self, data, *args, **kwargs):
                return [2 * x for x in data]
            def postprocess(self, data):
                return data

    ``initialize`` loads the manifest's ``modelFile`` (one ``nn.Module`` class, its state dict the
    ``serializedFile``, read ``weights_only`` unless opted out) or a TorchScript ``serializedFile``,
    onto ``self.device`` in ``eval()`` mode, compiled per ``pt2`` as TorchServe's; see
    docs/own-model.md. Every loading failure raises :class:`ModelLoadError` naming the file and
    the cause.
    """

    def __init__(self) -> None:
        self.model: Any = None
        self.mapping: dict[str, Any] | None = None
        self.device: Any = None
        self.map_location: str = "cpu"
        self.initialized = False
        self.context: Context | None = None
        self.manifest: dict[str, Any] = {}
        self.model_yaml_config: dict[str, Any] = {}
        self.model_pt_path: str | None = None
        self.model_dir: str = ""
        self.explain = False
        self.target = 0

    def adopt(self, context: Context) -> tuple[dict[str, Any], dict[str, Any]]:
        """Keep ``context`` and what TorchServe's handlers read of it (``manifest``,
        ``model_yaml_config``, ``model_dir``); returns ``(the handler section of model-config.yaml,
        the system properties)``."""
        self.context = context
        self.manifest = context.manifest
        self.model_yaml_config = context.model_yaml_config or {}
        properties = context.system_properties or {}
        self.model_dir = properties.get("model_dir", "")
        return self.model_yaml_config.get("handler") or {}, properties

    def initialize(self, context: Context) -> None:
        """Load the manifest's model onto the worker's device; ModelLoadError for a missing or invalid
        file or malformed ``handler`` options."""
        import torch

        _, properties = self.adopt(context)
        gpu_id = properties.get("gpu_id")
        if gpu_id is not None and torch.cuda.is_available():
            self.map_location = "cuda"
            self.device = torch.device(f"cuda:{gpu_id}")
        else:
            self.map_location = "cpu"
            self.device = torch.device("cpu")

        model_info = self.manifest.get("model", {})
        serialized = model_info.get("serializedFile")
        model_file = model_info.get("modelFile")
        self.model_pt_path = None
        if serialized:
            self.model_pt_path = os.path.join(self.model_dir, serialized)
            if not os.path.isfile(self.model_pt_path):
                raise ModelLoadError(f"serialized file {serialized!r} not found in {self.model_dir}")
        if model_file:
            self.model = self._load_pickled_model(self.model_dir, model_file, self.model_pt_path)
        elif self.model_pt_path is not None:
            self.model = self._load_serialized_model(self.model_pt_path)
        if self.model is not None:
            self.model.to(self.device)
            self.model.eval()
            self.model = self._compile_model(self.model)

        try:
            self.mapping = load_label_mapping(os.path.join(self.model_dir, "index_to_name.json"))
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
        self.initialized = True

    def get_device(self) -> Any:
        """The ``torch.device`` the model runs on (TorchServe's accessor)."""
        return self.device

    # --- loading ---------------------------------------------------------------
    def _handler_options(self) -> dict[str, Any]:
        """The ``handler`` section of ``model-config.yaml`` (``{}`` if none); ModelLoadError if not a mapping."""
        options = self.model_yaml_config.get("handler") if isinstance(self.model_yaml_config, dict) else None
        if options is None:
            return {}
        if not isinstance(options, dict):
            raise ModelLoadError(f"model-config.yaml: 'handler' must be a mapping, got {type(options).__name__}")
        return options

    def _weights_only(self) -> bool:
        """``torch.load``'s ``weights_only`` (``handler: {weights_only: false}`` opts out)."""
        value = self._handler_options().get("weights_only", True)
        if not isinstance(value, bool):
            raise ModelLoadError(f"model-config.yaml: handler.weights_only must be true or false, got {value!r}")
        return value

    def _display_name(self, path: str) -> str:
        """``path`` relative to the model directory (how the archive names it)."""
        try:
            rel = os.path.relpath(path, self.model_dir) if self.model_dir else path
        except ValueError:
            return path
        return path if rel.startswith("..") else rel

    def _load_serialized_model(self, model_pt_path: str) -> Any:
        """Load a TorchScript ``serializedFile`` (no ``modelFile``); ModelLoadError for ``.safetensors``
        (weights need their class), ``.onnx``, ``.so``, or an unloadable file."""
        name = self._display_name(model_pt_path)
        ext = os.path.splitext(model_pt_path)[1].lower()
        if ext == ".safetensors":
            raise ModelLoadError(
                f"serialized file {name!r} is a safetensors state dict: archive the model class "
                "with --model-file to load it"
            )
        if ext == ".onnx":
            raise ModelLoadError(f"serialized file {name!r}: ONNX models are not supported")
        if ext == ".so":
            raise ModelLoadError(f"serialized file {name!r}: AOT-compiled (torch.export .so) models are not supported")
        return self._load_torchscript_model(model_pt_path)

    def _load_torchscript_model(self, model_pt_path: str) -> Any:
        """Load a TorchScript archive onto ``self.device``. Raises ModelLoadError naming the file."""
        import torch

        name = self._display_name(model_pt_path)
        try:
            return torch.jit.load(model_pt_path, map_location=self.device)
        except Exception as exc:
            hint = ""
            if _is_torch_save_zip(model_pt_path):
                hint = (" (it looks like a torch.save file, e.g. a state dict: archive its model class "
                        "with --model-file)")
            raise ModelLoadError(f"cannot load TorchScript file {name!r}: {_brief(exc)}{hint}") from exc

    def _load_state_dict(self, model_pt_path: str) -> Mapping[str, Any]:
        """Safetensors, or ``torch.load`` (``weights_only`` unless opted out); ModelLoadError if unusable."""
        import torch

        name = self._display_name(model_pt_path)
        if model_pt_path.lower().endswith(".safetensors"):
            from safetensors.torch import load_file

            try:
                return load_file(model_pt_path, device=str(self.device))
            except Exception as exc:
                raise ModelLoadError(f"cannot read safetensors file {name!r}: {_brief(exc)}") from exc
        weights_only = self._weights_only()
        try:
            state = torch.load(model_pt_path, map_location=self.device, weights_only=weights_only)
        except pickle.UnpicklingError as exc:
            hint = ""
            if weights_only:
                hint = (" (it pickles Python objects; save a plain state dict, or set handler: "
                        "{weights_only: false} in model-config.yaml if you trust this archive)")
            raise ModelLoadError(f"cannot load state dict {name!r}: {_brief(exc)}{hint}") from exc
        except Exception as exc:
            raise ModelLoadError(f"cannot load state dict {name!r}: {_brief(exc)}") from exc
        if not isinstance(state, Mapping):
            raise ModelLoadError(f"serialized file {name!r} holds a {type(state).__name__}, not a state dict")
        return state

    def _load_pickled_model(self, model_dir: str, model_file: str, model_pt_path: str | None) -> Any:
        """Build the one no-argument ``nn.Module`` class of ``model_file`` and load its state dict (if
        any); ModelLoadError naming what failed."""
        import torch

        path = os.path.join(model_dir, model_file)
        if not os.path.isfile(path):
            raise ModelLoadError(f"model file {model_file!r} not found in {model_dir}")
        module_name = os.path.splitext(os.path.basename(model_file))[0]
        module = sys.modules.get(module_name)
        if module is None or os.path.abspath(getattr(module, "__file__", "") or "") != os.path.abspath(path):
            spec = importlib.util.spec_from_file_location(module_name, path)
            if spec is None or spec.loader is None:
                raise ModelLoadError(f"cannot import model file {model_file!r}")
            module = importlib.util.module_from_spec(spec)
            sys.modules.setdefault(module_name, module)
            try:
                spec.loader.exec_module(module)
            except Exception as exc:
                raise ModelLoadError(
                    f"model file {model_file!r} failed to import: {type(exc).__name__}: {_brief(exc)}"
                ) from exc
        classes = [
            obj for _, obj in inspect.getmembers(module, inspect.isclass)
            if issubclass(obj, torch.nn.Module) and obj.__module__ == module.__name__
        ]
        if len(classes) != 1:
            names = ", ".join(c.__name__ for c in classes)
            raise ModelLoadError(
                f"model file {model_file!r} must define exactly one torch.nn.Module class, "
                f"found {len(classes)}" + (f" ({names})" if names else "")
            )
        model_class = classes[0]
        try:
            model = model_class()
        except Exception as exc:
            raise ModelLoadError(
                f"cannot build {model_class.__name__}() from {model_file!r}: {type(exc).__name__}: {_brief(exc)}"
            ) from exc
        if model_pt_path:
            state_dict = self._load_state_dict(model_pt_path)
            try:
                model.load_state_dict(state_dict)
            except Exception as exc:
                raise ModelLoadError(
                    f"state dict {self._display_name(model_pt_path)!r} does not fit {model_class.__name__} "
                    f"of {model_file!r}: {_brief(exc)}"
                ) from exc
        return model

    def _compile_model(self, model: Any) -> Any:
        """Apply ``pt2`` (``torch.compile``) as TorchServe does: ``model`` unchanged when off, for
        ``pt2.export``, or on failure (logged). Raises ModelLoadError for a ``pt2`` of the wrong type."""
        import torch

        pt2 = self.model_yaml_config.get("pt2") if isinstance(self.model_yaml_config, dict) else None
        if pt2 is None:
            return model
        if isinstance(pt2, str):
            options: dict[str, Any] = {"backend": pt2}
        elif isinstance(pt2, dict) and "compile" in pt2:
            options = dict(pt2["compile"] or {})
            if options.pop("enable", False) is not True:
                return model
        elif isinstance(pt2, dict) and "export" in pt2:
            log.warning("model-config.yaml pt2.export (AOT compilation) is not supported; the model runs as loaded")
            return model
        elif isinstance(pt2, dict):
            options = dict(pt2)
        else:
            raise ModelLoadError(f"model-config.yaml: pt2 must be a backend name or a mapping, got {pt2!r}")
        try:
            compiled = torch.compile(model, **options)
        except Exception as exc:  # noqa: BLE001 - TorchServe proceeds uncompiled too
            log.warning("compiling the model with %s failed, proceeding without compilation: %s", options, exc)
            return model
        log.info("compiled model with torch.compile(%s)", ", ".join(f"{k}={v!r}" for k, v in options.items()))
        return compiled

    @timed
    def preprocess(self, data: list[dict[str, Any]]) -> Any:
        """Turn the batch's request dicts into model input (default: a tensor of the bodies)."""
        import torch

        return torch.as_tensor(data, device=self.device)

    @timed
    def inference(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        """Run the model without gradients."""
        import torch

        with torch.no_grad():
            return self.model(data, *args, **kwargs)

    @timed
    def postprocess(self, data: Any) -> list[Any]:
        """Turn model output into one result per request (default: ``tolist()``)."""
        return data.tolist() if hasattr(data, "tolist") else list(data)

    def handle(self, data: list[dict[str, Any]], context: Context) -> list[Any]:
        """Run ``preprocess -> inference -> postprocess`` on one batch (one dict per request, inputs as
        bytearray); one result per request. An explanation request (a batch of its own) runs
        ``explain_handle(preprocessed, data)`` instead, as TorchServe's."""
        start = time.perf_counter()
        self.context = context
        preprocessed = self.preprocess(data)
        if self._is_explain():
            output = self.explain_handle(preprocessed, data)
        else:
            output = self.postprocess(self.inference(preprocessed))
        context.metrics.add_time("HandlerTime", round((time.perf_counter() - start) * 1000, 2), None, "ms")
        return output

    def explain_handle(self, data_preprocess: Any, raw_data: list[Any]) -> Any:
        """TorchServe's: ``get_insights(data_preprocess, data or body, target)`` of the first request,
        its ``target`` input an integer (0 without one; 400 if not an integer)."""
        row = raw_data[0] if raw_data else {}
        inputs = (row.get("data") or row.get("body")) if isinstance(row, dict) else None
        return self.get_insights(data_preprocess, inputs, request_target(row))

    def get_insights(self, tensor_data: Any, raw_input: Any, target: int = 0) -> Any:
        """The explanation of a batch (the built-in handlers': Captum's). Here none: PredictionException (501)."""
        raise no_explanations(self)

    def _is_explain(self) -> bool:
        """Whether the batch's first request asks for an explanation; also sets ``self.explain`` (TorchServe's)."""
        context = self.context
        self.explain = bool(context is not None and context.request_processor
                            and is_explanation(context.get_all_request_header(0)))
        return self.explain


def _brief(exc: BaseException, limit: int = 500) -> str:
    """An exception's message on one line, cut at ``limit`` characters (torch's can run to pages)."""
    text = " ".join(str(exc).split())
    if not text:
        return type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_torch_save_zip(path: str) -> bool:
    """Whether ``path`` is a ``torch.save`` zip without TorchScript code (e.g. a state dict)."""
    try:
        if not zipfile.is_zipfile(path):
            return False
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except OSError:
        return False
    return any(n.endswith("/data.pkl") for n in names) and not any(n.endswith("/constants.pkl") for n in names)
