"""Brute-force Gauss-Newton blocks for losses over several model outputs
(``tests/test_joined_outputs.py``, ``tests/test_joined_vae.py``)."""
import numpy as np
import tensorflow as tf

import kfac_graph as kg
from per_example_reference import assert_matches_loop


def brute_ggn(variables, outputs, on_outputs, args):
    """(1/B) sum_i J_i^T H_i^+ J_i over ``variables``: ``z_i`` the outputs
    ``outputs(*args_i)`` of example i, side by side, ``J_i`` their Jacobian
    (an output that feeds another: the other's Jacobian holds it), ``H_i``
    the Hessian of example i's loss ``on_outputs(zs, *args_i)`` over them
    taken as independent, its negative eigenvalues set to zero."""
    total, batch = 0.0, int(args[0].shape[0])
    for i in range(batch):
        one = [a[i:i + 1] for a in args]
        with tf.GradientTape(persistent=True) as tape:
            zs = outputs(*one)
            z = tf.concat([tf.reshape(t, [1, -1]) for t in zs], axis=1)
        n = int(z.shape[1])
        j = np.concatenate([np.reshape(a.numpy(), [n, -1]) for a in
                            tape.jacobian(z, variables, experimental_use_pfor=False)], -1)
        z0 = tf.Variable(z)
        with tf.GradientTape(persistent=True) as outer:
            with tf.GradientTape() as inner:
                parts = tf.split(z0, [int(np.prod(t.shape[1:])) for t in zs], axis=1)
                li = on_outputs([tf.reshape(p, t.shape) for p, t in zip(parts, zs)], *one)
            g = inner.gradient(li, z0)
        h = np.reshape(outer.jacobian(g, z0).numpy(), [n, n])
        values, vectors = np.linalg.eigh(0.5 * (h + h.T))
        total = total + j.T @ ((vectors * np.maximum(values, 0)) @ vectors.T) @ j
    return total / batch


def brute_blocks(layers, outputs, on_outputs, args):
    """``brute_ggn``'s diagonal blocks, one per Keras layer of ``layers``,
    from one pass over the examples."""
    return brute_group_blocks([layer.trainable_variables for layer in layers], outputs,
                              on_outputs, args)


def brute_group_blocks(groups, outputs, on_outputs, args):
    """``brute_ggn``'s diagonal blocks, one per list of variables in
    ``groups``, from one pass over the examples."""
    variables = [v for group in groups for v in group]
    full, out, start = brute_ggn(variables, outputs, on_outputs, args), [], 0
    for group in groups:
        n = sum(int(np.prod(v.shape)) for v in group)
        out.append(full[start:start + n, start:start + n])
        start += n
    return out


def block(reg, est, name):
    """The estimator's full block of the layer whose name holds ``/name``."""
    return next(b for layer, b in zip(reg.layers, est.blocks)
                if f"/{name}" in layer.name).full_matrix().numpy()


def assert_joined_blocks(fn, args, layers, outputs, on_outputs, **estimator_options):
    """``fn``'s per-example gradients equal one-example tapes, its loss is
    ``ggn`` over the joined outputs, and each of ``layers``' exact full
    blocks equals ``brute_blocks``'. Returns the registration."""
    reg = assert_matches_loop(fn, args, rtol=1e-10)
    assert (reg.loss.kind, reg.loss.output) == ("ggn", "kfac_joined_outputs:0"), reg.loss
    est = kg.FisherEstimator(fn, estimation_mode="exact", cov_ema_decay=0.0,
                             approximations={"dense": "full"}, **estimator_options)
    est.update(*args)
    for layer, want in zip(layers, brute_blocks(layers, outputs, on_outputs, args)):
        np.testing.assert_allclose(block(reg, est, layer.name), want, rtol=1e-8, atol=1e-12)
    return reg
