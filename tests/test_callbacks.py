"""Python callbacks in the loss: tf.py_function and tf.numpy_function between
two layers. A traced function's callbacks re-run in the re-imported graph
(their token names the traced Python function in this process): per-example
gradients equal the loop of one-example gradients, and the Fisher and the
optimizer equal those of the same model written without the callback. A
GraphDef's (or SavedModel's) callback, or a token no longer registered, is a
one-line KfacGraphError at registration (passes/callbacks.py)."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
import passes
from passes import callbacks
from passes.errors import KfacGraphError
from per_example_reference import one_example_loop

X = tf.random.stateless_normal([4, 4], [7, 8])
Y = tf.constant([0, 1, 2, 0])


def _layers():
    first, second = keras.layers.Dense(5, name="first"), keras.layers.Dense(3, name="second")
    first.build((None, 4))
    second.build((None, 5))
    return first, second


def _loss(first, second, middle):
    def loss_fn(x, y):
        h = middle(first(x))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, second(h)))
    return loss_fn


def _py_function(t):
    h = tf.py_function(tf.tanh, [t], tf.float32, name="foo")
    h.set_shape(t.shape)
    return h


def _numpy_function(t):
    h = tf.numpy_function(np.tanh, [t], tf.float32, name="bar")
    h.set_shape(t.shape)
    return h


@pytest.mark.parametrize("middle", [_py_function, _numpy_function],
                         ids=["py_function", "numpy_function"])
def test_per_example_gradients_equal_the_loop(middle):
    first, second = _layers()
    loss_fn = _loss(first, second, middle)
    fn = kg.auto_register(loss_fn)
    reg = fn.registration(X, Y)
    assert [layer.kind for layer in reg.layers] == ["dense", "dense"]
    got = kg.per_example_gradients(fn, X, Y)
    want = one_example_loop(loss_fn, (X, Y), reg.variables)
    for g, w, v in zip(got, want, reg.variables):
        assert g.shape == (4, *v.shape)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=v.name)
    if middle is _numpy_function:  # no gradient through numpy: zero, as the tape's None
        assert not np.any(got[0]) and not np.any(got[1])
    norms = kg.per_example_gradient_norms(fn, X, Y)
    want_norms = np.sqrt(sum(np.sum(np.reshape(w, (4, -1)) ** 2, 1) for w in want))
    np.testing.assert_allclose(norms, want_norms, rtol=1e-5)


def test_generic_variable_before_a_py_function_equals_the_loop():
    first, second = _layers()
    gate = tf.Variable(tf.linspace(0.5, 1.5, 5), name="gate")
    loss_fn = _loss(first, second, lambda t: _py_function(t * tf.sin(gate)))
    fn = kg.auto_register(loss_fn)
    reg = fn.registration(X, Y)
    assert "generic" in [layer.kind for layer in reg.layers]
    got = kg.per_example_gradients(fn, X, Y)
    for g, w in zip(got, one_example_loop(loss_fn, (X, Y), reg.variables)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode,samples", [("exact", 1), ("sampled", 2)])
def test_fisher_equals_the_model_without_the_callback(mode, samples):
    """Several backward passes through the callback (square-root columns, samples)."""
    first, second = _layers()
    blocks = []
    for middle in (_py_function, tf.tanh):
        estimator = kg.FisherEstimator(_loss(first, second, middle), estimation_mode=mode,
                                       num_samples=samples)
        estimator.update(X, Y)
        blocks.append([b.full_matrix().numpy() for b in estimator.blocks])
    for with_callback, plain in zip(*blocks):
        np.testing.assert_allclose(with_callback, plain, rtol=1e-5, atol=1e-7)


def test_kfac_step_equals_the_model_without_the_callback():
    results = []
    for middle in (_py_function, tf.tanh):
        first, second = _layers()
        for layer, seed in ((first, 1), (second, 2)):
            for k, v in enumerate(layer.trainable_variables):
                v.assign(tf.random.stateless_normal(v.shape, [seed, k]))
        opt = kg.KFAC(_loss(first, second, middle), learning_rate=0.1, damping=1e-2)
        loss = opt.step(X, Y)
        results.append([float(loss)] + [v.numpy() for v in opt.registration.variables])
    for with_callback, plain in zip(*results):
        np.testing.assert_allclose(with_callback, plain, rtol=1e-5, atol=1e-6)


# -- refused at registration ------------------------------------------------------------


def _graph_def_and_output(middle):
    first, second = _layers()
    concrete = tf.function(_loss(first, second, middle)).get_concrete_function(X, Y)
    return concrete.graph.as_graph_def(), concrete.outputs[0].name


@pytest.mark.parametrize("middle,api,name", [(_py_function, "tf.py_function", "foo"),
                                             (_numpy_function, "tf.numpy_function", "bar")])
def test_graph_def_callbacks_are_refused(middle, api, name):
    graph_def, output = _graph_def_and_output(middle)
    with pytest.raises(KfacGraphError) as info:
        passes.load_graph_def(graph_def, output)
    assert str(info.value) == (
        f"graph_def: {api} op '{name}' cannot be re-run by kfac_graph: a GraphDef does not "
        f"carry its Python function (token '{_token(graph_def)}'); register the Python "
        "function instead")


def test_a_token_no_longer_registered_is_refused():
    graph_def, _ = _graph_def_and_output(_py_function)
    for node in callbacks.callback_nodes(graph_def):
        node.attr["token"].s = b"pyfunc_not_registered"
    with pytest.raises(KfacGraphError) as info:
        callbacks.check_live_callbacks(graph_def, "loss_fn")
    assert str(info.value) == (
        "loss_fn: tf.py_function op 'foo' cannot be re-run by kfac_graph: its Python function "
        "(token 'pyfunc_not_registered') is no longer registered in this process (the graph "
        "that traced it is gone)")


def _token(graph_def):
    return callbacks.callback_nodes(graph_def)[0].attr["token"].s.decode()


def test_saved_model_callbacks_are_refused(tmp_path):
    first, second = _layers()
    module = tf.Module()
    module.layers = [first, second]
    signature = [tf.TensorSpec([None, 4]), tf.TensorSpec([None], tf.int32)]
    module.loss = tf.function(_loss(first, second, _py_function), input_signature=signature)
    tf.saved_model.save(module, str(tmp_path))
    with pytest.raises(KfacGraphError,
                       match=r"^loss: tf.py_function op '[\w/]*foo' cannot be re-run by "
                             r"kfac_graph: the SavedModel at .* does not carry its Python "
                             r"function \(token 'pyfunc_\d+'\); register the Python function "
                             r"instead$"):
        passes.load_saved_model(str(tmp_path), "loss")
