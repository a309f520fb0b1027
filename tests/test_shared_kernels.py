"""Blocks of one structure share one traced kernel (``fisher/shared_kernels.py``):
the step trains exactly as with every block's algebra traced in place, and
its graph is smaller."""
import collections

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph.fisher import shared_kernels


def _model():
    """Repeated layers (two equal convolutions, three equal dense layers, each
    normalised) and single ones, in float64: eight Kronecker blocks of five
    structures."""
    keras.utils.set_random_seed(3)
    x = keras.Input((6, 6, 2), dtype="float64")
    h = keras.layers.Conv2D(3, 3, padding="same", dtype="float64")(x)
    for _ in range(2):
        h = keras.layers.Conv2D(3, 3, padding="same", activation="tanh", dtype="float64")(h)
    h = keras.layers.BatchNormalization(dtype="float64")(h)
    h = keras.layers.Flatten(dtype="float64")(h)
    h = keras.layers.Dense(12, activation="tanh", dtype="float64")(h)
    for _ in range(3):
        h = keras.layers.Dense(12, activation="tanh", dtype="float64")(h)
        h = keras.layers.LayerNormalization(dtype="float64")(h)
    return keras.Model(x, keras.layers.Dense(5, dtype="float64")(h))


def _data():
    rng = np.random.default_rng(0)
    return tf.constant(rng.normal(size=(16, 6, 6, 2))), tf.constant(rng.integers(0, 5, 16))


def _optimizer(model, share, **options):
    def loss(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    opt = kg.KFAC(loss, inverse_update_period=2, **options)
    opt.build(*_data())
    if not share:
        shared_kernels.share(opt.estimator.blocks, shared_kernels.IN_PLACE)
    return opt


@pytest.mark.parametrize("options", [
    pytest.param(dict(momentum_type="regular", adapt_damping=False), marks=pytest.mark.slow),
    dict(factor_block_size=8, max_factor_size=20),  # blocked and diagonal factors; the defaults
])
def test_shared_kernels_train_exactly_as_in_place_with_a_smaller_graph(options):
    runs = {}
    for share in (True, False):
        model = _model()
        opt = _optimizer(model, share, **options)
        for _ in range(4):
            opt.step(*_data())
        assert int(opt.skipped_steps) == 0
        graph = opt._compiled.step.get_concrete_function(*_data()).graph.as_graph_def()
        size = len(graph.node) + sum(len(f.node_def) for f in graph.library.function)
        runs[share] = ([v.numpy() for v in model.trainable_variables], size, opt)
    for shared, in_place in zip(runs[True][0], runs[False][0]):
        np.testing.assert_allclose(shared, in_place, rtol=1e-10, atol=1e-12)
    assert runs[True][1] < runs[False][1]
    traced = collections.Counter(runs[True][2].estimator.blocks[0].kernels.traced())
    assert traced["kron_inverses"] == 5
    assert shared_kernels.IN_PLACE.traced() == []


def test_a_kernel_reading_a_variable_is_an_error_while_tracing():
    kernels = shared_kernels.SharedKernels()
    outside = tf.Variable(2.0)

    @tf.function
    def step(x):
        return kernels(("scaled",), lambda x: x * outside, x)

    with pytest.raises(RuntimeError, match="shared kernel 'scaled' reads"):
        step(tf.constant(1.0))


def test_kernels_share_one_trace_per_structure_and_run_in_place_eagerly():
    kernels = shared_kernels.SharedKernels()
    calls = []

    def double(x):
        calls.append(1)
        return 2.0 * x

    assert float(kernels(("double",), double, tf.constant(1.0))) == 2.0  # eager: in place
    assert kernels.traced() == []

    @tf.function
    def step(a, b, c):
        return (kernels(("double",), double, a), kernels(("double",), double, b),
                kernels(("double",), double, c))

    out = step(tf.constant(1.0), tf.constant(2.0), tf.constant([3.0, 4.0]))
    assert [o.numpy().tolist() for o in out] == [2.0, 4.0, [6.0, 8.0]]
    assert kernels.traced() == ["double", "double"]  # one per shape
    assert len(calls) == 1 + 2


def test_blocks_made_anew_get_kernels_of_their_own():
    """A traced kernel holds the first block of its structure: blocks made
    anew (another factor block size) must not keep the old ones alive
    through it, nor share with them."""
    opt = _optimizer(_model(), share=True)
    old = opt.estimator.blocks[0].kernels
    assert all(b.kernels is old for b in opt.estimator.blocks)
    opt.estimator.use_factor_block_size(4)
    new = opt.estimator.blocks[0].kernels
    assert new is not old and all(b.kernels is new for b in opt.estimator.blocks)
    assert all(f.kernels is new for b in opt.estimator.blocks for f in b.submodules
               if hasattr(f, "kernels"))
