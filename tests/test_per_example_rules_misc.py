"""Scale-and-shift, embedding and tied-embedding rules, the registry and the specs."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from kfac_graph import per_example as pe
from per_example_reference import check, DEFAULT, MODE_IDS, MODES


def scale_shift_op(spec):
    def op(x, scale, *shift):
        return scale * x + shift[0] if spec.has_shift else scale * x

    return op


SS = pe.ScaleShiftSpec
SCALE_CASES = {
    # name: (spec, [xhat shape per use])
    "channels_last": (SS((4,), has_shift=True), [(3, 2, 5, 4)]),
    "nchw_1c11": (SS((1, 4, 1, 1), has_shift=True), [(3, 4, 5, 2)]),
    "no_shift": (SS((4,)), [(5, 4)]),
    "layer_norm_like": (SS((5, 4), has_shift=True), [(3, 2, 5, 4)]),
    "broadcast_middle": (SS((2, 1, 4)), [(3, 2, 5, 4)]),
    "batch1": (SS((4,), has_shift=True), [(1, 3, 4)]),
    "multi_use": (SS((1, 4, 1, 1), has_shift=True), [(3, 4, 5, 2), (3, 4, 2, 2)]),
}


@pytest.mark.parametrize("dtype,mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name", sorted(SCALE_CASES))
def test_scale_shift_matches_brute_force(name, dtype, mode):
    spec, shapes = SCALE_CASES[name]
    weights = [spec.scale_shape] * (2 if spec.has_shift else 1)
    check(
        DEFAULT["scale_and_shift"],
        spec,
        scale_shift_op(spec),
        weights,
        [(s, s) for s in shapes],
        dtype,
        mode,
    )


def test_scale_varying_over_batch_is_rejected():
    with pytest.raises(ValueError):
        DEFAULT["scale_and_shift"].per_example_grads(
            (tf.zeros([3, 4]), tf.zeros([3, 4])), SS((3, 4))
        )


def embedding_op(ids, table):
    return tf.gather(table, ids)


EMB_CASES = {
    # name: (vocab, dim, [ids shape per use][, ids drawn below this])
    # (ids drawn from fewer values than positions, so ids repeat)
    "single_id": (5, 3, [(5,)]),
    "sequence": (4, 3, [(3, 7)]),
    "sequence_2d": (5, 2, [(3, 2, 4)]),
    "batch1": (3, 3, [(1, 6)]),
    "multi_use": (4, 3, [(3, 5), (3,)]),
    "long_sequence": (5000, 2, [(3, 120)], 6),  # auto: the segment form
    "big_vocab": (200, 2, [(3, 4)], 3),  # auto: the Gram form
    "small_vocab": (3, 2, [(3, 40)]),  # auto: materialise
}


def _emb_check(rule, name, dtype, mode, input_signature=None):
    vocab, dim, shapes, *id_high = EMB_CASES[name]
    check(
        rule,
        pe.EmbeddingSpec(vocab),
        embedding_op,
        [(vocab, dim)],
        [(s, s + (dim,)) for s in shapes],
        dtype,
        mode,
        int_high=id_high[0] if id_high else vocab,
        input_signature=input_signature,
    )


@pytest.mark.parametrize("dtype,mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name", sorted(EMB_CASES))
def test_embedding_matches_brute_force(name, dtype, mode):
    _emb_check(DEFAULT["embedding"], name, dtype, mode)


@pytest.mark.parametrize("mode", ["eager", "xla"])
@pytest.mark.parametrize("norm_method", ["gram", "segment", "materialize"])
@pytest.mark.parametrize("name", ["sequence", "multi_use", "single_id"])
def test_embedding_norm_methods(norm_method, name, mode):
    _emb_check(pe.EmbeddingRule(norm_method=norm_method), name, tf.float64, mode)


def test_embedding_auto_norm_choice():
    rule = DEFAULT["embedding"]
    assert rule.choose_norm_method(120, 2, 5000) == "segment"
    assert rule.choose_norm_method(256, 64, 10000) == "segment"
    assert rule.choose_norm_method(40, 2, 3) == "materialize"
    assert rule.choose_norm_method(4, 2, 200) == "gram"
    assert rule.choose_norm_method(64, 64, 10000) == "gram"
    assert rule.choose_norm_method(1, 64, 10**6) == "gram"
    assert rule.choose_norm_method(None, 8, 3) == "segment"


@pytest.mark.parametrize("mode", ["function", "xla"])
def test_embedding_dynamic_batch(mode):
    sig = [tf.TensorSpec([None, 7], tf.int32), tf.TensorSpec([None, 7, 3], tf.float64)]
    _emb_check(
        pe.EmbeddingRule(norm_method="segment"), "sequence", tf.float64, mode, input_signature=sig
    )
    _emb_check(DEFAULT["embedding"], "sequence", tf.float64, mode, input_signature=sig)


# Registry ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _ElementwiseRule:
    """A user rule for `y = w * x` with `w` of x's per-example shape."""

    def per_example_grads(self, uses, spec):
        del spec
        return [tf.add_n([a * g for a, g in uses])]

    def squared_norms(self, uses, spec):
        g = self.per_example_grads(uses, spec)[0]
        return tf.reduce_sum(tf.square(g), axis=1)


