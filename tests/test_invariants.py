"""Never silently wrong: a per-example result or Fisher statistic whose shape
no rule promised is a one-line KfacGraphError naming the layer, its kind and
its op (kfac_graph/invariants.py); the generic fallback is right or refuses."""
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph import invariants
from kfac_graph.fisher import factors_base
from passes.errors import KfacGraphError
from per_example_reference import one_example_loop

B = 8
UNSUPPORTED = "; this layer form is not supported"


def _assert_equal_loop(fn, loss_fn, args):
    reg = fn.registration(*args)
    got = kg.per_example_gradients(fn, *args)
    want = one_example_loop(loss_fn, args, reg.variables)
    for g, w, v in zip(got, want, reg.variables):
        assert g.shape == (args[0].shape[0], *v.shape), v.name
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=v.name)
    norms = kg.per_example_gradient_norms(fn, *args)
    want_norms = np.sqrt(sum(np.sum(np.reshape(w, (w.shape[0], -1)) ** 2, 1) for w in want))
    np.testing.assert_allclose(norms, want_norms, rtol=1e-4)


def _conv_net(layer, shape):
    model = keras.Sequential([keras.Input(shape), layer, keras.layers.Flatten(name="flat"),
                              keras.layers.Dense(3, name="head")], name="net")

    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    x = tf.random.stateless_normal([B, *shape], [1, 2])
    y = tf.constant(np.arange(B) % 3)
    return loss_fn, (x, y)


def _raises_line(pattern, call):
    with pytest.raises(KfacGraphError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    assert re.fullmatch(pattern, message), message


# -- a conv applied to a space-to-batch view, interleaved back by hand: its op sees 2B rows ---
# (with BatchToSpaceND it is a dilated convolution and works: tests/test_dilated_conv.py)

PHASES = r"layer phases\w* \(conv2d, op phases\w*/convolution\): "


def _phases_net():
    conv, head = keras.layers.Conv1D(4, 3, name="phases"), keras.layers.Dense(3, name="head")

    def loss_fn(x, y):
        h = conv(tf.space_to_batch(x, [2], [[0, 0]]))  # [2B, 4, 4]: two phases per example
        h = tf.reshape(tf.transpose(tf.reshape(h, [2, B, 4, 4]), [1, 2, 0, 3]), [B, 32])
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, head(h)))

    return kg.auto_register(loss_fn), (tf.random.stateless_normal([B, 12, 2], [1, 2]),
                                       tf.constant(np.arange(B) % 3))


def test_conv_on_phases_refuses_per_example_gradients_norms_and_fisher():
    fn, args = _phases_net()
    assert fn.registration(*args).layers[0].kind == "conv2d"
    _raises_line(PHASES + r"per-example gradient of phases\w*/kernel has leading "
                 r"axis 2B=16, expected the batch 8" + UNSUPPORTED,
                 lambda: kg.per_example_gradients(fn, *args))
    _raises_line(PHASES + r"per-example squared norm has leading axis 2B=16, expected the "
                 r"batch 8" + UNSUPPORTED, lambda: kg.per_example_gradient_norms(fn, *args))
    for approximation in ("kron", "diagonal", "full"):
        estimator = kg.FisherEstimator(fn, approximations={"conv2d": approximation})
        _raises_line(PHASES + r"layer input has leading axis 2B=16, expected the batch 8"
                     + UNSUPPORTED, lambda: estimator.update(*args))


def test_conv_on_phases_refuses_under_xla():
    fn, args = _phases_net()
    compiled = tf.function(lambda *a: kg.per_example_gradients(fn, *a), jit_compile=True,
                           autograph=False)
    _raises_line(PHASES + r".*2B=16, expected the batch 8" + UNSUPPORTED,
                 lambda: compiled(*args))


def test_plain_conv1d_still_right_and_its_fisher_builds():
    loss_fn, args = _conv_net(keras.layers.Conv1D(4, 3, name="plain"), (12, 2))
    fn = kg.auto_register(loss_fn)
    _assert_equal_loop(fn, loss_fn, args)
    for approximation in ("kron", "diagonal"):
        estimator = kg.FisherEstimator(fn, approximations={"conv2d": approximation})
        assert np.isfinite(float(estimator.update(*args)))


