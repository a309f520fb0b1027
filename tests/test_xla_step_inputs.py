"""An XLA-compiled K-FAC step takes its batch as inputs, not as constants,
and differentiates a backward pass through a slice again.

A gradient taken through a nested ``tf.function`` call hands an embedding's
``IndexedSlices`` out of the call, and XLA then compiled the whole step for
the batch's (and the variables') values: a ``jit_compile=True`` step with a
covariance period above 1 recompiled on every batch (11 s a step on the
character transformer of ``benchmarks/transformer_lm.py``, against 0.1 s).
The step's plain pass now traces the loss inline
(``RegisteredFunction.inline``). Under XLA, TensorFlow's gradient of a slice
is an op without a gradient, and the quadratic model's Jacobian products
failed on a model that slices a position table (GPT-2); ``double_backward``
gives it one. Statistics in exact mode: XLA and TensorFlow's kernels draw
different samples."""
import contextlib
import functools
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph import double_backward
from xla_reference import assert_xla_matches_plain

VOCAB, BATCH, STEPS = 11, (4, 5), 4


def _problem(wrap):
    """An embedding, position embeddings sliced from their table (as GPT-2's)
    and a dense head over ``[4, 5]`` token ids, its per-token loss (a
    ``tf.function`` first if ``wrap``) and batches."""
    keras.utils.set_random_seed(0)
    emb, head = keras.layers.Embedding(VOCAB, 8), keras.layers.Dense(VOCAB)
    positions = tf.Variable(np.random.default_rng(2).normal(size=(7, 8)).astype(np.float32))

    def loss(ids, y):
        logits = head(emb(ids) + tf.slice(positions, [0, 0], [BATCH[1], 8]))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    rng = np.random.default_rng(0)
    batches = [tuple(tf.constant(rng.integers(0, VOCAB, BATCH), tf.int32) for _ in range(2))
               for _ in range(STEPS)]
    fn = kg.auto_register(tf.function(loss) if wrap else loss)
    return fn, [*emb.trainable_variables, positions, *head.trainable_variables], batches


def _entry_parameters(hlo: str) -> str:
    entry = hlo[hlo.index("ENTRY"):]
    return "\n".join(line for line in entry[:entry.index("\n}")].splitlines()
                     if " parameter(" in line)


OPTIONS = {"regular": dict(momentum_type="regular", cov_update_period=2),
           "qmodel_half": dict(qmodel_batch_fraction=0.5, cov_update_period=2)}


@pytest.mark.parametrize("wrap,options", [  # a tf.function loss, and the quadratic model
    (False, "regular"), pytest.param(True, "regular", marks=pytest.mark.slow),  # (its whole
    pytest.param(False, "qmodel_half", marks=pytest.mark.slow)])  # step below): -m slow
def test_xla_step_takes_the_batch_as_parameters_and_matches_the_plain_step(wrap, options):
    def train(jit):
        fn, variables, batches = _problem(wrap)
        opt = kg.KFAC(fn, jit_compile=jit, estimation_mode="exact", **OPTIONS[options])
        for x, y in batches:
            opt.step(x, y)
        assert int(opt.skipped_steps) == 0
        if jit is True:
            hlo = opt._compiled.core.experimental_get_compiler_ir(*batches[0])(stage="hlo")
            ids = re.findall(r"s32\[4,5\][^ ]* parameter\(", _entry_parameters(hlo))
            assert len(ids) == 2, "the batch was compiled in as constants"
        return [v.numpy() for v in variables]

    assert_xla_matches_plain(train, "auto", rtol=1e-4, atol=1e-6)


class _Loss:
    """A loss as a callable object and as a method."""

    def __init__(self, w):
        self.w = w

    def __call__(self, x, y):
        return _mean_xent(x, y, self.w, 1.0)

    def method(self, x, y):
        return _mean_xent(x, y, self.w, 1.0)


def _mean_xent(x, y, w, scale):
    return scale * tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, x @ w))


def _branching(w):
    def loss(x, y):
        scale = tf.constant(1.0, tf.float64)
        if tf.reduce_sum(x) > 0:  # AutoGraph makes it a tf.cond
            scale = tf.constant(2.0, tf.float64)
        return _mean_xent(x, y, w, scale)
    return loss


CALLABLES = {
    "function": lambda w: lambda x, y: _mean_xent(x, y, w, 1.0),
    "tf_function": lambda w: tf.function(lambda x, y: _mean_xent(x, y, w, 1.0)),
    # the variable closed over (tf.function passes a partial's own keywords as arguments)
    "partial": lambda w: functools.partial(lambda x, y, scale: _mean_xent(x, y, w, scale),
                                           scale=1.0),
    "object": _Loss,
    "method": lambda w: _Loss(w).method,
    "branching": _branching,
}


