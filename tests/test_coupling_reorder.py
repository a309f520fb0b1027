"""A batch reordered or mixed inside the loss (`passes/coupling.py`).

In-batch mixup (``0.7 x + 0.3 reverse(x, [0])``), a loss that permutes its
batch (``gather(x, perm)``, ``gather(y, perm)``), a roll or a shuffle along
the batch put one example's data in another's row before any variable
reads it. Per-example gradients were then silently another example's (a
permutation: row i was example perm[i]'s gradient, so a Poisson mask in
DP-SGD kept an example it had dropped) or a mix of two (mixup); nothing
was listed as coupling and DP-SGD ran. Now the op is listed in
``reg.coupling`` and DP-SGD refuses in one line naming it. The same ops
along another axis (a reversed sequence) or picking each example's own
row couple nothing.
"""
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from passes.errors import KfacGraphError

B = 3
PERM = [2, 0, 1]

# name: (what the loss does to x [B, T, 4] and y [B] before the model)
REORDERS = {
    "mixup": lambda x, y: (0.7 * x + 0.3 * tf.reverse(x, [0]), y),
    "permuted": lambda x, y: (tf.gather(x, PERM), tf.gather(y, PERM)),
    "rolled": lambda x, y: (tf.roll(x, 1, axis=0), tf.roll(y, 1, axis=0)),
    "shuffled": lambda x, y: (tf.random.shuffle(x, seed=1), y),
}
OWN_ROWS = {
    "reversed_in_time": lambda x, y: (tf.reverse(x, [1]), y),
    "own_rows": lambda x, y: (tf.gather(x, list(range(B))), y),
    "rolled_in_time": lambda x, y: (tf.roll(x, 1, axis=1), y),
}


def _loss(reorder):
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.normal(size=(4, 3)), name="w")
    v = tf.Variable(rng.normal(size=(3, 2)), name="v")

    def loss(x, y):
        x, y = reorder(x, y)
        h = tf.reduce_mean(tf.tanh(tf.einsum("btd,dk->btk", x, w)), axis=1)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h @ v))
    x = tf.constant(rng.normal(size=(B, 5, 4)))
    return kg.auto_register(loss), (x, tf.constant([0, 1, 1]))


@pytest.mark.parametrize("name", sorted(REORDERS))
def test_a_batch_reordered_inside_the_loss_couples_the_examples(name):
    fn, args = _loss(REORDERS[name])
    reg = fn.registration(*args)
    assert reg.coupling, reg.summary()
    op = reg.ir.nodes[reg.coupling[0]]["op"]
    assert op in ("ReverseV2", "GatherV2", "Roll", "RandomShuffle"), reg.coupling
    with pytest.raises(KfacGraphError, match=f"couples the examples at op {reg.coupling[0]!r}"
                                             ".*the batch reordered or mixed"):
        kg.DPSGD(fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0).step(*args)


@pytest.mark.parametrize("name", sorted(OWN_ROWS))
def test_each_example_s_own_rows_couple_nothing(name):
    fn, args = _loss(OWN_ROWS[name])
    reg = fn.registration(*args)
    assert not reg.coupling, reg.coupling
    assert [layer.kind for layer in reg.layers] == ["dense", "dense"]
    kg.DPSGD(fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0).step(*args)


def test_mixup_by_shuffled_indices_couples_the_examples():
    """Mixup as it is usually written: ``gather(x, shuffle(range(B)))``."""
    def mixup(x, y):
        partner = tf.gather(x, tf.random.shuffle(tf.range(tf.shape(x)[0]), seed=2))
        return 0.8 * x + 0.2 * partner, y
    fn, args = _loss(mixup)
    assert [fn.registration(*args).ir.nodes[op]["op"] for op in
            fn.registration(*args).coupling] == ["GatherV2"]


def test_rows_filtered_by_a_mask_of_the_data_couple_nothing():
    """``boolean_mask`` (a ragged bag's values) gathers by ids read from the
    data: each row stays its example's, in order."""
    def masked(x, y):
        kept = tf.boolean_mask(x, tf.reduce_sum(x, axis=[1, 2]) > -1e9)
        return kept, y
    fn, args = _loss(masked)
    assert not fn.registration(*args).coupling
