"""The token problem ``distributed_support.py`` runs (mode ``xla_embedding``)
on one device and, XLA-compiled, under ``MirroredStrategy``: a float64
embedding table, position embeddings sliced from theirs (as GPT-2's) and a
dense head over ``[4, 5]`` token ids, per-token softmax loss; K-FAC with a
covariance period of 2 (steps without statistics take the plain pass) and
exact-mode statistics."""

import numpy as np

VOCAB, WIDTH, BATCH, STEPS = 11, 6, (4, 5), 5


def train_tokens(momentum_type, strategy=None, jit_compile="auto"):
    """The final parameters and the skipped steps after ``STEPS`` steps."""
    import contextlib

    import tensorflow as tf

    import kfac_graph as kg

    rng = np.random.default_rng(0)
    init = [rng.normal(size=(VOCAB, WIDTH)), rng.normal(size=(7, WIDTH)) * 0.1,
            rng.normal(size=(WIDTH, VOCAB)) * 0.5, np.zeros(VOCAB)]
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        table, positions, w, b = [tf.Variable(v, dtype=tf.float64) for v in init]

        def loss(ids, y):
            h = tf.gather(table, ids) + tf.slice(positions, [0, 0], [BATCH[1], WIDTH])
            logits = tf.einsum("btd,dv->btv", tf.tanh(h), w) + b
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

        opt = kg.KFAC(kg.auto_register(loss), momentum_type=momentum_type,
                      estimation_mode="exact", cov_update_period=2, damping=1e-2,
                      jit_compile=jit_compile)
    for _ in range(STEPS):
        ids, y = (tf.constant(rng.integers(0, VOCAB, BATCH), tf.int32) for _ in range(2))
        opt.step(ids, y)
    params = np.concatenate([v.numpy().ravel() for v in (table, positions, w, b)])
    return params, int(opt.skipped_steps.numpy())
