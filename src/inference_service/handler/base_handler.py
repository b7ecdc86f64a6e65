"""``BaseHandler``: the default handler life cycle, compatible with TorchServe's.

Custom handlers subclass it and override ``preprocess`` / ``inference`` /
``postprocess`` (or ``initialize`` / ``handle``); they read the attributes
TorchServe's ``BaseHandler`` sets: ``self.context``, ``self.manifest``,
``self.model``, ``self.device``, ``self.map_location``, ``self.mapping``,
``self.initialized``, ``self.model_pt_path``, ``self.model_dir``.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import os
import sys
import time
from typing import Any

from inference_service.handler.context import Context

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

    ``initialize`` loads the manifest's ``serializedFile`` when there is one:
    with a ``modelFile`` it is an eager model (exactly one ``nn.Module`` class in
    that file, plus a state dict), otherwise a TorchScript file
    (``torch.jit.load``). ``index_to_name.json`` in the model directory, when
    present, becomes ``self.mapping``. ``handle`` records ``HandlerTime`` (ms)
    through ``context.metrics.add_time``, as TorchServe's does.
    """

    def __init__(self) -> None:
        self.model: Any = None
        self.mapping: dict[str, Any] | None = None
        self.device: Any = None
        self.map_location: str = "cpu"
        self.initialized = False
        self.context: Context | None = None
        self.manifest: dict[str, Any] = {}
        self.model_pt_path: str | None = None
        self.model_dir: str = ""
        self.explain = False
        self.target = 0

    def initialize(self, context: Context) -> None:
        """Load the model named by the manifest onto the worker's device.

        Raises:
            ModelLoadError: the serialized or model file is missing or invalid.
        """
        import torch

        self.context = context
        self.manifest = context.manifest
        properties = context.system_properties
        self.model_dir = properties.get("model_dir", "")
        gpu_id = properties.get("gpu_id")
        if gpu_id is not None and torch.cuda.is_available():
            self.map_location = "cuda"
            self.device = torch.device(f"cuda:{gpu_id}")
        else:
            self.map_location = "cpu"
            self.device = torch.device("cpu")

        model_info = self.manifest.get("model", {})
        serialized = model_info.get("serializedFile")
        if serialized:
            self.model_pt_path = os.path.join(self.model_dir, serialized)
            if not os.path.isfile(self.model_pt_path):
                raise ModelLoadError(f"serialized file {serialized!r} not found in {self.model_dir}")
            model_file = model_info.get("modelFile")
            if model_file:
                self.model = self._load_pickled_model(self.model_dir, model_file, self.model_pt_path)
            else:
                self.model = self._load_torchscript_model(self.model_pt_path)
            self.model.to(self.device)
            self.model.eval()

        mapping_path = os.path.join(self.model_dir, "index_to_name.json")
        if os.path.isfile(mapping_path):
            with open(mapping_path, encoding="utf-8") as f:
                self.mapping = json.load(f)
        self.initialized = True

    def _load_torchscript_model(self, model_pt_path: str) -> Any:
        """Load a TorchScript archive. Raises ModelLoadError naming the file."""
        import torch

        try:
            return torch.jit.load(model_pt_path, map_location=self.device)
        except Exception as exc:
            raise ModelLoadError(f"cannot load TorchScript file {model_pt_path}: {exc}") from exc

    def _load_pickled_model(self, model_dir: str, model_file: str, model_pt_path: str) -> Any:
        """Build the one ``nn.Module`` class of ``model_file`` and load its state dict.

        Raises:
            ModelLoadError: the file is missing, holds no or several module
                classes, or the state dict does not fit.
        """
        import torch

        path = os.path.join(model_dir, model_file)
        if not os.path.isfile(path):
            raise ModelLoadError(f"model file {model_file!r} not found in {model_dir}")
        module_name = os.path.splitext(os.path.basename(model_file))[0]
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ModelLoadError(f"cannot import model file {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(module_name, module)
        spec.loader.exec_module(module)
        classes = [
            obj for _, obj in inspect.getmembers(module, inspect.isclass)
            if issubclass(obj, torch.nn.Module) and obj.__module__ == module.__name__
        ]
        if len(classes) != 1:
            raise ModelLoadError(
                f"model file {model_file!r} must define exactly one torch.nn.Module class, "
                f"found {len(classes)}"
            )
        model = classes[0]()
        try:
            state_dict = torch.load(model_pt_path, map_location=self.device, weights_only=True)
            model.load_state_dict(state_dict)
        except Exception as exc:
            raise ModelLoadError(f"cannot load state dict {model_pt_path}: {exc}") from exc
        return model

    def preprocess(self, data: list[dict[str, Any]]) -> Any:
        """Turn the batch's request dicts into model input (default: a tensor of the bodies)."""
        import torch

        return torch.as_tensor(data, device=self.device)

    def inference(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        """Run the model without gradients."""
        import torch

        with torch.no_grad():
            return self.model(data, *args, **kwargs)

    def postprocess(self, data: Any) -> list[Any]:
        """Turn model output into one result per request (default: ``tolist()``)."""
        return data.tolist() if hasattr(data, "tolist") else list(data)

    def handle(self, data: list[dict[str, Any]], context: Context) -> list[Any]:
        """Run ``preprocess -> inference -> postprocess`` on one batch.

        Args:
            data: one dict per request of the batch (input map entries as bytearray).
            context: the worker's context for this batch.

        Returns:
            One result per request of the batch.
        """
        start = time.perf_counter()
        self.context = context
        output = self.postprocess(self.inference(self.preprocess(data)))
        context.metrics.add_time("HandlerTime", round((time.perf_counter() - start) * 1000, 2), None, "ms")
        return output
