"""Paths from a weight to the loss that a layer's pattern does not see.

Values computed from weights alone that meet the data
(``passes/batch_flow.py``): DeBERTa projects its relative position
embeddings, a table repeated over the batch, with the attention's own query
and key layers, and pairs the projected rows with each example's queries:
the projection is a second use of those layers, per example like the data.
Before, the pass took the weights-only product for a weight penalty and
dropped that use, and the per-example gradients of the query and key
kernels came back wrong by tens of percent, with no error. Now such a use
registers when the weights are tiled or broadcast over the batch, and any
other read of a variable whose value meets the data before the loss is
reduced makes it generic (with the reason) instead of being ignored; a
penalty added to the scalar loss stays what it was.

A layer's weighted product read both through its "bias" and elsewhere
(XLNet's bias-free query, plus three attention biases) is no biased layer
(``match_layers._leaks``): before, one bias was taken for the projection's
and the kernel's gradient lost the other two paths.

Checked in float64 against a loop of one-example gradients and the
brute-force Fisher."""
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from fisher_reference import brute_fisher, softmax_fisher
from per_example_reference import assert_matches_loop, one_example_loop

B, T, P, D, C = 3, 4, 5, 3, 2


def _relative_model(expand, batch, signature=False):
    """``q = x W + b`` and ``k = R W + b`` with the table ``R`` repeated over
    the batch (``expand``), scores ``q_i . k_i`` per example, a linear head."""
    rng = np.random.RandomState(0)
    rel = tf.Variable(rng.normal(size=(P, D)), name="rel")
    w = tf.Variable(rng.normal(size=(D, D)), name="w")
    b = tf.Variable(rng.normal(size=(D,)), name="b")
    head = tf.Variable(rng.normal(size=(P, C)), name="head")
    params = [rel, w, b, head]

    def logits(p, x):
        rel, w, b, head = p
        n = batch(x)
        r = {"repeat": lambda: tf.repeat(rel[None], n, axis=0),
             "tile": lambda: tf.tile(rel[None], [n, 1, 1]),
             "broadcast": lambda: tf.broadcast_to(rel, [n, P, D])}[expand]()
        scores = tf.einsum("btd,bpd->btp", x @ w + b, r @ w + b)
        return tf.reduce_mean(tf.tanh(scores), axis=1) @ head

    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, logits(params, x)))

    if signature:  # the batch known at run time only
        loss_fn = tf.function(loss_fn, input_signature=[
            tf.TensorSpec([None, T, D], tf.float64), tf.TensorSpec([None], tf.int32)])
    x = tf.constant(rng.normal(size=(B, T, D)))
    return kg.auto_register(loss_fn), logits, params, (x, tf.constant([0, 1, 1]))


@pytest.mark.parametrize("expand", ["repeat", "tile", "broadcast"])
@pytest.mark.parametrize("batch", ["static", "dynamic", "signature"])
def test_weights_repeated_over_the_batch_are_a_second_use(expand, batch):
    size = lambda x: x.shape[0] if batch == "static" else tf.shape(x)[0]  # noqa: E731
    loss_fn, logits, params, args = _relative_model(expand, size, batch == "signature")
    reg = assert_matches_loop(loss_fn, args)
    kinds = {tuple(v.name.split(":")[0] for v in layer.variables): (layer.kind, layer.uses)
             for layer in reg.layers}
    assert kinds[("w", "b")] == ("dense", 2), reg.summary()
    # broadcast, tiled or repeated over the batch: a shift of zeros on its
    # copies (tests/test_tiled_weights.py); traced with a static batch,
    # tf.shape(x) is a constant, and the multiples packed from it fold; with
    # the batch known at run time only, the probes find the axis holding it
    assert kinds[("rel",)][0] == "scale_and_shift", reg.summary()
    rel, w, b, _ = params
    want = brute_fisher(lambda p, x: logits([rel, p[0], p[1], params[3]], x), [w, b],
                        args[0], softmax_fisher)
    est = kg.FisherEstimator(loss_fn, estimation_mode="exact", approximations={"dense": "full"})
    est.update(*args)
    block = [blk for blk, layer in zip(est.blocks, reg.layers) if layer.kind == "dense"
             and layer.variables[0] is w][0]
    np.testing.assert_allclose(block.full_matrix(), want, rtol=1e-6, atol=1e-12)


