"""The loss pass on per-token losses (passes/match_loss.py, loss_weights.py):
which tensors it reads as weights and divisors, the reduction and scale it
reads, and the one-line errors for the forms it cannot read."""
import pytest
import tensorflow as tf

import passes
from passes import canonicalize, frontends
from passes.match_loss import match_loss

B, T, V, D = 2, 3, 4, 5
W = tf.Variable(tf.random.stateless_normal([D, V], [1, 2]), name="W")
ARGS = (tf.ones([B, T, D]), tf.zeros([B, T], tf.int32), tf.ones([B, T]))


def _match(fn, args=ARGS):
    return match_loss(canonicalize.canonicalize(frontends.to_ir(frontends.trace(fn, args))))


def _ce(y, x):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(y, tf.einsum("btd,dv->btv", x, W))


def test_masked_mean_reads_the_mask_and_the_divisor():
    loss = _match(lambda x, y, w: tf.reduce_sum(_ce(y, x) * w) / tf.reduce_sum(w))
    assert (loss.kind, loss.reduction, loss.scale) == ("categorical", "sum", 1.0)
    assert loss.weights == ("w:0",)
    assert len(loss.divisors) == 1 and loss.divisors[0].startswith("Sum")
    assert loss.targets == "y:0"


def test_weighted_mean_over_all_tokens_keeps_the_mean():
    loss = _match(lambda x, y, w: tf.reduce_mean(_ce(y, x) * w))
    assert (loss.reduction, loss.weights, loss.divisors) == ("mean", ("w:0",), ())
    assert loss.scale == pytest.approx(1 / T)


def test_where_mask_is_a_weight_and_the_masked_logits_are_seen_through():
    def fn(x, y, w):
        keep = w > 0
        logits = tf.where(keep[..., None], tf.einsum("btd,dv->btv", x, W), 0.0)
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
        return tf.reduce_sum(tf.where(keep, ce, 0.0)) / tf.reduce_sum(w)

    loss = _match(fn)
    assert len(loss.weights) == 1 and len(loss.divisors) == 1
    assert loss.output.startswith("einsum")


def test_flattened_logits_are_read_back_as_B_T_V():
    def fn(x, y, w):
        logits = tf.reshape(tf.einsum("btd,dv->btv", x, W), [-1, V])
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(tf.reshape(y, [-1]), logits)
        return tf.reduce_sum(ce * tf.reshape(w, [-1])) / tf.reduce_sum(w)

    loss = _match(fn)
    assert loss.output.startswith("einsum") and loss.targets == "y:0"
    assert loss.terms.startswith("SparseSoftmaxCrossEntropyWithLogits")


@pytest.mark.parametrize("fn, message", [
    (lambda x, y, w: tf.reduce_sum(_ce(y, x) * tf.reduce_sum(W)),
     r"op 'mul' multiplies two tensors that depend on the variables"),
    (lambda x, y, w: tf.reduce_sum(_ce(y, x)) / tf.reduce_sum(tf.exp(W)),
     r"op 'truediv' divides by a tensor that depends on the variables"),
    (lambda x, y, w: tf.reduce_sum(tf.where(w > 0, _ce(y, x), 1.0)),
     r"op 'SelectV2' selects between loss terms and something other than zeros"),
    (lambda x, y, w: -tf.reduce_sum(tf.one_hot(y, V) * tf.nn.log_softmax(
        tf.einsum("btd,dv->btv", x, W)) * tf.constant([1.0, 2.0, 1.0, 1.0])),
     r"op 'mul_1' weighs the classes of a categorical loss"),
])
def test_unreadable_weighted_forms_fail_in_one_line_naming_the_op(fn, message):
    with pytest.raises(passes.LossNotFoundError, match=message) as info:
        _match(fn)
    assert "\n" not in str(info.value)
