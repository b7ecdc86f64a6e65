"""TorchServe's built-in vision handlers: ``image_classifier``, ``image_segmenter``, ``object_detector``.

Same names, class hierarchy and contracts as TorchServe 0.12's ``ts.torch_handler.*`` (which
import these classes). Input: the encoded image in ``data`` or ``body`` (a ``str`` is base64, a
list the tensor itself); bytes that do not decode fail that request with INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference_service.handler.base_handler import BaseHandler, ModelLoadError
from inference_service.handler.context import Context
from inference_service.handler.explanations import captum_attr, no_explanations
from inference_service.handler.image_processing import ImageDecodeError, ImageNetPreprocess, ToTensor, decode_image
from inference_service.handler.timer import timed
from inference_service.handler.util import PredictionException, map_class_to_label


class VisionHandler(BaseHandler):
    """Base of the image handlers: ``preprocess`` stacks ``self.image_processing(image)`` of every
    request into one ``N x C x H x W`` tensor on ``self.device``, as TorchServe's ``VisionHandler``
    (``limit_max_image_pixels`` false lifts Pillow's decompression-bomb limit, as there).

    An image that does not decode fails its request with 400 / INVALID_ARGUMENT: alone, by
    :class:`PredictionException`; beside good images, by ``context.set_response_status`` for it
    only (the model runs on a zero placeholder in its slot).
    """

    image_processing: Callable[[Any], Any] = ToTensor()
    _ig: Any = None

    @property
    def ig(self) -> Any:
        """Captum's ``IntegratedGradients`` over the model (TorchServe's attribute), made at first use."""
        if self._ig is None:
            self._ig = captum_attr("IntegratedGradients")(self.model)
        return self._ig

    @ig.setter
    def ig(self, value: Any) -> None:
        self._ig = value

    def get_insights(self, tensor_data: Any, _: Any, target: int = 0) -> Any:
        """Integrated Gradients of class ``target`` (15 steps), as TorchServe's: per request, the
        ``C x H x W`` attribution of each input value as nested lists. 501 without Captum."""
        return self.ig.attribute(tensor_data, target=target, n_steps=15).tolist()

    def initialize(self, context: Context) -> None:
        """Load the model (:meth:`BaseHandler.initialize`) and apply the image-size guard setting."""
        super().initialize(context)
        if not context.system_properties.get("limit_max_image_pixels", True):
            from PIL import Image

            Image.MAX_IMAGE_PIXELS = None

    def _request_image(self, row: Mapping[str, Any]) -> Any:
        """One request's image as a tensor (``image_processing`` applied). Raises ImageDecodeError."""
        import torch

        payload = (row.get("data") or row.get("body")) if isinstance(row, Mapping) else None
        if payload is None:
            raise ImageDecodeError("no image: send the image bytes in the input 'data' (or 'body')")
        if isinstance(payload, (bytes, bytearray, memoryview, str)):
            return self.image_processing(decode_image(payload))
        if isinstance(payload, list):
            return torch.as_tensor(payload, dtype=torch.float32)
        raise ImageDecodeError(f"cannot read an image from a {type(payload).__name__}")

    def load_images(self, data: list[dict[str, Any]]) -> list[Any]:
        """One tensor per request (a zero placeholder for a bad image).

        Raises:
            PredictionException: (400) every image of the batch is bad.
        """
        import torch

        images: list[Any] = []
        errors: dict[int, str] = {}
        for idx, row in enumerate(data):
            try:
                images.append(self._request_image(row))
            except ImageDecodeError as exc:
                errors[idx] = str(exc)
                images.append(None)
        if errors:
            if len(errors) == len(data):
                first = min(errors)
                prefix = "" if len(data) == 1 else f"request {first} of the batch: "
                raise PredictionException(prefix + errors[first], 400)
            template = next(img for img in images if img is not None)
            for idx, message in errors.items():
                if self.context is not None:
                    self.context.set_response_status(400, message, idx)
                images[idx] = torch.zeros_like(template)
        return images

    @timed
    def preprocess(self, data: list[dict[str, Any]]) -> Any:
        """Images of the batch as one stacked float tensor on ``self.device`` (``N x C x H x W``).

        Raises:
            PredictionException: (400) no image of the batch decodes.
        """
        import torch

        return torch.stack(self.load_images(data)).to(self.device)


