"""Unit tests of the individual passes: inlining, canonicalization, the
einsum reader, the loss reader's arithmetic, and the command line."""
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import passes
from passes import canonicalize, frontends, inline, ir
from passes.match_loss import match_loss
from passes.patterns import einsum_kernel_layout


def _ir(fn, *args):
    return canonicalize.canonicalize(frontends.to_ir(frontends.trace(fn, args)))


def test_inlined_graph_computes_the_same_value():
    v = tf.Variable([[1.0, 2.0], [3.0, -1.0]])

    @tf.function
    def inner(x):
        return tf.nn.relu(tf.matmul(x, v))

    @tf.function
    def middle(x):
        return inner(x) * 2.0

    def outer(x):
        return tf.reduce_sum(middle(x) + inner(x))

    x = tf.constant([[0.5, -2.0], [1.0, 1.0]])
    traced = frontends.trace(outer, [x])
    ops = {n.op for n in traced.graph_def.node}
    assert not ops & {"PartitionedCall", "StatefulPartitionedCall"}

    @tf.function
    def run(x):
        holders = {f"{node}:0": tf.identity(v.handle) for node in traced.placeholder_variables}
        return tf.graph_util.import_graph_def(
            traced.graph_def, input_map={"x:0": x, **holders},
            return_elements=[traced.output])[0]

    value = run(x)
    assert np.allclose(value.numpy(), outer(x).numpy())


def test_follow_is_transitive():
    assert inline.follow({"a:0": "b:0", "b:0": "c:1"}, "a") == "c:1"


def test_canonicalize_sees_through_unit_reshapes_but_not_others():
    w = tf.Variable(tf.ones([3, 4]))

    def fn(x):
        h = tf.squeeze(tf.expand_dims(tf.cast(x, tf.float32), 1), 1)
        flat = tf.reshape(tf.matmul(h, w), [-1])
        return tf.reduce_sum(tf.stop_gradient(flat))

    g = _ir(fn, tf.ones([2, 3], tf.float64))
    types = {d["op"] for _, d in g.nodes(data=True)}
    assert not types & {"Cast", "ExpandDims", "Squeeze", "ReadVariableOp", "Identity"}
    assert {"Reshape", "StopGradient"} <= types
    (matmul,) = [n for n, d in g.nodes(data=True) if d["op"] == "MatMul"]
    assert g.nodes[matmul]["inputs"][0] == "x:0"


@pytest.mark.parametrize("equation, layout", [
    ("ab,bc->ac", "io"), ("abc,cd->abd", "io"), ("abc,dc->abd", "oi"),
    ("...b,bc->...c", "io"), ("ab,cd->ac", None), ("ab,bc->ca", None),
    ("abc,bd->acd", "io"),  # token mixing: the input's middle axis contracted (einsum_2d)
])
def test_einsum_kernel_layout(equation, layout):
    assert einsum_kernel_layout(equation) == layout


W = tf.Variable(tf.ones([3, 4]))


@pytest.mark.parametrize("make_loss, kind, reduction, scale", [
    (lambda z, y: tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, z)),
     "categorical", "mean", 1.0),
    (lambda z, y: tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(y, z)),
     "categorical", "sum", 1.0),
    (lambda z, y: 0.5 * tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(y, z)) / 5.0,
     "categorical", "mean", 0.5),
    (lambda z, y: -tf.reduce_mean(tf.reduce_sum(tf.one_hot(y, 4) * tf.nn.log_softmax(z), -1)),
     "categorical", "mean", 1.0),
    (lambda z, y: tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
        tf.cast(tf.one_hot(y, 4), tf.float32), z)), "bernoulli", "mean", 0.25),
    (lambda z, y: tf.reduce_sum(tf.math.squared_difference(z, tf.one_hot(y, 4))),
     "normal", "sum", 1.0),
    (lambda z, y: tf.reduce_mean(tf.square(tf.one_hot(y, 4) - z)) + 1e-3 * tf.reduce_sum(W ** 2),
     "normal", "mean", 0.25),
])
def test_loss_kind_reduction_and_scale(make_loss, kind, reduction, scale):
    def fn(x, y):
        return make_loss(tf.matmul(x, W), y)

    loss = match_loss(_ir(fn, tf.ones([5, 3]), tf.zeros([5], tf.int32)))
    assert (loss.kind, loss.reduction) == (kind, reduction)
    assert loss.scale == pytest.approx(scale)
    assert loss.output.startswith("MatMul")


def test_unreadable_loss_says_how_to_name_it():
    def fn(x):
        return tf.reduce_mean(tf.abs(tf.matmul(x, W)))

    g = _ir(fn, tf.ones([5, 3]))
    with pytest.raises(passes.LossNotFoundError, match=r'auto_register\(loss='):
        match_loss(g)
    assert match_loss(g, kind="normal").kind == "normal"


def test_shapes_of_variable_reads_are_known():
    g = _ir(lambda x: tf.reduce_sum(tf.matmul(x, W)), tf.ones([5, 3]))
    (matmul,) = [n for n, d in g.nodes(data=True) if d["op"] == "MatMul"]
    assert g.nodes[matmul]["shapes"][0] == (5, 4)
    assert ir.shape_of(g, g.nodes[matmul]["inputs"][1]) == (3, 4)


@pytest.mark.slow  # test_readme checks the same run's output against README's sample
def test_command_line_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "kfac_graph"], capture_output=True, text=True,
                         check=True, timeout=300).stdout
    for kind in ("conv2d", "scale_and_shift", "depthwise_conv2d", "dense"):
        assert kind in out
    assert "loss: categorical, mean" in out
