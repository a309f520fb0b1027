"""TensorFlow's sampled losses, ``tf.nn.sampled_softmax_loss`` and
``tf.nn.nce_loss``: both look the output weights up at ``concat([labels,
sampled])``, ``[B + S]`` rows for a batch of B, and the S sampled rows meet
every example. That lookup is no embedding (before, it registered as one,
and per-example gradients stopped on a leading axis of B + S): the weights
are generic, with a reason that says so, and their per-example gradients
equal a loop of one-example tapes (float64, the samples fixed). The NCE
loss sums its logistic terms by a matmul with a column of ones, read as a
sum: a Bernoulli likelihood whose Fisher K-FAC uses (before, opaque, which
K-FAC refused). K-FAC with the defaults lowers both losses with fresh
samples every step.
"""
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg

B, D, H, V, S = 6, 4, 5, 30, 7
LOSSES = {"sampled_softmax": (tf.nn.sampled_softmax_loss, "categorical"),
          "nce": (tf.nn.nce_loss, "bernoulli")}


def _problem(dtype, batch=B):
    rng = np.random.default_rng(0)
    variables = [tf.Variable(rng.standard_normal(shape).astype(dtype) * scale, name=name)
                 for name, shape, scale in (("w1", (D, H), 0.5), ("w_out", (V, H), 0.3),
                                            ("b_out", (V,), 0.1))]
    x = tf.constant(rng.standard_normal((batch, D)).astype(dtype))
    labels = tf.constant(rng.integers(0, V, (batch, 1)), tf.int64)
    return variables, x, labels


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_per_example_gradients_equal_the_loop(name):
    sampled_loss, kind = LOSSES[name]
    variables, x, labels = _problem(np.float64)
    w1, w_out, b_out = variables
    sampled = tf.constant(np.random.default_rng(1).choice(V, S, replace=False), tf.int64)

    def loss(x, labels):
        expected = (tf.fill(tf.shape(labels), tf.constant(0.2, tf.float64)),
                    tf.fill([S], tf.constant(0.2, tf.float64)))
        return tf.reduce_mean(sampled_loss(w_out, b_out, labels, tf.tanh(x @ w1), num_sampled=S,
                                           num_classes=V, sampled_values=(sampled, *expected)))

    fn = kg.auto_register(loss)
    reg = fn.registration(x, labels)
    assert reg.loss.kind == kind
    kinds = {layer.variables[0].name: layer.kind for layer in reg.layers}
    assert kinds == {"w1:0": "dense", "w_out:0": "generic", "b_out:0": "generic"}
    assert "13 rows for a batch of 6" in reg.summary()
    got = kg.per_example_gradients(fn, x, labels)
    for k, v in enumerate(variables):
        want = []
        for i in range(B):
            with tf.GradientTape() as tape:
                one = loss(x[i:i + 1], labels[i:i + 1])
            want.append(tf.convert_to_tensor(tape.gradient(one, v)).numpy())
        np.testing.assert_allclose(got[k].numpy(), np.stack(want), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_kfac_lowers_the_loss_with_fresh_samples(name):
    sampled_loss, _ = LOSSES[name]
    variables, x, labels = _problem(np.float32, batch=32)
    w1, w_out, b_out = variables
    tf.random.set_seed(0)
    fn = kg.auto_register(lambda x, labels: tf.reduce_mean(sampled_loss(
        w_out, b_out, labels, tf.tanh(x @ w1), num_sampled=S, num_classes=V)))
    opt = kg.KFAC(fn)
    losses = [float(opt.step(x, labels)) for _ in range(20)]
    assert int(opt.skipped_steps) == 0
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
