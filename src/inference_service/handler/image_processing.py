"""Image decoding and the standard ImageNet preprocessing, with or without torchvision.

:class:`ImageNetPreprocess` is TorchServe's ``Resize(256) -> CenterCrop(224) -> ToTensor() ->
Normalize``: torchvision's transforms when importable, else equivalent Pillow + torch code (same
resampling, crop offsets, padding and scaling as torchvision applies to a Pillow image).
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Callable, Sequence
from typing import Any

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ImageDecodeError(ValueError):
    """The request bytes are not an image Pillow can decode (the message says why)."""


def decode_image(payload: bytes | bytearray | memoryview | str) -> Any:
    """Decode one request's image bytes into a fully loaded Pillow image.

    Args:
        payload: the encoded image (PNG, JPEG, ... anything Pillow reads); a
            ``str`` is taken as base64 of the bytes, as TorchServe's
            ``VisionHandler`` does.

    Returns:
        The ``PIL.Image.Image``, pixels loaded (so truncated files fail here).

    Raises:
        ImageDecodeError: empty input, bad base64, not an image, a truncated or
            corrupt file, or more pixels than ``PIL.Image.MAX_IMAGE_PIXELS``
            allows (Pillow's decompression-bomb guard).
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(payload, str):
        try:
            payload = base64.b64decode(payload)
        except (binascii.Error, ValueError) as exc:
            raise ImageDecodeError(f"image string is not valid base64: {exc}") from exc
    data = bytes(payload)
    if not data:
        raise ImageDecodeError("empty image")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Image.DecompressionBombError as exc:
        raise ImageDecodeError(f"image too large: {exc}") from exc
    except UnidentifiedImageError as exc:
        raise ImageDecodeError(f"cannot decode image ({len(data)} bytes): not a known image format") from exc
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types for corrupt files
        raise ImageDecodeError(f"cannot decode image ({len(data)} bytes): {exc}") from exc
    return image


def resize_shorter_side(image: Any, size: int) -> Any:
    """Scale ``image`` so its shorter side is ``size`` px, keeping the aspect ratio.

    As torchvision's ``Resize(size)`` on a Pillow image: the longer side becomes
    ``int(size * long / short)`` and the resampling is bilinear.
    """
    from PIL import Image

    width, height = image.size
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
    if (new_w, new_h) == (width, height):
        return image
    return image.resize((new_w, new_h), Image.Resampling.BILINEAR)


def center_crop(image: Any, size: int | Sequence[int]) -> Any:
    """Crop the centre ``size`` (int: square; or ``(height, width)``) out of ``image``.

    As torchvision's ``CenterCrop``: offsets ``round((side - crop) / 2)``; an
    image smaller than the crop is first padded with zeros, ``(crop - side) // 2``
    before and the rest after.
    """
    from PIL import Image

    crop_h, crop_w = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    width, height = image.size
    if crop_w > width or crop_h > height:
        pad_left = (crop_w - width) // 2 if crop_w > width else 0
        pad_top = (crop_h - height) // 2 if crop_h > height else 0
        padded = Image.new(image.mode, (max(width, crop_w), max(height, crop_h)))
        padded.paste(image, (pad_left, pad_top))
        image = padded
        width, height = image.size
    top = int(round((height - crop_h) / 2.0))
    left = int(round((width - crop_w) / 2.0))
    return image.crop((left, top, left + crop_w, top + crop_h))


def to_tensor(image: Any) -> Any:
    """A Pillow image as a ``C x H x W`` tensor, as torchvision's ``ToTensor``.

    8-bit modes (``L``, ``RGB``, ``RGBA``, ``P`` ...) become float32 in [0, 1];
    mode ``1`` becomes 0.0 / 1.0; ``I`` (int32), ``I;16`` (int16) and ``F``
    (float32) keep their values and type.
    """
    import torch

    if image.mode == "1":
        image = image.convert("L")
    dtype = {"I": torch.int32, "I;16": torch.int16, "F": torch.float32}.get(image.mode, torch.uint8)
    width, height = image.size
    channels = len(image.getbands())
    raw = bytearray(image.tobytes())
    tensor = torch.frombuffer(raw, dtype=dtype).view(height, width, channels).permute(2, 0, 1).contiguous()
    if dtype == torch.uint8:
        return tensor.to(torch.float32).div_(255.0)
    return tensor


def normalize(tensor: Any, mean: Sequence[float], std: Sequence[float]) -> Any:
    """``(tensor - mean) / std`` per channel of a ``C x H x W`` float tensor (torchvision's ``Normalize``)."""
    import torch

    mean_t = torch.as_tensor(mean, dtype=tensor.dtype).view(-1, 1, 1)
    std_t = torch.as_tensor(std, dtype=tensor.dtype).view(-1, 1, 1)
    return (tensor - mean_t) / std_t


def torchvision_available() -> bool:
    """Whether ``torchvision`` can be imported in this process."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return False
    return True


class ToTensor:
    """Callable ``image -> tensor`` (:func:`to_tensor`): the object detector's ``image_processing``."""

    def __call__(self, image: Any) -> Any:
        """Convert one Pillow image (see :func:`to_tensor`)."""
        return to_tensor(image)

    def __repr__(self) -> str:
        return "ToTensor()"


class ImageNetPreprocess:
    """TorchServe's image classifier / segmenter preprocessing as one callable.

    ``image -> RGB -> Resize(resize) -> CenterCrop(crop) -> ToTensor -> Normalize(mean, std)``.
    The conversion to RGB is added here (TorchServe feeds RGBA or palette images
    through unchanged, which fails on their 4 or 1 channels). The pipeline is
    built on first use: torchvision's transforms when torchvision is
    importable, else the Pillow + torch functions of this module.

    Args:
        resize: shorter side after resizing, px (default 256).
        crop: side of the centre crop, px (default 224).
        mean: per-channel mean (default ImageNet's).
        std: per-channel standard deviation (default ImageNet's).
    """

    def __init__(
        self,
        resize: int = 256,
        crop: int = 224,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> None:
        self.resize = resize
        self.crop = crop
        self.mean = tuple(mean)
        self.std = tuple(std)
        self._pipeline: Callable[[Any], Any] | None = None
        self._uses_torchvision = False

    @property
    def uses_torchvision(self) -> bool:
        """Whether the pipeline runs on torchvision (decided on first use)."""
        self._get_pipeline()
        return self._uses_torchvision

    def _get_pipeline(self) -> Callable[[Any], Any]:
        if self._pipeline is None:
            self._uses_torchvision = torchvision_available()
            if self._uses_torchvision:
                from torchvision import transforms

                self._pipeline = transforms.Compose([
                    transforms.Resize(self.resize),
                    transforms.CenterCrop(self.crop),
                    transforms.ToTensor(),
                    transforms.Normalize(mean=list(self.mean), std=list(self.std)),
                ])
            else:
                self._pipeline = self._without_torchvision
        return self._pipeline

    def _without_torchvision(self, image: Any) -> Any:
        image = center_crop(resize_shorter_side(image, self.resize), self.crop)
        return normalize(to_tensor(image), self.mean, self.std)

    def __call__(self, image: Any) -> Any:
        """Preprocess one Pillow image into a normalised ``3 x crop x crop`` float tensor."""
        if image.mode != "RGB":
            image = image.convert("RGB")
        return self._get_pipeline()(image)

    def __repr__(self) -> str:
        return f"ImageNetPreprocess(resize={self.resize}, crop={self.crop}, mean={self.mean}, std={self.std})"
