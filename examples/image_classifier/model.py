"""ColorNet: a tiny image classifier that names the dominant colours of an image.

The eager model of the image_classifier example (the same archive shape as
TorchServe's densenet161 one: this ``model.py`` with exactly one
``torch.nn.Module`` class, a state dict, ``index_to_name.json``). A 1x1
convolution scores every pixel against each colour class, a softmax turns the
scores into per-pixel class probabilities, and average pooling gives the share
of the image each colour covers. The model returns the log of those shares, so
the ``image_classifier`` handler's softmax turns them back into the shares: the
response reads as "72% red, 25% white, ...".

Its weights are not trained: ``scripts/build_image_classifier_example`` computes
them from a colour palette (one prototype RGB colour per class).
"""

import torch
from torch import nn


class ColorNet(nn.Module):
    """``N x 3 x H x W`` normalised images -> ``N x num_classes`` log colour shares.

    Args:
        num_classes: number of colour classes (10 in the example).
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.pixel_scores = nn.Conv2d(3, num_classes, kernel_size=1)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Log of the share of the image each class covers (soft per-pixel assignment)."""
        per_pixel = torch.softmax(self.pixel_scores(x), dim=1)
        shares = self.pool(per_pixel).flatten(1)
        return torch.log(shares.clamp_min(1e-6))
