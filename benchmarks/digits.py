"""Shared data and models for the optimizer benchmarks (``convergence.py``,
``step_overhead.py``): scikit-learn's 8x8 digits (shipped with the package,
no download), pixels scaled to [0, 1] by /16.

- ``autoencoder``: the deep autoencoder of Martens & Grosse (2015) scaled to
  64 inputs: 64-256-128-32-128-256-64, tanh on every hidden layer, logits
  out; loss: sigmoid cross-entropy summed over the 64 pixels and averaged
  over the batch. Its floor is the data's own entropy (``entropy_floor``):
  the loss of a perfect reconstruction ``sigmoid(z) = x``.
- ``cnn``: conv 16 3x3 same, conv 32 3x3 stride 2 same (relu each), dense 64
  relu, dense 10; loss: mean sparse softmax cross-entropy.
- ``resnet50`` (on request, not in ``MODELS``): ``keras.applications.ResNet50``
  (random weights, 10 logits) on the digits upsampled to 32x32 (each pixel a
  4x4 square, three equal channels), batch normalisation in training mode;
  the CNN's loss.

Each model comes as a ``Task``: a Keras model, a ``kg.auto_register``ed loss
``loss_fn(x, t)``, the full training set, and a fixed sequence of
minibatches (``batches``: one seeded permutation per epoch, the remainder
dropped), so every optimizer sees the same data in the same order.
"""
from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import kfac_graph as kg

MODELS = ("autoencoder", "cnn")


def digits():
    """``(pixels [1797, 64] in [0, 1], labels [1797])``, float32 / int32."""
    data = load_digits()
    return (data.data / 16.0).astype("float32"), data.target.astype("int32")


def entropy_floor(x) -> float:
    """Mean over examples of the summed Bernoulli entropy of the pixels: the
    lowest possible summed sigmoid cross-entropy for targets ``x``."""
    x = np.asarray(x, np.float64)
    p = np.clip(x, 1e-12, 1 - 1e-12)
    h = -(x * np.log(p) + (1 - x) * np.log(1 - p))
    return float(h.sum(axis=1).mean())


@dataclasses.dataclass
class Task:
    name: str
    model: keras.Model
    loss_fn: kg.RegisteredFunction   # loss_fn(x, t) -> scalar
    inputs: tf.Tensor                # the whole training set
    targets: tf.Tensor
    floor: float | None              # the loss's lower bound, if known
    has_conv: bool

    def full_loss(self) -> float:
        """The loss on the whole training set (inference mode: no batch norm
        or dropout here, so it is the training objective)."""
        return float(self._full_loss())

    def __post_init__(self):
        self._full_loss = tf.function(lambda: self.loss_fn.python_function(self.inputs,
                                                                           self.targets))

    def batches(self, steps: int, batch_size: int = 256, seed: int = 0):
        """``steps`` minibatches ``(x, t)`` as tensors, the same for a given seed."""
        n = int(self.inputs.shape[0])
        per_epoch = n // batch_size
        rng = np.random.default_rng(seed)
        index = np.concatenate([rng.permutation(n)[:per_epoch * batch_size]
                                for _ in range(-(-steps // per_epoch))])
        index = index[:steps * batch_size].reshape(steps, batch_size)
        x, t = self.inputs.numpy(), self.targets.numpy()
        return [(tf.constant(x[i]), tf.constant(t[i])) for i in index]


def autoencoder_model():
    return keras.Sequential(
        [keras.Input((64,))]
        + [keras.layers.Dense(n, activation="tanh", name=f"enc_{n}") for n in (256, 128, 32)]
        + [keras.layers.Dense(n, activation="tanh", name=f"dec_{n}") for n in (128, 256)]
        + [keras.layers.Dense(64, name="logits")], name="autoencoder")


def cnn_model():
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv1"),
        keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu", name="conv2"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu", name="hidden"),
        keras.layers.Dense(10, name="logits"),
    ], name="cnn")


def make_task(name: str, seed: int = 0) -> Task:
    """A fresh model (initialised from ``seed``) and its loss."""
    keras.utils.set_random_seed(seed)
    pixels, labels = digits()
    if name == "autoencoder":
        model = autoencoder_model()

        def loss(x, t):
            logits = model(x, training=True)
            return tf.reduce_mean(tf.reduce_sum(
                tf.nn.sigmoid_cross_entropy_with_logits(labels=t, logits=logits), axis=1))

        return Task(name, model, kg.auto_register(loss), tf.constant(pixels),
                    tf.constant(pixels), entropy_floor(pixels), has_conv=False)
    if name == "cnn":
        model = cnn_model()

        def loss(x, t):
            logits = model(x, training=True)
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(t, logits))

        return Task(name, model, kg.auto_register(loss),
                    tf.constant(pixels.reshape(-1, 8, 8, 1)), tf.constant(labels), None,
                    has_conv=True)
    if name == "resnet50":
        model = keras.applications.ResNet50(input_shape=(32, 32, 3), weights=None, classes=10,
                                            classifier_activation=None)
        images = np.repeat(np.kron(pixels.reshape(-1, 8, 8), np.ones((4, 4), "float32"))
                           [..., None], 3, axis=-1)

        def loss(x, t):
            logits = model(x, training=True)
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(t, logits))

        return Task(name, model, kg.auto_register(loss), tf.constant(images),
                    tf.constant(labels), None, has_conv=True)
    raise ValueError(f"unknown model {name!r}; choose from {MODELS + ('resnet50',)}")


def keras_step(task: Task, optimizer, jit_compile: bool):
    """A compiled first-order step ``step(x, t) -> loss`` for a Keras optimizer."""
    variables = task.model.trainable_variables
    optimizer.build(variables)

    def step(x, t):
        with tf.GradientTape() as tape:
            loss = task.loss_fn.python_function(x, t)
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    return tf.function(step, jit_compile=jit_compile)
