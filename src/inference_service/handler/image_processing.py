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
    """Decode one request's image (a ``str`` is base64, as TorchServe's ``VisionHandler``) into a
    Pillow image with its pixels loaded, so a truncated file fails here.

    Raises:
        ImageDecodeError: empty, bad base64, not an image, truncated or corrupt, or above
            ``PIL.Image.MAX_IMAGE_PIXELS`` (Pillow's decompression-bomb guard).
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
    """As torchvision's ``Resize(size)`` on a Pillow image: shorter side ``size`` px, longer
    ``int(size * long / short)``, bilinear."""
    from PIL import Image

    width, height = image.size
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
    if (new_w, new_h) == (width, height):
        return image
    return image.resize((new_w, new_h), Image.Resampling.BILINEAR)


def center_crop(image: Any, size: int | Sequence[int]) -> Any:
    """As torchvision's ``CenterCrop``: offsets ``round((side - crop) / 2)``; a smaller image is first
    zero-padded, ``(crop - side) // 2`` before and the rest after."""
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
    """As torchvision's ``ToTensor``: ``C x H x W``; 8-bit modes float32 in [0, 1], mode ``1`` 0.0/1.0;
    ``I``, ``I;16`` and ``F`` keep their values and type."""
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
    """TorchServe's image classifier / segmenter preprocessing as one callable, with a conversion to
    RGB added (TorchServe fails on RGBA or palette images); sizes in px. Built on first use."""

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