# -- tables and the generic fallback --------------------------------------------------

V, T, D = 7, 5, 6


def _token_model():
    tokens = keras.layers.Embedding(V, D, name="tokens")
    head = keras.layers.Dense(V, name="head")
    tokens.build((None,))
    head.build((None, D))
    ids = tf.constant(np.arange(4 * T).reshape(4, T) % V)
    y = tf.constant((np.arange(4 * T).reshape(4, T) * 3) % V)
    return tokens, head, (ids, y)


def test_embedding_read_without_a_batch_axis_is_generic_and_exact():
    """A lookup of un-batched ids that is not added over the batch (a product
    here; an added one is a position embedding, tests/test_transformer_layers.py)
    has no example axis: the pass leaves its table generic with the reason
    (``passes/lookup_ids.py``), and its per-example gradients are exact."""
    tokens, head, args = _token_model()
    positions = keras.layers.Embedding(T, D, name="positions")
    positions.build((None,))

    def loss_fn(ids, y):
        logits = head(tokens(ids) * positions(tf.range(T)))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    fn = kg.auto_register(loss_fn)
    reg = fn.registration(*args)
    generic = [layer for layer in reg.layers if layer.kind == "generic"]
    assert len(generic) == 1 and "do not depend on the data" in generic[0].reason
    got = kg.per_example_gradients(fn, *args)
    for g, w in zip(got, one_example_loop(loss_fn, args, reg.variables)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
    kg.FisherEstimator(fn).update(*args)


@pytest.mark.parametrize("flatten", [True, False], ids=["terms_BT", "terms_B_T"])
def test_generic_variable_with_a_per_token_loss_equals_the_loop(flatten):
    """Per-token terms flattened to [B*T] are summed per example ([B, T])."""
    tokens, head, args = _token_model()
    table = tf.Variable(tf.random.stateless_normal([T, D], [3, 4]), name="table")

    def loss_fn(ids, y):
        logits = head(tokens(ids) + tf.sin(table))  # the table has no batch axis
        if flatten:
            y, logits = tf.reshape(y, [-1]), tf.reshape(logits, [-1, V])
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    fn = kg.auto_register(loss_fn)
    assert [layer.kind for layer in fn.registration(*args).layers][1] == "generic"
    _assert_equal_loop(fn, loss_fn, args)
    assert np.isfinite(float(kg.FisherEstimator(fn).update(*args)))


def test_generic_variable_outside_the_examples_terms_gets_its_penalty_gradient():
    """A variable the examples' terms do not read, penalised on the reduced
    loss: each example's gradient is the penalty's (the loss on that example
    alone holds it)."""
    dense = keras.layers.Dense(3, name="dense")
    dense.build((None, 4))
    penalty = tf.Variable(tf.ones([2]), name="penalty")

    def loss_fn(x, y):
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(y, dense(x))
        return tf.reduce_mean(ce) + 0.1 * tf.reduce_sum(tf.exp(penalty))

    args = (tf.random.stateless_normal([4, 4], [5, 6]), tf.constant([0, 1, 2, 0]))
    grads = kg.per_example_gradients(kg.auto_register(loss_fn), *args)
    assert grads[-1].shape == (4, 2)
    np.testing.assert_allclose(grads[-1], np.tile(0.1 * np.exp(penalty.numpy()), (4, 1)),
                               rtol=1e-6)


def test_generic_variable_without_per_example_terms_refuses():
    dense = keras.layers.Dense(3, name="dense")
    dense.build((None, 4))
    scale = tf.Variable(tf.ones([3]), name="scale")

    def loss_fn(x):
        return tf.reduce_mean(tf.exp(dense(x) * tf.sin(scale)))

    fn = kg.auto_register(loss_fn, loss="normal")
    _raises_line(r"generic variable scale: its per-example gradients cannot be computed: the "
                 r"loss pass found no per-example loss terms",
                 lambda: kg.per_example_gradients(fn, tf.ones([4, 4])))


# -- the checks themselves ------------------------------------------------------------------


class _Layer:
    name, kind, ops, outputs = "conv", "conv2d", (("conv/Conv2D",),), ("conv/Conv2D:0",)


def test_variable_shape_allows_only_unit_axes():
    kernel = tf.Variable(tf.zeros([3, 2, 4]), name="kernel")
    context = invariants.where(_Layer())
    assert context == "layer conv (conv2d, op conv/Conv2D)"
    out = invariants.to_variable_shape(tf.zeros([5, 1, 3, 2, 4]), kernel, 5, context)
    assert out.shape == (5, 3, 2, 4)
    with pytest.raises(KfacGraphError, match=r"^layer conv \(conv2d, op conv/Conv2D\): "
                       r"per-example gradient of kernel has shape \[B, 3, 4, 2\], expected "
                       r"\[B, 3, 2, 4\]; this layer form is not supported$"):
        invariants.to_variable_shape(tf.zeros([5, 3, 4, 2]), kernel, 5, context)
    with pytest.raises(KfacGraphError, match=r"has leading axis 3B=15, expected the batch 5"):
        invariants.to_variable_shape(tf.zeros([15, 3, 2, 4]), kernel, 5, context)


def test_dynamic_batch_is_checked_in_the_graph():
    kernel = tf.Variable(tf.zeros([2, 3]), name="kernel")
    spec = tf.TensorSpec([None, 2, 3])

    @tf.function(input_signature=[spec, tf.TensorSpec([None])], autograph=False)
    def checked(g, x):
        batch = tf.shape(x)[0]
        context = "layer k (dense, op k/MatMul)"
        return (invariants.to_variable_shape(g, kernel, batch, context),
                invariants.batch_vector(tf.reduce_sum(g, [1, 2]), batch, context))

    grads, norms = checked(tf.ones([4, 2, 3]), tf.ones([4]))
    assert grads.shape == (4, 2, 3) and norms.shape == (4,)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"layer k \(dense, op k/MatMul\): per-example gradient of kernel "
                             r"does not have the batch as its leading axis; this layer form is "
                             r"not supported"):
        checked(tf.ones([8, 2, 3]), tf.ones([4]))


