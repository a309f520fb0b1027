"""Blocks run eagerly, in tf.function and under XLA (jit_compile=True);
the registry of default blocks; unsupported methods fail clearly."""

import numpy as np
import pytest
import tensorflow as tf

from kfac_graph import fisher

F64 = tf.float64


def _dense(rng):
    shapes = [(3, 2), (2,)]
    data = lambda: [
        (
            tf.constant(rng.normal(size=(4, 3))),
            [tf.constant(rng.normal(size=(4, 2))) for _ in range(2)],
        )
    ]
    return fisher.FullyConnectedKroneckerBlock, shapes, None, data


def _conv(rng):
    shapes = [(2, 2, 2, 3), (3,)]
    attrs = dict(strides=[1, 2, 2, 1], dilations=[1, 1, 1, 1], padding=b"SAME", data_format=b"NHWC")
    data = lambda: [
        (tf.constant(rng.normal(size=(2, 5, 5, 2))), tf.constant(rng.normal(size=(2, 3, 3, 3))))
    ]
    return fisher.ConvKroneckerBlock, shapes, attrs, data


def _depthwise(rng):
    shapes = [(2, 2, 2, 2), (4,)]
    attrs = dict(strides=[1, 1, 1, 1], padding="VALID")
    data = lambda: [
        (tf.constant(rng.normal(size=(2, 4, 4, 2))), tf.constant(rng.normal(size=(2, 3, 3, 4))))
    ]
    return fisher.DepthwiseConvKroneckerBlock, shapes, attrs, data


def _embedding(rng):
    data = lambda: [
        (tf.constant(rng.integers(0, 6, size=(3, 2))), tf.constant(rng.normal(size=(3, 2, 2))))
    ]
    return fisher.EmbeddingKroneckerBlock, [(6, 2)], None, data


def _series(rng):
    data = lambda: [
        (tf.constant(rng.normal(size=(4, 2))), tf.constant(rng.normal(size=(4, 2))))
        for _ in range(3)
    ]
    return (
        lambda *a, **k: fisher.FullyConnectedSeriesBlock(*a, option=2, **k),
        [(2, 2), (2,)],
        None,
        data,
    )


def _conv_diag(rng):
    cls, shapes, attrs, data = _conv(rng)
    return fisher.ConvDiagonalBlock, shapes, attrs, data


def _scale_full(rng):
    data = lambda: [
        (tf.constant(rng.normal(size=(3, 4, 2))), tf.constant(rng.normal(size=(3, 4, 2))))
    ]
    return fisher.ScaleAndShiftFullBlock, [(2,), (2,)], None, data


CASES = {
    "dense": _dense,
    "conv": _conv,
    "depthwise": _depthwise,
    "embedding": _embedding,
    "series": _series,
    "conv_diag": _conv_diag,
    "scale_full": _scale_full,
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "conv" else n
                                  for n in sorted(CASES)])  # (conv: conv_diag in the fast set)
def test_xla_matches_eager(name):
    cls, shapes, attrs, data_fn = CASES[name](np.random.default_rng(0))
    batches = [data_fn() for _ in range(2)]
    vs = [tf.constant(np.random.default_rng(1).normal(size=s)) for s in shapes]
    kw = dict(dtype=F64, damping=0.1, ema_decay=0.7)
    eager, graph, xla = (cls(shapes, attrs, **kw) for _ in range(3))

    def step(block, batch):
        block.update(batch)
        block.update_inverses()
        return block.multiply_inverse(vs)

    for block, wrap in ((graph, tf.function), (xla, lambda f: tf.function(f, jit_compile=True))):
        compiled = wrap(lambda batch, b=block: step(b, batch))
        for batch in batches:
            got = compiled(batch)
        block._last = got
    for batch in batches:
        want = step(eager, batch)
    # XLA's eigensolver (Jacobi) agrees with LAPACK to ~1e-9 in float64.
    for block, tol in ((graph, 1e-10), (xla, 1e-7)):
        for w, g in zip(want, block._last):
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


def test_defaults_registry():
    kw = dict(dtype=F64)
    assert isinstance(
        fisher.make_block("dense", [(3, 2), (2,)], **kw), fisher.FullyConnectedKroneckerBlock
    )
    assert isinstance(
        fisher.make_block("conv2d", [(1, 1, 2, 2)], {}, **kw), fisher.ConvKroneckerBlock
    )
    assert isinstance(
        fisher.make_block("depthwise_conv2d", [(1, 1, 2, 1)], {}, **kw),
        fisher.DepthwiseConvKroneckerBlock,
    )
    assert isinstance(
        fisher.make_block("embedding", [(5, 2)], **kw), fisher.EmbeddingKroneckerBlock
    )
    assert isinstance(fisher.make_block("generic", [(4,)], **kw), fisher.NaiveDiagonalBlock)
    limit = fisher.SCALE_AND_SHIFT_FULL_MAX_PARAMS
    assert isinstance(
        fisher.make_block("scale_and_shift", [(limit // 2,)] * 2, **kw),
        fisher.ScaleAndShiftFullBlock,
    )
    assert isinstance(
        fisher.make_block("scale_and_shift", [(limit,)] * 2, **kw),
        fisher.ScaleAndShiftDiagonalBlock,
    )
    block = fisher.make_block(
        "dense", [(3, 2)], num_uses=2, overrides={"dense": fisher.FullyConnectedDiagonalBlock}, **kw
    )
    assert isinstance(block, fisher.FullyConnectedDiagonalBlock)
    assert block.num_uses == 2
    with pytest.raises(ValueError, match="unknown layer kind"):
        fisher.make_block("lstm", [(2, 2)])
    with pytest.raises(TypeError):
        fisher.DEFAULT_BLOCKS["dense"] = None  # read-only mapping


def test_unsupported_methods_name_block_and_method():
    block = fisher.FisherBlock([(2,)])
    with pytest.raises(NotImplementedError, match=r"^FisherBlock\.multiply_matpower: "):
        block.multiply([tf.zeros([2])])
    with pytest.raises(ValueError, match="option must be 1 or 2"):
        fisher.FullyConnectedSeriesBlock([(2, 2)], option=3)
    series = fisher.FullyConnectedSeriesBlock([(2, 2)], option=1)
    with pytest.raises(NotImplementedError, match=r"FullyConnectedSeriesBlock\.multiply_matpower"):
        series.multiply_matpower([tf.zeros([2, 2])], 0.5)


def test_block_stats_kind_and_float32_default():
    assert fisher.NaiveFullBlock.stats == "per_example_gradients"
    assert fisher.ConvKroneckerBlock.stats == "activations"
    block = fisher.FullyConnectedKroneckerBlock([(2, 2)])
    block.update((tf.ones([3, 2]), tf.ones([3, 2])))
    block.update_inverses()
    out = block.multiply_inverse([tf.ones([2, 2])])
    assert out[0].dtype == tf.float32
    assert np.all(np.isfinite(out[0].numpy()))
    # before any update: zero factors, pi = 1, inverse = identity / damping
    fresh = fisher.FullyConnectedKroneckerBlock([(2, 2)], damping=0.5)
    fresh.update_inverses()
    np.testing.assert_allclose(
        fresh.multiply_inverse([tf.ones([2, 2])])[0], np.full([2, 2], 2.0), rtol=1e-6
    )


def test_block_names_and_variables():
    block = fisher.make_block("dense", [(2, 3), (3,)], name="model/dense_1:0")
    assert block.name == "model_dense_1_0"
    assert all(not v.trainable for v in block.variables)
    assert len(block.variables) >= 4
