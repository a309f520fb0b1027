"""One ``keras.applications`` constructor per family (one in the fast set:
EfficientNetB0, holding every layer kind the others hold, squeeze-excitation
blocks included; the other nine with ``-m slow``, MobileNetV3Small among them,
whose family's MobileNet registers, verifies and trains in the fast set of
``test_applications.py``): every
trainable variable in a non-generic layer, each family's characteristic
kinds found, and ``kg.verify`` passing on a batch of 2 (per-example
gradients against the batch gradient and against one-example tapes, norms
against those gradients' norms; inference mode, where batch norm does not
couple the examples). The optimizer's part (a ``FisherEstimator`` update,
5 ``kg.KFAC`` steps) runs for every constructor in ``test_applications.py``
(MobileNet in the fast set, the rest with ``-m slow``: about 3 minutes a
family on 2 CPU cores)."""
import pytest
import keras
import tensorflow as tf

import kfac_graph as kg

# family representative -> (input side, kinds its registration must hold)
FAMILIES = {
    "ConvNeXtTiny": (32, {"conv2d", "dense", "scale_and_shift"}),  # depthwise: groups=C
    "DenseNet121": (32, {"conv2d", "scale_and_shift", "dense"}),
    "EfficientNetB0": (32, {"conv2d", "depthwise_conv2d", "scale_and_shift", "dense"}),
    "EfficientNetV2B0": (32, {"conv2d", "depthwise_conv2d", "scale_and_shift", "dense"}),
    "InceptionV3": (75, {"conv2d", "scale_and_shift", "dense"}),
    "MobileNetV3Small": (32, {"conv2d", "depthwise_conv2d", "scale_and_shift"}),  # 1x1 conv head
    "NASNetMobile": (32, {"conv2d", "depthwise_conv2d", "scale_and_shift", "dense"}),
    "ResNet50V2": (32, {"conv2d", "scale_and_shift", "dense"}),
    "VGG16": (32, {"conv2d", "dense"}),
    "Xception": (71, {"conv2d", "depthwise_conv2d", "scale_and_shift", "dense"}),
}


FAST = ("EfficientNetB0",)  # every other family's kinds are EfficientNet's


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(FAMILIES)])
def test_family_representative_registers_and_verifies(name):
    side, kinds = FAMILIES[name]
    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, name)(weights=None, input_shape=(side, side, 3),
                                              classes=10)

    @kg.auto_register
    def loss_fn(x, y):
        probs = model(x, training=False)
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, probs))

    x = tf.random.stateless_normal([2, side, side, 3], seed=[0, 1])
    reg = loss_fn.registration(x, tf.constant([0, 3]))
    generic = [layer.name for layer in reg.layers if layer.kind == "generic"]
    assert not generic, generic
    found = {layer.kind for layer in reg.layers}
    assert kinds <= found, (name, sorted(found))
    registered = sum(int(v.shape.num_elements()) for layer in reg.layers
                     for v in layer.variables)
    assert registered == sum(int(v.numpy().size) for v in model.trainable_variables)
    report = kg.verify(loss_fn, x, tf.constant([0, 3]), examples=2)
    assert report.passed, report.table()
