"""KServe's MNIST sample handler (kserve v0.20.0,
docs/samples/v1beta1/torchserve/model-archiver/model-store/mnist/mnist_handler.py) with torchvision's
``transforms.Compose([ToTensor(), Normalize((0.1307,), (0.3081,))])`` written out: torchvision is not
installed here. Everything else is KServe's.
"""
import numpy as np
import torch
from ts.torch_handler.image_classifier import ImageClassifier


def _to_normalized_tensor(image):
    """torchvision's ToTensor() then Normalize((0.1307,), (0.3081,)) of a grayscale image: 1 x H x W."""
    pixels = torch.from_numpy(np.asarray(image.convert("L"), dtype=np.float32) / 255.0)
    return ((pixels - 0.1307) / 0.3081).unsqueeze(0)


class MNISTDigitClassifier(ImageClassifier):
    """
    MNISTDigitClassifier handler class. This handler extends class ImageClassifier from image_classifier.py, a
    default handler. This handler takes an image and returns the number in that image.

    Here method postprocess() has been overridden while others are reused from parent class.
    """

    image_processing = staticmethod(_to_normalized_tensor)

    def postprocess(self, data):
        return data.argmax(1).tolist()
