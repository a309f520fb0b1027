"""``qmodel_batch_fraction``: the quadratic model's exact Fisher forms on the
batch's first ``ceil(f B)`` examples (``exact_fisher.leading_forms``).

The step's alpha and mu against a numpy solve with those forms are in
``test_optimizer_qmodel.py``; each replica's own first examples under
``MirroredStrategy`` in ``test_distributed_mirrored.py``.
"""
import numpy as np
import pytest
import keras
import tensorflow as tf

import kfac_graph as kg
from kfac_graph.optimizer import exact_fisher


def test_leading_examples_cuts_the_batch_axis_only():
    x, y, table = tf.zeros([8, 3]), tf.range(8), tf.zeros([5, 2])
    cut_x, (cut_y, same_table, flag) = exact_fisher.leading_examples((x, (y, table, True)), 0.3)
    assert cut_x.shape == [3, 3] and cut_y.numpy().tolist() == [0, 1, 2]
    assert same_table is table and flag is True


def test_leading_examples_of_a_batch_known_only_at_run_time():
    @tf.function(input_signature=[tf.TensorSpec([None, 2]), tf.TensorSpec([None], tf.int32)])
    def cut(x, y):
        return exact_fisher.leading_examples((x, y), 0.25)

    x, y = cut(tf.zeros([10, 2]), tf.range(10))
    assert x.shape == [3, 2] and y.numpy().tolist() == [0, 1, 2]


def test_leading_examples_without_a_batch_axis_is_one_line_error():
    with pytest.raises(kg.KfacGraphError, match="no batch axis"):
        exact_fisher.leading_examples((tf.constant(1.0),), 0.5)


def _softmax_problem(seed, reduce=tf.reduce_mean, penalty=0.0):
    """``(loss_fn, x, y, registration, two random vectors)``: a tanh MLP's
    softmax loss on 10 examples, reduced by ``reduce``, plus ``penalty`` times
    the first kernel's squared norm (a term that bypasses the model output)."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"),
                              keras.layers.Dense(3)])
    kernel = model.layers[0].kernel

    @kg.auto_register
    def loss_fn(x, y):
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x))
        return reduce(ce) + penalty * tf.reduce_sum(tf.square(kernel))

    x = tf.random.stateless_normal([10, 4], seed=[1 + 2 * seed, 2 + 2 * seed])
    y = tf.constant([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    reg = loss_fn.registration(x, y)
    rng = np.random.default_rng(seed)
    vectors = [[tf.constant(rng.normal(size=v.shape), v.dtype) for v in reg.variables]
               for _ in range(2)]
    return loss_fn, x, y, reg, vectors


def test_leading_forms_are_the_forms_of_the_first_examples_alone():
    """Against the forms of a separate registration of ``x[:n]``, with the
    vectors given in the batch registration's variable order."""
    loss_fn, x, y, reg, vectors = _softmax_problem(0)
    part = loss_fn.registration(x[:4], y[:4])
    forms = tf.function(lambda f: tf.stack([tf.stack(row) for row in f()]), autograph=False)
    got = forms(lambda: exact_fisher.leading_forms(loss_fn, reg, (x, y), vectors, 0.4)[0]).numpy()
    want = forms(lambda: exact_fisher.quadratic_forms(part, (x[:4], y[:4]), vectors)).numpy()
    whole = forms(lambda: exact_fisher.quadratic_forms(reg, (x, y), vectors)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert not np.allclose(got, whole, rtol=1e-3)


def _sequence_model_losses(layer, fraction, steps=8):
    """K-FAC's losses, defaults but ``qmodel_batch_fraction``, on one batch of
    a copy task (predict each token) for a recurrent or attention model."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((12,), dtype="int32")
    h = keras.layers.Embedding(20, 16)(tokens)
    if layer == "lstm":
        h = keras.layers.LSTM(16, return_sequences=True)(h)
    else:
        h = h + keras.layers.MultiHeadAttention(2, 8)(h, h, use_causal_mask=True)
    model = keras.Model(tokens, keras.layers.Dense(20)(h))

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    x = tf.random.stateless_uniform([16, 12], seed=[0, 1], maxval=20, dtype=tf.int32)
    opt = kg.KFAC(loss_fn, qmodel_batch_fraction=fraction)
    losses = [float(opt.step(x, x)) for _ in range(steps)]
    assert int(opt.skipped_steps) == 0, losses
    return losses


@pytest.mark.parametrize("layer", [pytest.param("lstm", marks=pytest.mark.slow), "attention"])
def test_a_quarter_of_the_batch_trains_sequence_models_as_the_whole_does(layer):
    quarter, whole = _sequence_model_losses(layer, 0.25), _sequence_model_losses(layer, 1.0)
    assert quarter[-1] < 0.9 * quarter[0], quarter
    assert abs(quarter[-1] - whole[-1]) < 0.05 * whole[0], (quarter, whole)


@pytest.mark.parametrize("bad", [0.0, 1.5, -0.25])
def test_qmodel_batch_fraction_is_validated(bad):
    fn = kg.auto_register(lambda x: tf.reduce_mean(tf.square(x)))
    with pytest.raises(ValueError, match="qmodel_batch_fraction"):
        kg.KFAC(fn, qmodel_batch_fraction=bad)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_leading_forms_come_with_the_first_examples_gradient_and_loss(reduction):
    """``Part``: the first examples' loss and ``g' . u`` against a tape on
    ``x[:n]`` (a penalty term reaches the kernel without passing the model
    output), times ``B / n`` for a summed loss."""
    reduce = tf.reduce_mean if reduction == "mean" else tf.reduce_sum
    loss_fn, x, y, reg, vectors = _softmax_problem(1, reduce, penalty=0.01)
    part = tf.function(lambda: exact_fisher.leading_forms(loss_fn, reg, (x, y), vectors, 0.4)[1],
                       autograph=False)()
    with tf.GradientTape() as tape:
        loss = loss_fn(x[:4], y[:4])
    grads = tape.gradient(loss, list(reg.variables))
    ratio = 1.0 if reduction == "mean" else 10 / 4
    np.testing.assert_allclose(part.loss.numpy(), ratio * loss.numpy(), rtol=1e-6)
    for u, got in zip(vectors, part.linear):
        want = ratio * sum(float(tf.reduce_sum(g * c)) for g, c in zip(grads, u))
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5)
