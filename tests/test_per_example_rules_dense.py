"""Dense rule against brute-force per-example gradients."""

import pytest
import tensorflow as tf

from kfac_graph import per_example as pe
from per_example_reference import check, DEFAULT, MODE_IDS, MODES


def dense_op(spec):
    def op(a, kernel, *bias):
        out = tf.matmul(a, kernel, transpose_b=spec.transpose_kernel)
        return out + bias[0] if spec.has_bias else out

    return op


def weights(spec, d_in, d_out):
    kernel = (d_out, d_in) if spec.transpose_kernel else (d_in, d_out)
    return [kernel] + ([(d_out,)] if spec.has_bias else [])


CASES = {
    # name: (spec, d_in, d_out, [(a_shape, g_shape) per use])
    "no_bias": (pe.DenseSpec(), 4, 3, [((5, 4), (5, 3))]),
    "bias": (pe.DenseSpec(has_bias=True), 4, 3, [((5, 4), (5, 3))]),
    "batch1": (pe.DenseSpec(has_bias=True), 4, 3, [((1, 4), (1, 3))]),
    "positions": (pe.DenseSpec(has_bias=True), 4, 3, [((3, 6, 4), (3, 6, 3))]),
    "positions_2d": (pe.DenseSpec(has_bias=True), 4, 3, [((3, 2, 5, 4), (3, 2, 5, 3))]),
    "positions_gram": (pe.DenseSpec(), 30, 40, [((3, 2, 30), (3, 2, 40))]),
    "transposed": (pe.DenseSpec(has_bias=True, transpose_kernel=True), 4, 3, [((5, 4), (5, 3))]),
    "transposed_positions": (pe.DenseSpec(transpose_kernel=True), 4, 3, [((3, 6, 4), (3, 6, 3))]),
    "multi_use": (
        pe.DenseSpec(has_bias=True),
        4,
        3,
        [((5, 4), (5, 3)), ((5, 4), (5, 3)), ((5, 4), (5, 3))],
    ),
    "multi_use_positions": (
        pe.DenseSpec(has_bias=True, transpose_kernel=True),
        4,
        3,
        [((3, 2, 4), (3, 2, 3)), ((3, 4), (3, 3))],
    ),
}


@pytest.mark.parametrize("dtype,mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_dense_matches_brute_force(name, dtype, mode):
    spec, d_in, d_out, uses = CASES[name]
    check(DEFAULT["dense"], spec, dense_op(spec), weights(spec, d_in, d_out), uses, dtype, mode)


@pytest.mark.parametrize(
    "rule",
    [
        pe.DenseRule(method="matmul", norm_method="gram"),
        pe.DenseRule(method="matmul", norm_method="materialize"),
        pe.DenseRule(method="outer", norm_method="materialize"),
    ],
)
def test_dense_explicit_methods(rule):
    spec = pe.DenseSpec(has_bias=True)
    check(rule, spec, dense_op(spec), weights(spec, 4, 3), [((5, 4), (5, 3))], tf.float64, "eager")
    if rule.method == "matmul":
        check(
            rule,
            spec,
            dense_op(spec),
            weights(spec, 4, 3),
            [((3, 6, 4), (3, 6, 3)), ((3, 4), (3, 3))],
            tf.float64,
            "eager",
        )


@pytest.mark.parametrize("mode", ["function", "xla"])
def test_dense_dynamic_batch(mode):
    spec = pe.DenseSpec(has_bias=True)
    sig = [tf.TensorSpec([None, 6, 4], tf.float64), tf.TensorSpec([None, 6, 3], tf.float64)]
    check(
        DEFAULT["dense"],
        spec,
        dense_op(spec),
        weights(spec, 4, 3),
        [((3, 6, 4), (3, 6, 3))],
        tf.float64,
        mode,
        input_signature=sig,
    )
    sig = [
        tf.TensorSpec([None, 4], tf.float64),
        tf.TensorSpec([None, 3], tf.float64),
    ]  # the outer-product path
    check(
        DEFAULT["dense"],
        spec,
        dense_op(spec),
        weights(spec, 4, 3),
        [((5, 4), (5, 3))],
        tf.float64,
        mode,
        input_signature=sig,
    )


def test_outer_product_xla_island_is_used_in_graphs():
    """Outside XLA, the traced outer product is a compiled function call."""
    rule = DEFAULT["dense"]
    fn = tf.function(
        lambda a, g: rule.per_example_grads((a, g), pe.DenseSpec())
    ).get_concrete_function(tf.TensorSpec([2, 4]), tf.TensorSpec([2, 3]))
    calls = [
        op
        for op in fn.graph.get_operations()
        if op.type in ("PartitionedCall", "StatefulPartitionedCall")
    ]
    assert calls and all(op.get_attr("_XlaMustCompile") for op in calls)


def test_checker_can_fail():
    """A rule told the wrong kernel layout must not pass the brute force."""
    spec = pe.DenseSpec()
    wrong = pe.DenseSpec(transpose_kernel=True)
    with pytest.raises(AssertionError):
        check(
            DEFAULT["dense"],
            wrong,
            dense_op(spec),
            weights(spec, 3, 3),
            [((4, 3), (4, 3))],
            tf.float64,
            "eager",
        )