class ImageClassifier(VisionHandler):
    """``image_classifier``: image -> ``{"label": probability}`` of the ``topk`` (5) most likely
    classes, as TorchServe's; a model with fewer classes returns all (TorchServe fails).
    See docs/own-model.md.

    Quick start (TorchServe's densenet161 flow, with any eager model)::

        torch-model-archiver --model-name densenet161 --version 1.0 --model-file model.py \\
            --serialized-file densenet161.pth --handler image_classifier \\
            --extra-files index_to_name.json --export-path model_store
    """

    topk = 5
    image_processing: Callable[[Any], Any] = ImageNetPreprocess()

    def initialize(self, context: Context) -> None:
        """Load the model, then read ``handler.topk`` from ``model-config.yaml`` if set."""
        super().initialize(context)
        options = self._handler_options()
        if "topk" in options:
            topk = options["topk"]
            if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
                raise ModelLoadError(f"model-config.yaml: handler.topk must be a positive integer, got {topk!r}")
            self.set_max_result_classes(topk)

    def set_max_result_classes(self, topk: int) -> None:
        """Return the ``topk`` most likely classes per request (TorchServe's setter)."""
        self.topk = topk

    def get_max_result_classes(self) -> int:
        """How many classes each response holds at most."""
        return self.topk

    @timed
    def postprocess(self, data: Any) -> list[dict[str, float]]:
        """Softmax the ``N x classes`` logits; ``[{label: probability}]`` of the top-k per request."""
        import torch

        probabilities = torch.nn.functional.softmax(data, dim=1)
        k = min(self.topk, probabilities.shape[1])
        probs, classes = torch.topk(probabilities, k, dim=1)
        return map_class_to_label(probs.tolist(), self.mapping, classes.tolist())


class ImageSegmenter(VisionHandler):
    """``image_segmenter``: image -> ``H x W x 2`` JSON, ``[class index (float), probability]`` per
    pixel, as TorchServe's (top class only: about 1.3 MB of JSON at 224 x 224). The model's
    ``N x classes x H x W`` logits may come in a dict under ``"out"`` (torchvision's)."""

    image_processing: Callable[[Any], Any] = ImageNetPreprocess()

    @timed
    def postprocess(self, data: Any) -> list[Any]:
        """Per request, ``[[[class, probability] per pixel] per row]`` of the softmaxed logits."""
        import torch

        if isinstance(data, Mapping):
            data = data["out"]
        probabilities = torch.nn.functional.softmax(data, dim=1)
        values, indices = torch.max(probabilities, dim=1)
        return torch.stack([indices.to(values.dtype), values], dim=3).tolist()

    def get_insights(self, tensor_data: Any, _: Any, target: int = 0) -> Any:
        """None: 501 (TorchServe's fails)."""
        raise no_explanations(self, "a class index names no single score of a per-pixel output")


class ObjectDetector(VisionHandler):
    """``object_detector``: image -> ``[{"<label>": [x1, y1, x2, y2], "score": s}, ...]`` (pixels)
    scoring at least ``threshold`` (0.5), as TorchServe's. ``ToTensor`` only, no resizing; images of
    different sizes go to the model as a list instead of a stacked tensor."""

    image_processing: Callable[[Any], Any] = ToTensor()
    threshold = 0.5

    def initialize(self, context: Context) -> None:
        """Load the model, then read ``handler.threshold`` from ``model-config.yaml`` if set."""
        super().initialize(context)
        options = self._handler_options()
        if "threshold" in options:
            value = options["threshold"]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ModelLoadError(f"model-config.yaml: handler.threshold must be within [0, 1], got {value!r}")
            self.threshold = float(value)

    @timed
    def preprocess(self, data: list[dict[str, Any]]) -> Any:
        """The batch's images: one stacked tensor if they share a size, else a list of tensors."""
        import torch

        images = [image.to(self.device) for image in self.load_images(data)]
        if all(image.shape == images[0].shape for image in images):
            return torch.stack(images)
        return images

    def get_insights(self, tensor_data: Any, _: Any, target: int = 0) -> Any:
        """None: 501 (TorchServe's fails)."""
        raise no_explanations(self, "detections are boxes, not class scores to attribute")

    @timed
    def postprocess(self, data: Any) -> list[list[dict[str, Any]]]:
        """Per image, ``[{label: box, "score": score}]`` of the detections scoring >= ``threshold``."""
        result = []
        for row in data:
            keep = row["scores"] >= self.threshold
            boxes = row["boxes"][keep].tolist()
            labels = row["labels"][keep].tolist()
            scores = row["scores"][keep].tolist()
            detections = []
            for label, box, score in zip(labels, boxes, scores, strict=True):
                entry = map_class_to_label([[box]], self.mapping, [[label]])[0]
                entry["score"] = score
                detections.append(entry)
            result.append(detections)
        return result
