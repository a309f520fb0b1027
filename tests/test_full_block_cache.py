"""A full block's cache: the damped inverse of its last refresh, made by
Cholesky (eigendecomposition only where rounding left the damped matrix
indefinite), and inverted afresh where the damping has changed since."""

import numpy as np
import tensorflow as tf

from kfac_graph import fisher
from kfac_graph.fisher import linalg

F64 = tf.float64


def _grads(rng, examples=7):
    return [tf.constant(rng.normal(size=(examples, 3, 2)))]


def _dense(block):
    return block.full_matrix().numpy()


def _apply(block, v, **kwargs):
    return block.multiply_inverse([tf.constant(v.reshape(3, 2))], **kwargs)[0].numpy().ravel()


def test_the_cache_is_the_refresh_snapshot_and_a_new_damping_inverts_the_current_factor():
    rng = np.random.default_rng(0)
    block = fisher.NaiveFullBlock([(3, 2)], dtype=F64)
    block.update(_grads(rng), decay=0.0)
    old = _dense(block)
    block.update_inverses(damping=0.1)
    block.update(_grads(rng), decay=0.0)  # the factor moves on; the cache does not
    new = _dense(block)
    assert not np.allclose(old, new)
    v = rng.normal(size=6)
    eye = np.eye(6)

    assert not bool(block.inverses_stale(damping=0.1))
    np.testing.assert_allclose(_apply(block, v, damping=0.1),
                               np.linalg.solve(old + 0.1 * eye, v), rtol=1e-10)
    assert bool(block.inverses_stale(damping=0.3))
    np.testing.assert_allclose(_apply(block, v, damping=0.3),
                               np.linalg.solve(new + 0.3 * eye, v), rtol=1e-10)
    np.testing.assert_allclose(block.inverse_damping.numpy(), 0.1)


def test_a_block_never_refreshed_inverts_on_the_fly():
    rng = np.random.default_rng(1)
    block = fisher.ScaleAndShiftFullBlock([(4,), (4,)], dtype=F64)
    xhat, g = tf.constant(rng.normal(size=(9, 4))), tf.constant(rng.normal(size=(9, 4)))
    block.update([(xhat, g)], decay=0.0)
    assert bool(block.inverses_stale(damping=0.2))
    v = rng.normal(size=8)
    got = block.multiply_inverse([tf.constant(v[:4]), tf.constant(v[4:])], damping=0.2)
    np.testing.assert_allclose(np.concatenate([t.numpy() for t in got]),
                               np.linalg.solve(_dense(block) + 0.2 * np.eye(8), v), rtol=1e-10)


def test_an_indefinite_damped_matrix_falls_back_to_clipped_eigenvalues():
    rng = np.random.default_rng(2)
    q, _ = np.linalg.qr(rng.normal(size=(5, 5)))
    evals = np.array([3.0, 1.0, 0.5, 0.0, -0.2])  # rounding's negative eigenvalue, exaggerated
    matrix = (q * evals) @ q.T
    damping = 0.1  # matrix + 0.1 I is indefinite: Cholesky fails
    by_cholesky = linalg.damped_inverse(tf.constant(matrix), tf.constant(damping, F64), False)
    assert not np.all(np.isfinite(by_cholesky))
    want = (q / (np.maximum(evals, 0.0) + damping)) @ q.T
    np.testing.assert_allclose(linalg.psd_damped_inverse(tf.constant(matrix), damping).numpy(),
                               want, rtol=1e-10, atol=1e-12)
    definite = (q * np.abs(evals)) @ q.T
    np.testing.assert_allclose(linalg.psd_damped_inverse(tf.constant(definite), damping).numpy(),
                               np.linalg.inv(definite + damping * np.eye(5)), rtol=1e-10)
