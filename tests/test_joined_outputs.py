"""A loss over several outputs (a model with two heads, each with its loss)
gets the Gauss-Newton curvature of all of them.

The pass finds one output per term (a likelihood's logits, or a Huber
term's output, ``passes/loss_output.py``), checks that together they cut
the variables from the loss and that none feeds another, and joins them
into one ``[B, N]`` tensor the heads read through (``passes/
joined_outputs.py``). The curvature is the Hessian of each example's summed
loss over the joined output: checked against a brute-force ``J^T H J`` from
GradientTape Jacobians and Hessians. Before, such a loss was opaque (the
empirical Fisher only) or, beside one likelihood, the other head's layers
got no curvature at all.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from per_example_reference import assert_matches_loop

B, D = 6, 4


@pytest.fixture
def float64():
    keras.config.set_floatx("float64")  # (conftest restores both)
    keras.config.set_dtype_policy("float64")


def _two_heads(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((D,))
    h = keras.layers.Dense(5, activation="tanh", name="trunk")(inputs)
    return keras.Model(inputs, [keras.layers.Dense(3, name="label")(h),
                                keras.layers.Dense(2, name="value")(h)])


def _data(seed=1):
    rng = np.random.default_rng(seed)
    return (tf.constant(rng.normal(size=(B, D))), tf.constant(rng.integers(0, 3, B)),
            tf.constant(rng.normal(size=(B, 2))))


def _sum_of_heads(model, second):
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def one(x, y, t):
        a, b = model(x)
        return sce(y, a) + 0.5 * second(t, b)
    return one


def _brute_ggn(model, on_outputs, layer, args):
    """(1/B) sum_i J_i^T H_i^+ J_i for ``layer``'s variables, z_i both heads'
    outputs side by side, H_i the Hessian of example i's summed loss."""
    variables = model.get_layer(layer).trainable_variables
    total = 0.0
    for i in range(B):
        xi, yi, ti = (a[i:i + 1] for a in args)
        with tf.GradientTape(persistent=True) as tape:
            z = tf.concat(model(xi), axis=1)
        j = np.concatenate([np.reshape(a.numpy(), [5, -1]) for a in
                            tape.jacobian(z, variables, experimental_use_pfor=False)], -1)
        z0 = tf.Variable(z)
        with tf.GradientTape(persistent=True) as outer:
            with tf.GradientTape() as inner:
                li = on_outputs(z0[:, :3], z0[:, 3:], yi, ti)
            g = inner.gradient(li, z0)
        h = np.reshape(outer.jacobian(g, z0).numpy(), [5, 5])
        values, vectors = np.linalg.eigh(0.5 * (h + h.T))
        total = total + j.T @ ((vectors * np.maximum(values, 0)) @ vectors.T) @ j
    return total / B


def _head_loss(second):
    """The summed loss as a function of the two outputs."""
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return lambda a, b, y, t: sce(y, a) + 0.5 * second(t, b)


def test_two_heads_are_joined_and_their_blocks_are_brute_force(float64):
    for second in (keras.losses.MeanSquaredError(), keras.losses.Huber()):
        model, args = _two_heads(), _data()
        fn = kg.auto_register(_sum_of_heads(model, second))
        reg = assert_matches_loop(fn, args, rtol=1e-10)
        assert (reg.loss.kind, reg.loss.output) == ("ggn", "kfac_joined_outputs:0")
        est = kg.FisherEstimator(fn, estimation_mode="exact", cov_ema_decay=0.0,
                                 approximations={"dense": "full"})
        est.update(*args)
        for name in ("trunk", "value"):
            block = next(b for layer, b in zip(reg.layers, est.blocks) if f"/{name}" in layer.name)
            want = _brute_ggn(model, _head_loss(second), name, args)
            np.testing.assert_allclose(block.full_matrix().numpy(), want, rtol=1e-8, atol=1e-12)
        assert kg.verify(fn, *args, estimation_mode="exact").passed


def test_keras_fit_with_a_loss_per_output_trains_with_the_defaults():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, D)).astype("float32")
    labels = np.argmax(x @ rng.normal(size=(D, 3)), axis=1)
    values = (x @ rng.normal(size=(D, 2))).astype("float32")
    kmodel = kg.KFACModel(_two_heads(), loss={
        "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "value": "huber"})
    kmodel.compile()
    history = kmodel.fit(x, {"label": labels, "value": values}, batch_size=16, epochs=5,
                         verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0], losses


def test_an_output_that_feeds_another_is_not_joined(float64):
    """Class logits that are also the regression head's input: the heads
    cannot be split at the outputs, so the loss stays opaque and says why."""
    rng = np.random.default_rng(0)
    w, v = tf.Variable(rng.normal(size=(D, 3))), tf.Variable(rng.normal(size=(3, 2)))

    def loss(x, y, t):
        h = tf.tanh(x @ w)
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(y, h)
        return tf.reduce_mean(ce) + 0.5 * tf.reduce_mean(tf.square(h @ v - t))
    spec = kg.auto_register(loss).registration(*_data()).loss
    assert spec.kind == "opaque" and "feeds another" in spec.reason


def test_kfac_under_xla_trains_two_heads():
    """The joined output is split again by a SplitV, whose gradients XLA
    differentiates twice (a Slice's XLA gradient has no gradient)."""
    rng = np.random.default_rng(2)
    x = tf.constant(rng.normal(size=(32, D)), tf.float32)
    y = tf.constant(np.argmax(x.numpy() @ rng.normal(size=(D, 3)), axis=1))
    t = tf.constant(x.numpy() @ rng.normal(size=(D, 2)), tf.float32)
    fn = kg.auto_register(_sum_of_heads(_two_heads(), keras.losses.Huber()))
    opt = kg.KFAC(fn, jit_compile=True)
    losses = [float(opt.step(x, y, t)) for _ in range(8)]
    assert int(opt.skipped_steps) == 0 and losses[-1] < 0.5 * losses[0], losses
