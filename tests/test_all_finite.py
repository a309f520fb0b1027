"""The finiteness check the optimizer's step runs on its state: right on
every rank and dtype, and about one traced operation per tensor."""

import numpy as np
import pytest
import tensorflow as tf

from kfac_graph.optimizer import vectors as vec


@pytest.mark.parametrize("shape", [(), (3,), (2, 3), (2, 1, 4)])
@pytest.mark.parametrize("dtype", [tf.float16, tf.float32, tf.float64])
@pytest.mark.parametrize("bad", [None, np.nan, np.inf, -np.inf])
def test_flags_any_non_finite_entry(shape, dtype, bad):
    x = np.ones(shape)
    if bad is not None:
        x.flat[-1] = bad
    tensors = [tf.ones([2], dtype), tf.constant(x, dtype), tf.zeros([5], tf.int32)]
    assert bool(vec.all_finite(tensors)) is (bad is None)


def test_no_floating_tensor_is_finite():
    assert bool(vec.all_finite([])) and bool(vec.all_finite([tf.constant([1, 2])]))


def test_unknown_rank_inside_a_function():
    check = tf.function(vec.all_finite, input_signature=[[tf.TensorSpec(None, tf.float32)]])
    assert bool(check([tf.ones([2, 2])])) and not bool(check([tf.constant([[1.0, np.nan]])]))


def test_mixed_dtypes_each_checked():
    good, bad = tf.ones([3], tf.float64), tf.constant([np.nan], tf.float32)
    assert not bool(vec.all_finite([good, bad])) and bool(vec.all_finite([good, good]))


def test_traced_cost_is_about_one_op_per_tensor():
    def ops_for(n):
        graph = tf.Graph()
        with graph.as_default():
            tensors = [tf.compat.v1.placeholder(tf.float32, [4, 4]) for _ in range(n)]
            before = len(graph.get_operations())
            vec.all_finite(tensors + tensors)  # each tensor passed twice: checked once
            return len(graph.get_operations()) - before

    assert ops_for(40) - ops_for(20) == 20
