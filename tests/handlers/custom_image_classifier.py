"""A custom handler written against TorchServe's module paths, subclassing the built-in ImageClassifier."""
import os

import torch
from ts.torch_handler.image_classifier import ImageClassifier
from ts.torch_handler.vision_handler import VisionHandler
from ts.utils.util import load_label_mapping, map_class_to_label


class DominantColour(ImageClassifier):
    def initialize(self, context):
        super().initialize(context)
        assert isinstance(self, VisionHandler)
        self.set_max_result_classes(2)
        self.labels = load_label_mapping(os.path.join(context.system_properties["model_dir"], "index_to_name.json"))

    def postprocess(self, data):
        probs, classes = torch.topk(torch.softmax(data, dim=1), self.get_max_result_classes(), dim=1)
        ranked = map_class_to_label(probs.tolist(), self.labels, classes.tolist())
        return [{"dominant": next(iter(row)), "top": row, "device": str(self.get_device())} for row in ranked]
