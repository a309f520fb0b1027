"""Joined outputs at a length read at run time (BERT's pre-training loss
traced with ``[None, None]`` ids: a SavedModel's signature, ``kfac-rewrite``,
or the relaxed step of a new length).

A masked-LM head over ``[B, T, V]`` beside a next-sentence head over
``[B, 2]`` joins two outputs (``passes.joined_outputs``). Their loss
Hessian was formed only at static sizes, so at an unknown length the loss
stayed opaque ("the outputs ... have sizes not known statically"):
``kg.KFAC`` stopped, and a relaxed step of a new length kept a trace of its
own. Beyond ``MAX_CLASSES`` values it is formed in blocks, one ``V x V``
per position (a cross-entropy op is per position of its logits) and one
``2 x 2``: the joined width and the one block's positions are read at run
time. The steps there equal those at known sizes (float64), where the
blocks equal brute force. The budget is lowered to 10 values here so that
tiny shapes take the blocks' path. (Both heads are categorical, so their
blocks are their likelihoods' Fishers, with no backward pass: a word-piece
vocabulary, ``tests/test_joined_likelihood_blocks.py``.)"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from joined_reference import assert_joined_blocks
from passes import loss_output

V = 7
ce = tf.nn.sparse_softmax_cross_entropy_with_logits


@pytest.fixture
def blocks_beyond_ten(monkeypatch, keras_float64):
    monkeypatch.setattr(loss_output, "MAX_CLASSES", 10)


def _model():
    keras.utils.set_random_seed(0)
    ids = keras.Input((None,), dtype="int32")
    h = keras.layers.Dense(6, activation="tanh", name="trunk")(keras.layers.Embedding(V, 4)(ids))
    return keras.Model(ids, [keras.layers.Dense(V, name="tokens")(h),
                             keras.layers.Dense(2, name="pair")(h[:, 0])])


def _loss(model, signature=None):
    def loss(x, y):
        tokens, pair = model(x)
        return tf.reduce_mean(ce(y, tokens)) + tf.reduce_mean(ce(y[:, 0] % 2, pair))
    return kg.auto_register(loss if signature is None else tf.function(
        loss, input_signature=signature))


def _batches():
    rng = np.random.default_rng(0)
    return [tuple(tf.constant(rng.integers(0, V, (b, t)), tf.int32) for _ in range(2))
            for b, t in [(4, 5), (4, 7), (3, 6), (4, 5)]]


def _train(signature=None, **options):
    model = _model()
    opt = kg.KFAC(_loss(model, signature), **options)
    losses = [float(opt.step(*batch)) for batch in _batches()]
    return losses, [v.numpy() for v in model.trainable_variables], opt


EXACT = dict(estimation_mode="exact", momentum_type="regular", learning_rate=0.1, damping=0.1)
UNKNOWN = [tf.TensorSpec([None, None], tf.int32)] * 2


# under -m slow (about 30 s): kg.KFAC's defaults on a joined pre-training loss at run-time
# lengths stay in the fast set (test_joined_likelihood_blocks.py)
@pytest.mark.slow
@pytest.mark.parametrize("options", [EXACT, {}], ids=["exact_regular", "defaults"])
def test_joined_heads_at_a_run_time_length_step_as_at_known_ones(blocks_beyond_ten, options):
    reg = _loss(_model(), UNKNOWN).registration(*UNKNOWN)
    assert (reg.loss.kind, reg.loss.blocks) == ("ggn", ((None, V), (2, 2))), reg.summary()
    assert "in blocks ?x(7x7) categorical, 2x2 categorical" in reg.summary()
    static = _train(relax_shapes=False, **options)  # a trace per shape, (35, 7) at T = 5
    unknown = _train(UNKNOWN, **options)
    relaxed = _train(**options)
    for got in (unknown, relaxed):
        np.testing.assert_allclose(got[0], static[0], rtol=1e-10)
        for a, b in zip(got[1], static[1]):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    start = [v.numpy() for v in _model().trainable_variables]
    assert max(np.abs(a - b).max() for a, b in zip(static[1], start)) > 1e-2
    # the relaxed step: the first shape's trace and one at [4, None], widened to [None, None]
    assert relaxed[2]._compiled.step.experimental_get_tracing_count() == 3
    assert int(unknown[2].skipped_steps) == 0


def test_a_cross_entropy_per_token_is_a_block_per_position(blocks_beyond_ten):
    """At known sizes beyond the budget, the masked-LM head's cross-entropy
    (before: taken as mixing positions, so the whole ``35 + 2`` values, over
    the budget: opaque) is one ``7 x 7`` block per position: with one column
    per position and class, the exact full blocks of the trunk and both
    heads equal the brute-force Gauss-Newton blocks."""
    model = _model()
    fn = _loss(model)
    args = _batches()[0]
    reg = assert_joined_blocks(
        fn, args, [model.get_layer(n) for n in ("trunk", "tokens", "pair")],
        lambda x, y: model(x),
        lambda zs, x, y: tf.reduce_mean(ce(y, zs[0])) + tf.reduce_mean(ce(y[:, 0] % 2, zs[1])),
        position_columns="separate")
    assert reg.loss.blocks == ((5 * V, V), (2, 2))


def test_one_column_per_position_needs_static_positions(blocks_beyond_ten):
    """The exact Fisher's one column per position and class needs the
    positions when tracing: one line, as for one output with positions."""
    est = kg.FisherEstimator(_loss(_model(), UNKNOWN), estimation_mode="exact",
                             position_columns="separate")
    with pytest.raises(kg.KfacGraphError, match="positions are not known when tracing"):
        est.update(*_batches()[0])