def _side_path_model(form, penalty=0.1, w=None):
    """A dense layer whose kernel also reaches the loss another way:
    ``"into_data"`` adds its column means to the outputs (per example),
    ``"per_example_penalty"`` adds ``penalty |W|^2`` to every example's
    term, and ``"penalty"`` adds it to the reduced loss. ``w``: the kernel
    (default a new one)."""
    rng = np.random.RandomState(1)
    w = tf.Variable(rng.normal(size=(D, C)), name="w") if w is None else w

    @kg.auto_register
    def loss_fn(x, y):
        z = tf.tanh(x) @ w
        if form == "into_data":
            z = z + tf.reduce_mean(w, axis=0)
        terms = tf.nn.sparse_softmax_cross_entropy_with_logits(y, z)
        if form == "per_example_penalty":
            terms = terms + penalty * tf.reduce_sum(tf.square(w))
        loss = tf.reduce_mean(terms)
        return loss + penalty * tf.reduce_sum(tf.square(w)) if form == "penalty" else loss

    return loss_fn, (tf.constant(rng.normal(size=(B, D))), tf.constant([0, 1, 1]))


def test_a_weight_path_into_the_examples_outside_the_layer_is_generic():
    loss_fn, args = _side_path_model("into_data")
    reg = assert_matches_loop(loss_fn, args)
    (layer,) = reg.layers
    assert layer.kind == "generic" and "also read outside its layer pattern" in layer.reason


def test_a_penalty_added_to_each_term_is_generic_and_in_each_examples_gradient():
    """The penalty meets each example's term, so the kernel is generic; each
    example's gradient is the loss's on that example alone, the penalty's
    gradient in it, as on the reduced loss (``passes/loss_terms.py``)."""
    loss_fn, args = _side_path_model("per_example_penalty")
    reg = assert_matches_loop(loss_fn, args)
    (layer,) = reg.layers
    assert layer.kind == "generic", reg.summary()
    without, _ = _side_path_model("per_example_penalty", 0.0, reg.variables[0])
    assert np.abs(one_example_loop(without, args, reg.variables)[0]
                  - kg.per_example_gradients(loss_fn, *args)[0]).max() > 1e-2


def test_a_penalty_on_the_reduced_loss_leaves_the_layer_registered():
    loss_fn, args = _side_path_model("penalty")
    (layer,) = loss_fn.registration(*args).layers
    assert (layer.kind, layer.uses) == ("dense", 1)


@pytest.mark.parametrize("layer", ["dense", "conv2d"])
def test_a_product_read_before_and_after_its_bias_is_no_biased_layer(layer):
    """XLNet's bias-free query projection ``q`` is read as ``q + u`` and
    ``q + v`` (two attention biases): neither add is the projection's bias,
    since the layer's output would then miss the other path. The product
    registers alone and each bias as a shift of its own."""
    rng = np.random.RandomState(2)
    shape = {"dense": (D, D), "conv2d": (2, 2, D, D)}[layer]
    w = tf.Variable(rng.normal(size=shape), name="w")
    u = tf.Variable(rng.normal(size=(D,)), name="u")
    v = tf.Variable(rng.normal(size=(D,)), name="v")
    head = tf.Variable(rng.normal(size=(D, C)), name="head")

    @kg.auto_register
    def loss_fn(x, y):
        q = x @ w if layer == "dense" else tf.nn.conv2d(x, w, 1, "SAME")
        h = tf.tanh(q + u) * tf.sigmoid(q + v)
        h = tf.reduce_mean(h, axis=list(range(1, len(h.shape) - 1))) if layer == "conv2d" else h
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h @ head))

    x = rng.normal(size=(B, D) if layer == "dense" else (B, 3, 3, D))
    args = (tf.constant(x), tf.constant([0, 1, 1]))
    reg = assert_matches_loop(loss_fn, args)
    got = sorted((layer.kind, tuple(v.name.split(":")[0] for v in layer.variables))
                 for layer in reg.layers)
    assert got == sorted([(layer, ("w",)), ("dense", ("head",)),
                          ("scale_and_shift", ("u",)), ("scale_and_shift", ("v",))]), got
