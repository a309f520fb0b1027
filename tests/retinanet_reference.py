"""A keras-hub ``RetinaNetObjectDetector`` from a tiny config with random
weights (a 2-stage ResNet on 32 x 32 images, levels 3 and 4, 3 classes),
and images with their boxes, for the tests that train it."""
import keras
import keras_hub
import numpy as np


def tiny_retinanet():
    """The detector (keras-hub compiles it with its defaults: Huber and
    binary focal losses, both summed)."""
    keras.utils.set_random_seed(0)
    m = keras_hub.models
    encoder = m.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 8],
        stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2], block_type="basic_block",
        image_shape=(32, 32, 3))
    backbone = m.RetinaNetBackbone(image_encoder=encoder, min_level=3, max_level=4, use_p5=False,
                                   image_shape=(32, 32, 3))
    return m.RetinaNetObjectDetector(backbone, num_classes=3, pre_logits_num_conv_layers=1,
                                     preprocessor=None)


def images_and_boxes(n, seed=0):
    """``(images [n, 32, 32, 3], {"boxes": [n, 2, 4], "labels": [n, 2]})``:
    two boxes an image, one in every third image from the third (its other
    box and label -1)."""
    rng = np.random.default_rng(seed)
    boxes, labels = np.zeros((n, 2, 4)), rng.integers(0, 3, (n, 2)).astype("float64")
    for i in range(n):
        for j in range(2):
            y0, x0, h, w = *rng.uniform(0, 4, 2), *rng.uniform(26, 28, 2)
            boxes[i, j] = [y0, x0, y0 + h, x0 + w]
    boxes[2::3, 1], labels[2::3, 1] = -1, -1
    return rng.normal(size=(n, 32, 32, 3)), {"boxes": boxes, "labels": labels}
