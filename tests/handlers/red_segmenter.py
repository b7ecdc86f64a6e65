"""Image-segmenter test model (torchvision segmentation contract): class 1 = red pixels.

No weights (archived with --model-file only): the 1x1 scores are fixed. Returns
``{"out": N x 2 x H x W logits}`` like torchvision's segmentation models.
"""
import torch


class RedSegmenter(torch.nn.Module):
    def forward(self, x):
        red_score = 3.0 * (x[:, 0] - x[:, 1]) - 1.0
        return {"out": torch.stack([torch.zeros_like(red_score), red_score], dim=1)}
