"""Models with their own ``compute_loss``: ``kg.KFACModel`` and ``kg.DPModel``
train on ``model.compute_loss(x, y, model(x, training=True), sample_weight)``
where the model's class overrides it and no other loss is given, as Keras's
``fit`` does (``keras_compute_loss.py``).

Before, both wrappers computed ``loss(y, model(x))`` and skipped the
override: ``KFACModel(model)`` said "the model needs a loss", and a
keras-hub ``RetinaNetObjectDetector`` (whose ``compute_loss`` turns
``{"boxes", "labels"}`` into per-anchor targets and weights) could not be
trained from its documented targets (``loss=task.loss`` failed on output
names). References: ``kg.KFAC`` on the same function written by hand, and
Keras's own ``fit`` with SGD (which calls the override).
"""
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from retinanet_reference import images_and_boxes, tiny_retinanet

B = 4


class AuxModel(keras.Model):
    """A classifier whose ``compute_loss`` is a weighted cross-entropy plus an
    auxiliary regression head on the hidden layer (predicting ``x[:, 0]``)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.head = keras.layers.Dense(3)
        self.aux = keras.layers.Dense(1)

    def call(self, x, training=None):
        h = self.hidden(x)
        return {"logits": self.head(h), "aux": self.aux(h)}

    def compute_loss(self, x, y, y_pred, sample_weight=None, training=True):
        ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
            y, y_pred["logits"], sample_weight=sample_weight)
        aux = keras.ops.mean(keras.ops.square(y_pred["aux"][:, 0] - x[:, 0]))
        return ce + 0.5 * aux


def _aux_model():
    keras.utils.set_random_seed(0)
    model = AuxModel()
    model(np.zeros((1, 5)))
    return model


def _data(n=2 * B):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 5)), rng.integers(0, 3, n), rng.uniform(0.5, 1.5, n)


def _hand_written(model):
    """The model's compute_loss as a function, as a kg.KFAC user writes it."""
    def loss(x, y, *sample_weight):
        return model.compute_loss(x, y, model(x, training=True), *sample_weight)
    return kg.auto_register(loss)


def _close(models, rtol=1e-6):
    a, b = models
    for u, v in zip(a.weights, b.weights):
        np.testing.assert_allclose(u.numpy(), v.numpy(), rtol=rtol, atol=rtol * 1e-3,
                                   err_msg=u.path)


def test_kfac_model_fit_equals_kfac_on_the_models_compute_loss(keras_float64):
    x, y, w = _data()
    opts = dict(damping=1e-2, learning_rate=0.1)
    for weights in (None, w):  # with sample weights, compute_loss takes them
        model = _aux_model()
        kmodel = kg.KFACModel(model, **opts)
        kmodel.compile()
        got = kmodel.fit(x, y, sample_weight=weights, batch_size=B, shuffle=False,
                         verbose=0).history["loss"]
        ref = _aux_model()
        opt = kg.KFAC(_hand_written(ref), **opts)
        steps = [float(opt.step(x[i:i + B], y[i:i + B],
                                *(() if weights is None else (weights[i:i + B],))))
                 for i in (0, B)]
        assert got == pytest.approx([np.mean(steps)], rel=1e-6)
        assert int(kmodel.kfac.skipped_steps) == 0
        _close((model, ref))
    # evaluate reports the model's compute_loss at training=False, as Keras's does
    want = float(model.compute_loss(x, y, model(x, training=False)))
    assert kmodel.evaluate(x, y, batch_size=2 * B, verbose=0) == pytest.approx(want, rel=1e-12)


@pytest.mark.slow  # compute_loss: the KFACModel case above (fast)
def test_dp_model_without_noise_or_clipping_is_sgd_on_compute_loss(keras_float64):
    x, y, _ = _data()
    plain = _aux_model()
    plain.compile(optimizer=keras.optimizers.SGD(0.1))
    want = plain.fit(x, y, batch_size=2 * B, epochs=2, shuffle=False,
                     verbose=0).history["loss"]
    model = _aux_model()
    dp = kg.DPModel(model, l2_norm_clip=1e9, noise_multiplier=0.0)
    dp.compile(optimizer=keras.optimizers.SGD(0.1))
    got = dp.fit(kg.privacy.fixed_size_batches((x, y), 2 * B, steps=1, seed=0), epochs=2,
                 verbose=0).history["loss"]
    assert got == pytest.approx(want, rel=1e-6)
    _close((model, plain))
    want = float(model.compute_loss(x, y, model(x, training=False)))
    assert dp.evaluate(x, y, batch_size=2 * B, verbose=0) == pytest.approx(want, rel=1e-12)
    # Poisson batches with sample weights: padding dropped, the loss logged at the real rows
    history = dp.fit(x, y, sample_weight=np.ones(2 * B), batch_size=B, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


def test_which_loss_the_wrappers_take(keras_float64):
    model = _aux_model()
    model.compile(loss={"logits": "mse", "aux": "mse"})  # compiled, and overridden
    for wrapper in (kg.KFACModel(model), kg.KFACModel(model, loss=model.loss),
                    kg.DPModel(model), kg.DPModel(model, loss=model.loss)):
        assert wrapper._own_loss and "compute_loss" in wrapper.loss_fn.__name__
    given = kg.KFACModel(model, loss={"logits": "mse", "aux": "mse"})  # another loss: taken
    assert not given._own_loss
    with pytest.raises(ValueError, match="loss_weights .* own compute_loss"):
        kg.KFACModel(model).compile(loss_weights=[1.0, 2.0])
    plain = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])  # Keras's own
    with pytest.raises(ValueError, match="the model needs a loss"):
        kg.KFACModel(plain).compile()
    with pytest.raises(ValueError, match="the model needs a loss"):
        kg.DPModel(plain).compile()


