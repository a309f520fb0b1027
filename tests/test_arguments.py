"""Arguments of every form a loss function takes.

Python values beside the tensors (a ``training`` flag, a scale, None, a
string, also inside a dict; the Keras model, a function) are constants of
the trace, as ``tf.function`` makes them: per-example gradients,
``kg.verify``, ``kg.KFAC`` (also under XLA) and ``kg.DPSGD`` run with them.
Before, each stopped on "expected 2 argument tensors, got 3".

Sparse and ragged arguments (a Keras ``Input(sparse=True)``, a TF-IDF
batch) are refused in one line that names the argument and the two ways
on. Before, the registration read the sparse indices' first axis (the
nonzeros) as the examples: the first Dense's kernel turned generic with a
wrong reason, and per-example gradients, ``kg.verify`` and ``kg.DPSGD``
stopped on a reshape of 8 examples into 49 rows, ``kg.KFAC`` on a
conversion error. Both ways on the message names are checked here: the
dense tensor, and the sparse tensor made inside the function."""
import numpy as np
import pytest
import tensorflow as tf
import keras

import kfac_graph as kg

B, D, C = 8, 30, 3


@pytest.fixture()
def problem():
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    rng = np.random.default_rng(0)
    x = (rng.random((B, D)) < 0.2) * rng.normal(size=(B, D))
    inputs = keras.Input((D,), sparse=True)
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(C)(hidden))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, loss, tf.constant(x), tf.constant(rng.integers(0, C, B))


def test_sparse_and_ragged_arguments_are_refused_in_one_line(problem):
    model, loss, x, y = problem
    loss_fn = kg.auto_register(lambda x, y: loss(y, model(x)))
    sparse = tf.sparse.from_dense(x)
    calls = [lambda: kg.per_example_gradients(loss_fn, sparse, y),
             lambda: kg.KFAC(loss_fn).step(sparse, y),
             lambda: kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1.0,
                              noise_multiplier=1.0, seed=0).step(sparse, y),
             lambda: kg.verify(loss_fn, sparse, y)]
    for call in calls:
        with pytest.raises(kg.TraceError, match=r"argument 0 is a tf.SparseTensor, .*"
                                                r"tf.sparse.to_dense\(x\)") as error:
            call()
        assert "\n" not in str(error.value)
    ragged = kg.auto_register(lambda ids, y: tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, model(tf.reduce_sum(tf.one_hot(ids, D, dtype=tf.float64), axis=1)))))
    ids = tf.ragged.constant([[1, 2], [3], [4, 5, 6], [7], [8], [9], [1], [2, 2]])
    with pytest.raises(kg.TraceError, match=r"argument 0 is a tf.RaggedTensor"):
        kg.per_example_gradients(ragged, ids, y)


def test_a_saved_model_with_a_sparse_signature_is_refused(problem, tmp_path):
    model, loss, x, y = problem
    module = tf.Module()
    module.model = model
    module.loss = tf.function(lambda x, y: loss(y, model(x)), input_signature=[
        tf.SparseTensorSpec([None, D], tf.float64), tf.TensorSpec([None], tf.int64)])
    tf.saved_model.save(module, str(tmp_path))
    with pytest.raises(kg.LoadError, match=r"'loss' in .*: argument 0 is a tf.SparseTensor"):
        kg.register_saved_model(str(tmp_path), "loss")


def _assert_exact(loss_fn, x, y):
    assert kg.verify(loss_fn, x, y).passed
    grads = kg.per_example_gradients(loss_fn, x, y)
    variables = loss_fn.registration(x, y).variables
    for i in range(B):
        with tf.GradientTape() as tape:
            value = loss_fn(x[i:i + 1], y[i:i + 1])
        for g, ref in zip(grads, tape.gradient(value, variables)):
            np.testing.assert_allclose(g[i], tf.convert_to_tensor(ref), rtol=1e-10, atol=1e-13)


def test_the_dense_tensor_gives_the_sparse_models_gradients_and_trains(problem):
    model, loss, x, y = problem
    loss_fn = kg.auto_register(lambda x, y: loss(y, model(x)))
    reg = loss_fn.registration(x, y)
    assert [layer.kind for layer in reg.layers] == ["dense", "dense"]
    np.testing.assert_allclose(loss_fn(x, y), loss(y, model(tf.sparse.from_dense(x))), rtol=1e-14)
    _assert_exact(loss_fn, x, y)
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(x, y)) for _ in range(4)]
    assert losses[-1] < 0.5 * losses[0] and int(opt.skipped_steps) == 0


def test_a_sparse_tensor_made_inside_the_function_is_exact(problem):
    model, loss, x, y = problem
    loss_fn = kg.auto_register(lambda x, y: loss(y, model(tf.sparse.from_dense(x))))
    _assert_exact(loss_fn, x, y)
    dp = kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=0.5, seed=1)
    assert np.isfinite(float(dp.step(x, y)))


@pytest.mark.parametrize("extra", [pytest.param(True, marks=pytest.mark.slow), None, "scaled"])
def test_python_constants_beside_the_tensors(problem, extra):
    model, loss, x, y = problem

    def loss_fn(inputs, y, extra):
        value = loss(y, model(inputs["x"]))
        return value * 2.0 if extra == "scaled" or inputs["flag"] else value
    loss_fn = kg.auto_register(loss_fn)
    args = ({"x": x, "flag": extra is True}, y, extra)
    assert kg.verify(loss_fn, *args).passed
    for jit_compile in (False, True) if extra is True else (False,):
        opt = kg.KFAC(loss_fn, jit_compile=jit_compile)
        losses = [float(opt.step(*args)) for _ in range(3)]
        assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0
    dp = kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=0.5, seed=1)
    assert np.isfinite(float(dp.step(*args)))


def test_the_model_and_a_function_as_arguments(problem):
    """``loss(model, x, y, activation)``: the model and the function are
    Python objects, constants of the trace; a NumPy scalar is a tensor."""
    model, loss, x, y = problem
    loss_fn = kg.auto_register(lambda model, x, y, f, s: loss(y, f(model(x))) * s)
    args = (model, x, y, tf.nn.softplus, np.float64(2.0))
    assert kg.verify(loss_fn, *args).passed
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(3)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0
    dp = kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=0.5, seed=1)
    assert np.isfinite(float(dp.step(*args)))
