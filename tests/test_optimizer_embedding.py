"""kg.KFAC with its defaults (the quadratic model's exact Fisher forms, a
double backward pass) on a model with a Keras Embedding, whose gradient is
an IndexedSlices."""
import keras
import numpy as np
import tensorflow as tf

import kfac_graph as kg
from kfac_graph.optimizer import exact_fisher


def _model_and_loss():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(11, 4),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])

    @kg.auto_register
    def loss_fn(ids, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(ids)))

    ids = tf.random.stateless_uniform([8, 5], [1, 2], maxval=11, dtype=tf.int32)
    y = tf.random.stateless_uniform([8], [3, 4], maxval=3, dtype=tf.int32)
    return model, loss_fn, (ids, y)


def test_exact_fisher_forms_through_an_embedding():
    _, loss_fn, args = _model_and_loss()
    reg = loss_fn.registration(*args)
    u = [tf.ones(v.shape, v.dtype) for v in reg.variables]
    forms = tf.function(lambda *a: exact_fisher.quadratic_forms(reg, a, [u]))(*args)
    assert np.isfinite(float(forms[0][0])) and float(forms[0][0]) > 0


def test_default_kfac_trains_an_embedding_model():
    model, loss_fn, args = _model_and_loss()
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(5)]
    assert all(np.isfinite(losses)) and int(opt.skipped_steps) == 0
    assert losses[-1] < losses[0]