@pytest.mark.slow  # two detectors' traces and K-FAC steps, about 90 s
def test_retinanet_fits_from_boxes_and_labels(keras_float64):
    """``KFACModel(task).fit(images, {"boxes", "labels"})`` as keras-hub's
    docs train it equals ``kg.KFAC`` on ``task.compute_loss`` (the label
    encoder, the batch's count of positive anchors); ``DPModel`` refuses it."""
    n, b = 6, 3
    x, y = images_and_boxes(n)
    opts = dict(damping=1e-2, learning_rate=0.05)
    task = tiny_retinanet()
    kmodel = kg.KFACModel(task, **opts)
    kmodel.compile()
    got = kmodel.fit(x, y, batch_size=b, shuffle=False, verbose=0).history["loss"]
    assert int(kmodel.kfac.skipped_steps) == 0 and np.isfinite(got).all()
    ref = tiny_retinanet()

    def loss(x, y):  # a copy of y: RetinaNet's compute_loss converts its boxes in place
        return ref.compute_loss(x=x, y=dict(y), y_pred=ref(x, training=True), sample_weight=None)

    opt = kg.KFAC(kg.auto_register(loss), **opts)
    steps = [float(opt.step(tf.constant(x[i:i + b]), {k: tf.constant(v[i:i + b])
                                                       for k, v in y.items()}))
             for i in range(0, n, b)]
    assert got == pytest.approx([np.mean(steps)], rel=1e-6)
    _close((task, ref))
    part = {k: v[:b] for k, v in y.items()}
    want = float(task.compute_loss(x=x[:b], y=part, y_pred=task(x[:b], training=False),
                                   sample_weight=None))
    assert kmodel.evaluate(x[:b], part, batch_size=b, verbose=0) == pytest.approx(want, rel=1e-6)
    dp = kg.DPModel(tiny_retinanet(), l2_norm_clip=1.0, noise_multiplier=1.0)
    dp.compile(optimizer=keras.optimizers.SGD(0.01))
    with pytest.raises(kg.KfacGraphError, match="couples the examples|statistic of the whole"):
        dp.fit(x, y, batch_size=b, epochs=1, verbose=0)


def _mirrored_runs():
    """(In a fresh process with 2 logical CPUs.) Each wrapper's fit (2
    epochs) and evaluate on ``AuxModel``, on one device and under
    ``MirroredStrategy``: ``{kind: [(losses, evaluated, weights)] * 2}``."""
    x, y, _ = _data(16)
    runs = {}
    for kind in ("kfac", "dp"):
        for strategy in (None, tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])):
            keras.utils.set_random_seed(0)
            with strategy.scope() if strategy else tf.init_scope():
                model = _aux_model()
                if kind == "kfac":
                    wrapper = kg.KFACModel(model, damping=1e-2, estimation_mode="exact")
                    wrapper.compile()
                else:
                    wrapper = kg.DPModel(model, l2_norm_clip=1e9, noise_multiplier=0.0)
                    wrapper.compile(optimizer=keras.optimizers.SGD(0.1))
            data = ((x, y) if kind == "kfac" else
                    (kg.privacy.fixed_size_batches((x, y), 16, steps=1, seed=0),))
            history = wrapper.fit(*data, batch_size=None if kind == "dp" else 8, epochs=2,
                                  shuffle=False, verbose=0).history["loss"]
            runs.setdefault(kind, []).append((history, wrapper.evaluate(
                x, y, batch_size=16, verbose=0), [v.numpy().tolist() for v in model.weights]))
    return runs


@pytest.mark.slow  # a fresh process, four fits, about 40 s
def test_under_mirrored_strategy_the_losses_are_one_devices(tmp_path):
    """The model's compute_loss mixes a Keras mean (which divides itself by the
    replicas under a strategy) and its own mean (which does not): the step,
    the logged loss and ``evaluate`` are one device's (before, unscaled as
    Keras unscales the whole, DPModel logged 1.56 for 1.32 and evaluate
    0.764 for 0.744)."""
    out = tmp_path / "runs.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this kfac_graph
    proc = subprocess.run([sys.executable, __file__, str(out)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3",
                                                "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for kind, (one, mirrored) in json.loads(out.read_text()).items():
        np.testing.assert_allclose(mirrored[0], one[0], rtol=1e-9, err_msg=kind)
        np.testing.assert_allclose(mirrored[1], one[1], rtol=1e-9, err_msg=kind)
        for a, b in zip(mirrored[2], one[2]):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12, err_msg=kind)


if __name__ == "__main__":
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    with open(sys.argv[1], "w") as f:
        json.dump(_mirrored_runs(), f)
