"""Layers on a time-major tensor ``[T, B, d]`` (``passes/example_rows.py``
follows the batch axis from the arguments through transposes and row-wise
ops; ``passes/unflatten_rows.py`` records each use by it).

Every rule reads its input's first axis as the examples. On ``[T, B, d]``
with ``T != B`` that stopped at a one-line error ("leading axis"); with
``T = B`` the shapes alone passed and the per-example gradients came back
wrong, with no error. Now a dense layer there moves the batch axis first
(``batch_axis``) and is exact; a kind that reads its first axis as the
examples and cannot move it (a scale, a shift, a norm, an embedding) is
generic, with the reason, and exact. Checked in float64 against a loop of
one-example gradients, and the dense layer's exact Fisher block against
brute force."""
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from fisher_reference import brute_fisher, softmax_fisher
from per_example_reference import assert_matches_loop

B, D, C = 3, 4, 2


def _model(layer, steps):
    """``x [B, T, D]`` made time-major, ``layer`` applied there, a tanh, the
    mean over time, a head."""
    keras = pytest.importorskip("keras")
    keras.config.set_floatx("float64")  # conftest restores the dtypes
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    w = tf.Variable(rng.normal(size=(D, D)), name="w")
    bias = tf.Variable(rng.normal(size=(D,)), name="bias")
    table = tf.Variable(rng.normal(size=(7, D)), name="table")
    head = tf.Variable(rng.normal(size=(D, C)), name="head")
    norm = keras.layers.LayerNormalization()
    apply = {
        "dense": lambda tm: tm @ w,
        "dense_bias": lambda tm: tm @ w + bias,
        "einsum": lambda tm: tf.einsum("tbd,de->tbe", tm, w),
        "shift": lambda tm: tm + bias,
        "scale": lambda tm: tm * bias,
        "layer_norm": norm,
    }

    def logits(x, ids):
        tm = tf.transpose(x, [1, 0, 2])  # [T, B, D]
        if layer == "embedding":
            h = tm + tf.gather(tf.identity(table), tf.transpose(ids))  # ids [T, B]
        else:
            h = apply[layer](tm)
        return tf.reduce_mean(tf.tanh(h), axis=0) @ head

    @kg.auto_register
    def loss_fn(x, ids, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits(x, ids)))

    args = (tf.constant(rng.normal(size=(B, steps, D))),
            tf.constant(rng.randint(0, 7, (B, steps))), tf.constant([0, 1, 1]))
    return loss_fn, logits, w, args


@pytest.mark.parametrize("steps", [B, 5], ids=["T_equals_B", "T_5"])
@pytest.mark.parametrize("layer", ["dense", "dense_bias", "einsum"])
def test_dense_on_time_major(layer, steps):
    loss_fn, logits, w, args = _model(layer, steps)
    reg = loss_fn.registration(*args)
    (dense,) = [layer for layer in reg.layers if layer.variables[0] is w]
    assert dense.kind == "dense" and dense.use_attrs[0]["batch_axis"] == 1, reg.summary()
    assert not [layer for layer in reg.layers if layer.kind == "generic"], reg.summary()
    assert_matches_loop(loss_fn, args)
    params = list(dense.variables)
    want = brute_fisher(lambda p, x: logits(x, args[1]), params, args[0], softmax_fisher)
    est = kg.FisherEstimator(loss_fn, estimation_mode="exact", approximations={"dense": "full"})
    est.update(*args)
    np.testing.assert_allclose(est.blocks[reg.layers.index(dense)].full_matrix(), want,
                               rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("steps", [B, 5], ids=["T_equals_B", "T_5"])
@pytest.mark.parametrize("layer", ["shift", "scale", "layer_norm", "embedding"])
def test_other_kinds_on_time_major_are_generic(layer, steps):
    loss_fn, _, _, args = _model(layer, steps)
    reg = loss_fn.registration(*args)
    generic = [layer for layer in reg.layers if layer.kind == "generic"]
    assert generic and all("axis 1" in layer.reason for layer in generic), reg.summary()
    assert_matches_loop(loss_fn, args)


def test_time_major_dense_trains():
    loss_fn, _, _, args = _model("dense_bias", B)
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(8)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses


@pytest.mark.parametrize("steps", [B, 5], ids=["T_equals_B", "T_5"])
def test_time_major_loss_is_refused(steps):
    """A per-token loss on a time-major output ``[T, B, C]``: the per-token
    Fisher, the per-example loss terms and their normalisation read the
    examples on the output's first axis, so registration refuses it in one
    line (before, with ``T = B``, the full Fisher block and a generic
    variable's per-example gradients were wrong, with no error)."""
    rng = np.random.RandomState(1)
    w = tf.Variable(rng.normal(size=(D, C)), name="w")

    @kg.auto_register
    def loss_fn(x, y):
        logits = tf.transpose(x, [1, 0, 2]) @ w  # [T, B, C]
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            tf.transpose(y), logits))

    args = (tf.constant(rng.normal(size=(B, steps, D))),
            tf.constant(rng.randint(0, C, (B, steps))))
    with pytest.raises(kg.KfacGraphError, match="time-major") as error:
        loss_fn.registration(*args)
    assert "\n" not in str(error.value)