def test_registry_has_the_matcher_kinds():
    assert set(DEFAULT.kinds) == {
        "dense",
        "conv2d",
        "conv3d",
        "depthwise_conv2d",
        "conv2d_transpose",
        "conv3d_transpose",
        "scale_and_shift",
        "embedding",
        "tied_embedding",
        "grouped_dense",
    }
    assert all(isinstance(DEFAULT[k], pe.PerExampleRule) for k in DEFAULT.kinds)


def test_registry_extends_by_copy():
    extended = DEFAULT.with_rule("elementwise", _ElementwiseRule())
    assert "elementwise" in extended and "elementwise" not in DEFAULT
    check(
        extended["elementwise"],
        None,
        lambda x, w: w * x,
        [(4,)],
        [((3, 4), (3, 4)), ((3, 4), (3, 4))],
        tf.float64,
        "eager",
    )
    a, g = tf.ones([2, 3]), 2 * tf.ones([2, 3])
    np.testing.assert_allclose(extended.squared_norms("elementwise", [(a, g)], None), [12.0, 12.0])
    assert "dense" not in extended.without("dense")
    assert "dense" in extended


def test_registry_is_immutable_and_validates():
    with pytest.raises(AttributeError):
        DEFAULT._rules = {}
    with pytest.raises(TypeError):
        DEFAULT._rules["x"] = None
    with pytest.raises(TypeError):
        pe.RuleRegistry({"bad": object()})
    with pytest.raises(KeyError, match="generic"):
        DEFAULT["generic"]


def test_default_registry_is_a_fresh_value():
    assert pe.default_registry() is not pe.default_registry()
    assert pe.default_registry(xla=True)["depthwise_conv2d"].xla is True


def test_xla_context_detection():
    seen = []

    def fn(x):
        seen.append(pe.in_xla_context())
        return x

    tf.function(fn)(1.0)
    tf.function(fn, jit_compile=True)(1.0)
    assert seen == [False, True]
    assert not pe.in_xla_context()
    spec = pe.DepthwiseSpec((3, 3, 2, 1))
    assert pe.DepthwiseRule(xla=True).choose_method(spec) == "taps"
    assert pe.DepthwiseRule(xla=False).choose_method(spec) == "grouped"


# Specs ---------------------------------------------------------------------


def test_conv_spec_from_node_attrs():
    attrs = {
        "strides": [1, 1, 2, 2],
        "dilations": [1, 1, 1, 1],
        "padding": b"EXPLICIT",
        "data_format": b"NCHW",
        "explicit_paddings": [0, 0, 0, 0, 1, 2, 3, 4],
        "T": tf.float32,
    }
    spec = pe.ConvSpec.from_attrs([3, 3, 2, 4], attrs, has_bias=True)
    assert spec.padding == "EXPLICIT" and spec.data_format == "NCHW"
    assert spec.strides_hw == (2, 2) and spec.kernel_hw == (3, 3)
    assert spec.explicit_paddings_hw == ((1, 2), (3, 4))
    assert hash(spec) == hash(pe.ConvSpec.from_attrs((3, 3, 2, 4), attrs, True))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.padding = "SAME"


def test_spec_validation():
    with pytest.raises(ValueError):
        pe.ConvSpec((3, 3, 2), padding="SAME")
    with pytest.raises(ValueError):
        pe.DepthwiseSpec((3, 3, 2, 1), padding="FULL")
    with pytest.raises(ValueError):
        pe.ConvSpec((3, 3, 2, 1), padding="EXPLICIT")


def test_gram_cost_rule():
    assert pe.gram_is_cheaper(1, 784, 512)
    assert not pe.gram_is_cheaper(1024, 27, 32)
    assert not pe.gram_is_cheaper(None, 10, 10)


def test_tied_embedding_rule_sums_both_roles_and_its_norm_has_the_cross_term():
    """Two lookups and two projections of one table ``E [V, D]``: the rule's
    gradient is the scatter of the lookups' ``g`` plus ``sum_t q_t^T h_t``,
    written out in numpy; its norm form (with the lookup-projection cross
    term) equals the squared norm of that gradient."""
    from kfac_graph.layers import tied_embedding as tied

    rng = np.random.RandomState(0)
    b, vocab, d = 3, 6, 4
    lookups = [(rng.randint(0, vocab, (b, t)), rng.normal(size=(b, t, d))) for t in (5, 2)]
    projections = [(rng.normal(size=(b, t, d)), rng.normal(size=(b, t, vocab))) for t in (3, 1)]
    uses = [lookups[0], projections[0], lookups[1], projections[1]]
    spec = tied.TiedEmbeddingSpec(vocab, ("lookup", "projection", "lookup", "projection"))
    want = np.zeros((b, vocab, d))
    for ids, g in lookups:
        for i in range(b):
            for t in range(ids.shape[1]):
                want[i, ids[i, t]] += g[i, t]
    for h, q in projections:
        want += np.einsum("btv,btd->bvd", q, h)
    rule = tied.TiedEmbeddingRule()
    got = rule.per_example_grads(uses, spec)
    assert len(got) == 1
    np.testing.assert_allclose(got[0], want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(rule.squared_norms(uses, spec),
                               np.sum(want.reshape(b, -1) ** 2, axis=1), rtol=1e-10)
    with pytest.raises(ValueError, match="tied embedding"):
        rule.per_example_grads(uses[:3], spec)