@pytest.mark.parametrize("kind", sorted(CALLABLES))
def test_inline_traces_any_callable_loss_as_the_function_computes_it(kind):
    """Partials, callable objects, methods and a loss with a Python ``if`` on a
    tensor (converted as ``tf.function`` converts them, also inside the
    step's trace, which has AutoGraph off) as well as functions: the same
    value, no nested call, and a K-FAC step with steps that skip the
    statistics (the plain pass) runs."""
    rng = np.random.default_rng(3)
    w = tf.Variable(rng.normal(size=(3, 2)))
    x, y = tf.constant(rng.normal(size=(4, 3))), tf.constant([0, 1, 1, 0])
    fn = kg.auto_register(CALLABLES[kind](w))
    inline = tf.function(lambda a, b: fn.inline(a, b), autograph=False)
    np.testing.assert_allclose(inline(x, y).numpy(), fn(x, y).numpy(), rtol=1e-12)
    graph = inline.get_concrete_function(x, y).graph
    calls = [op for op in graph.get_operations() if "PartitionedCall" in op.type]
    assert not calls, "the loss was traced as a nested call"
    opt = kg.KFAC(fn, momentum_type="regular", cov_update_period=2)
    before = w.numpy()
    for _ in range(3):
        assert np.isfinite(float(opt.step(x, y)))
    assert int(opt.skipped_steps) == 0 and not np.array_equal(before, w.numpy())


def test_a_backward_pass_through_a_slice_is_differentiable_again_under_xla():
    """``J u`` by the double backward trick through ``table[:4]`` (GPT-2's
    position embeddings), under XLA (``double_backward``) and without."""
    rng = np.random.default_rng(1)
    table = tf.Variable(rng.normal(size=(6, 3)))
    x = tf.constant(rng.normal(size=(2, 4, 3)))
    u = tf.constant(rng.normal(size=(6, 3)))

    def jacobian_product(override=True):
        z = tf.tanh(x + tf.slice(table, [0, 0], [4, 3]))
        w = tf.zeros_like(z)
        with double_backward.differentiable() if override else contextlib.nullcontext():
            r = tf.gradients(z, table, grad_ys=w)[0]
        return tf.gradients(r, w, grad_ys=u)[0]

    with pytest.raises(LookupError, match="XlaDynamicUpdateSlice"):  # TensorFlow's own
        tf.function(lambda: jacobian_product(override=False), jit_compile=True,
                    autograph=False)()
    got = tf.function(jacobian_product, jit_compile=True)()
    want = tf.function(jacobian_product)()
    brute = (1 - np.tanh(x.numpy() + table.numpy()[:4]) ** 2) * u.numpy()[:4]
    np.testing.assert_allclose(want.numpy(), brute, rtol=1e-12)
    np.testing.assert_allclose(got.numpy(), brute, rtol=1e-12)


def _convolutions():
    return keras.Sequential([
        keras.Input((8, 8, 4)),
        keras.layers.Conv2D(8, 3, padding="same", groups=2, activation="swish"),
        keras.layers.DepthwiseConv2D(3, padding="same"),
        keras.layers.GroupNormalization(groups=4),
        keras.layers.Conv2DTranspose(6, 3, strides=2, padding="same", activation="gelu"),
        keras.layers.Conv2D(6, 3, strides=2),
        keras.layers.Reshape((-1, 6)),
        keras.layers.Conv1D(6, 3, padding="causal"),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(5)])


def _recurrent():
    return keras.Sequential([
        keras.Input((4,), dtype="int32"), keras.layers.Embedding(9, 6),
        keras.layers.LSTM(8, return_sequences=True), keras.layers.GRU(8, return_sequences=True),
        keras.layers.Dense(9)])


FAMILIES = {  # model, input, targets
    "convolutions": (_convolutions, lambda r: r.normal(size=(6, 8, 8, 4)).astype(np.float32),
                     lambda r: r.integers(0, 5, 6).astype(np.int32)),
    "recurrent": (_recurrent, lambda r: r.integers(0, 9, (5, 4)).astype(np.int32),
                  lambda r: r.integers(0, 9, (5, 4)).astype(np.int32)),
}


@pytest.mark.slow  # 90 s; the fast set's whole-step XLA tests above take the same path
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_quadratic_model_under_whole_step_xla_matches_the_plain_step(family):
    """The defaults' quadratic model with steps that skip the statistics, the
    whole step under XLA against the plain step, on the convolution family
    (grouped, depthwise, transposed, causal 1-D; swish, GELU, group norm) and
    on recurrent layers with a per-token loss."""
    build, inputs, targets = FAMILIES[family]

    def train(jit):
        keras.utils.set_random_seed(0)
        model = build()

        def loss(x, y):
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

        rng = np.random.default_rng(0)
        x, y = tf.constant(inputs(rng)), tf.constant(targets(rng))
        opt = kg.KFAC(kg.auto_register(loss), jit_compile=jit, estimation_mode="exact",
                      cov_update_period=2)
        losses = [float(opt.step(x, y)) for _ in range(3)]
        assert int(opt.skipped_steps) == 0 and losses[-1] < losses[0], losses
        return [v.numpy() for v in model.trainable_variables]

    assert_xla_matches_plain(train, "auto", rtol=1e-4, atol=1e-5)
