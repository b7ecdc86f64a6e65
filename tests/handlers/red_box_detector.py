"""Object-detector test model (torchvision detector contract): finds the red region of each image.

Per image it returns ``boxes`` (x1, y1, x2, y2 in pixels), ``labels`` and ``scores``:
the bounding box of the red pixels (label 1, score 0.93) when there are any, and
always a low-score detection (label 2, score 0.2) that the 0.5 threshold drops.
"""
import torch


class RedBoxDetector(torch.nn.Module):
    def forward(self, images):
        results = []
        for image in images:
            red = (image[0] > 0.6) & (image[1] < 0.4) & (image[2] < 0.4)
            boxes, labels, scores = [[0.0, 0.0, 2.0, 2.0]], [2], [0.2]
            if bool(red.any()):
                ys, xs = torch.nonzero(red, as_tuple=True)
                box = [float(xs.min()), float(ys.min()), float(xs.max()) + 1, float(ys.max()) + 1]
                boxes, labels, scores = [box, *boxes], [1, *labels], [0.93, *scores]
            results.append({"boxes": torch.tensor(boxes), "labels": torch.tensor(labels),
                            "scores": torch.tensor(scores)})
        return results
