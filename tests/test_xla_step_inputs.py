"""An XLA-compiled K-FAC step takes its batch as inputs, not as constants.

A gradient taken through a nested ``tf.function`` call hands an embedding's
``IndexedSlices`` out of the call, and XLA then compiled the whole step for
the batch's (and the variables') values: a ``jit_compile=True`` step with a
covariance period above 1 recompiled on every batch (11 s a step on the
character transformer of ``benchmarks/transformer_lm.py``, against 0.1 s).
The step's plain pass now traces the loss inline
(``RegisteredFunction.inline``)."""
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg

VOCAB, BATCH, STEPS = 11, (4, 5), 4


def _problem(wrap):
    """An embedding and a dense head over ``[4, 5]`` token ids, its per-token
    loss (a ``tf.function`` first if ``wrap``) and batches."""
    keras.utils.set_random_seed(0)
    emb, head = keras.layers.Embedding(VOCAB, 8), keras.layers.Dense(VOCAB)

    def loss(ids, y):
        logits = head(emb(ids))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    rng = np.random.default_rng(0)
    batches = [tuple(tf.constant(rng.integers(0, VOCAB, BATCH), tf.int32) for _ in range(2))
               for _ in range(STEPS)]
    fn = kg.auto_register(tf.function(loss) if wrap else loss)
    return fn, [*emb.trainable_variables, *head.trainable_variables], batches


def _entry_parameters(hlo: str) -> str:
    entry = hlo[hlo.index("ENTRY"):]
    return "\n".join(line for line in entry[:entry.index("\n}")].splitlines()
                     if " parameter(" in line)


OPTIONS = {"regular": dict(momentum_type="regular", cov_update_period=2),
           "qmodel_half": dict(qmodel_batch_fraction=0.5, cov_update_period=2)}


@pytest.mark.parametrize("wrap,options", [(False, "regular"), (True, "regular"),
                                          (False, "qmodel_half")])
def test_xla_step_takes_the_batch_as_parameters_and_matches_the_plain_step(wrap, options):
    trained = []
    for jit in (True, "auto"):
        fn, variables, batches = _problem(wrap)
        opt = kg.KFAC(fn, jit_compile=jit, **OPTIONS[options])
        for x, y in batches:
            opt.step(x, y)
        assert int(opt.skipped_steps) == 0
        trained.append([v.numpy() for v in variables])
        if jit is True:
            hlo = opt._compiled.core.experimental_get_compiler_ir(*batches[0])(stage="hlo")
            ids = re.findall(r"s32\[4,5\][^ ]* parameter\(", _entry_parameters(hlo))
            assert len(ids) == 2, "the batch was compiled in as constants"
    for a, b in zip(*trained):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_inline_traces_the_loss_as_the_function_computes_it():
    fn, _, batches = _problem(wrap=True)
    x, y = batches[0]
    inline = tf.function(lambda a, b: fn.inline(a, b))
    np.testing.assert_allclose(inline(x, y).numpy(), fn.tf_function(x, y).numpy(), rtol=1e-6)
    graph = inline.get_concrete_function(x, y).graph
    calls = [op for op in graph.get_operations() if "PartitionedCall" in op.type]
    assert not calls, "the loss was traced as a nested call"