def test_dynamic_batch_under_xla_fails_to_compile_not_silently():
    """XLA drops the assertion; the reshape to [B, ...] cannot compile."""
    kernel = tf.Variable(tf.zeros([2, 3]), name="kernel")

    @tf.function(input_signature=[tf.TensorSpec([None, 2, 3]), tf.TensorSpec([None])],
                 jit_compile=True, autograph=False)
    def checked(g, x):
        return invariants.to_variable_shape(g, kernel, tf.shape(x)[0], "layer k (dense, op k)")

    assert checked(tf.ones([4, 2, 3]), tf.ones([4])).shape == (4, 2, 3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="reshape"):
        checked(tf.ones([8, 2, 3]), tf.ones([4]))


def test_factor_rows_of_another_width_raise():
    factor = factors_base.CovarianceFactor(4, name="factor")
    with pytest.raises(invariants.FactorShapeError,
                       match=r"^factor factor got rows \[6, 5\], expected \[N, 4\]$"):
        factor.update_rows([[tf.zeros([6, 5])]], 0.9)
    with pytest.raises(invariants.FactorShapeError, match=r"expected \[N, 3\]"):
        factor.update_rows([[tf.zeros([6, 4])]], 0.9, ones=True)
    grouped = factors_base.CovarianceFactor(4, groups=2, name="grouped")
    with pytest.raises(invariants.FactorShapeError, match=r"expected \[N, 2, 4\]"):
        grouped.update_rows([[tf.zeros([6, 3, 4])]], 0.9)
    factor.update_rows([[tf.ones([6, 4])]], 0.9)
    np.testing.assert_allclose(factor.value(), np.ones([4, 4]))
