"""Shared brute-force checker for the per-example rule tests (no tests here).

For uses `(a_u, c_u)`, the per-example loss is
`loss_i = sum_u sum(c_u[i] * op(a_u[i:i+1], *weights))`, so the gradient of
the summed loss w.r.t. each use's op output is exactly `c_u`: the rule gets
`(a_u, c_u)` and must match a Python loop of one-example `GradientTape`s.
"""

import numpy as np
import tensorflow as tf

import kfac_graph as kg
from kfac_graph import per_example as pe

RTOL = {tf.float64: 1e-6, tf.float32: 1e-4}
# (dtype, mode) pairs run for every case: each mode with at least one dtype.
MODES = [
    (tf.float64, "eager"),
    (tf.float32, "eager"),
    (tf.float32, "function"),
    (tf.float64, "xla"),
]
MODE_IDS = ["f64-eager", "f32-eager", "f32-function", "f64-xla"]


def brute_force(op, weights, uses):
    """Per-example grads (list aligned with `weights`) and squared norms."""
    batch = int(uses[0][0].shape[0])
    per_example = []
    for i in range(batch):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            loss = tf.add_n(
                [tf.reduce_sum(c[i : i + 1] * op(a[i : i + 1], *weights)) for a, c in uses]
            )
        per_example.append(tape.gradient(loss, weights))
    grads = [
        np.stack([tf.convert_to_tensor(pe_i[k]).numpy() for pe_i in per_example])
        for k in range(len(weights))
    ]
    sq = sum(np.sum(np.reshape(gk, [batch, -1]) ** 2, axis=1) for gk in grads)
    return grads, sq


def run_rule(rule, uses, spec, mode, input_signature=None):
    """`(grads, sq_norms)` of `rule` on `uses`, run eagerly / traced / by XLA."""
    flat = [t for use in uses for t in use]

    def fn(*flat_args):
        pairs = [(flat_args[2 * k], flat_args[2 * k + 1]) for k in range(len(flat_args) // 2)]
        arg = pairs[0] if len(pairs) == 1 else pairs
        return rule.per_example_grads(arg, spec), rule.squared_norms(arg, spec)

    if mode != "eager":
        fn = tf.function(fn, jit_compile=(mode == "xla"), input_signature=input_signature)
    grads, sq = fn(*flat)
    return [g.numpy() for g in grads], sq.numpy()


def assert_close(actual, expected, rtol, what=""):
    expected = np.asarray(expected)
    atol = rtol * max(1.0, float(np.max(np.abs(expected)))) if expected.size else 0
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


def random_uses(shapes, dtype, seed=0, int_high=None):
    """`[(a, c)]` from `[(a_shape, c_shape)]`; ids in [0, int_high) if given."""
    rng = np.random.default_rng(seed)
    out = []
    for a_shape, c_shape in shapes:
        if int_high is None:
            a = tf.constant(rng.standard_normal(a_shape), dtype)
        else:
            a = tf.constant(rng.integers(0, int_high, a_shape), tf.int32)
        out.append((a, tf.constant(rng.standard_normal(c_shape), dtype)))
    return out


def random_weights(shapes, dtype, seed=1):
    rng = np.random.default_rng(seed)
    return [tf.constant(rng.standard_normal(s), dtype) for s in shapes]


def check(
    rule, spec, op, weight_shapes, use_shapes, dtype, mode, int_high=None, input_signature=None
):
    """Asserts that `rule` matches the brute force on random data."""
    uses = random_uses(use_shapes, dtype, int_high=int_high)
    weights = random_weights(weight_shapes, dtype)
    want_grads, want_sq = brute_force(op, weights, uses)
    got_grads, got_sq = run_rule(rule, uses, spec, mode, input_signature)
    rtol = RTOL[dtype]
    assert len(got_grads) == len(want_grads)
    for k, (got, want) in enumerate(zip(got_grads, want_grads)):
        assert got.shape == want.shape, (k, got.shape, want.shape)
        assert_close(got, want, rtol, f"variable {k}")
    assert got_sq.shape == want_sq.shape
    assert_close(got_sq, want_sq, rtol, "squared norms")


DEFAULT = pe.default_registry()


def one_example_loop(loss_fn, args, variables):
    """Per variable ``[B, *shape]``: the gradient of ``loss_fn`` on each batch
    of one ``args[i:i+1]`` (``args`` may nest; zeros where the loss does not
    reach a variable)."""
    out = []
    for i in range(int(tf.nest.flatten(args)[0].shape[0])):
        one = tf.nest.map_structure(lambda a: a[i:i + 1], tuple(args))
        with tf.GradientTape() as tape:
            loss = loss_fn(*one)
        grads = tape.gradient(loss, list(variables))
        out.append([tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
                    for g, v in zip(grads, variables)])
    return [tf.stack(parts) for parts in zip(*out)]


def assert_matches_loop(loss_fn, args, rtol=1e-6, atol=1e-12):
    """``kg.per_example_gradients`` of ``loss_fn`` on ``args`` equals
    ``one_example_loop``, variable by variable; returns the registration."""
    reg = loss_fn.registration(*args)
    got = kg.per_example_gradients(loss_fn, *args)
    for v, g, w in zip(reg.variables, got, one_example_loop(loss_fn, args, reg.variables)):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=v.name)
    return reg
