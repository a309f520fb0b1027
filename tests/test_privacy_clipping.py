"""Clipping per layer, per group and automatic against their definitions
(float64, a loop of one-example tapes); masks; secure noise."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from per_example_reference import one_example_loop

B = 6


def _setup(seed=0):
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5,)),
                              keras.layers.Dense(4, activation="tanh", name="hidden"),
                              keras.layers.Dense(4, activation="tanh", name="middle"),
                              keras.layers.Dense(3, name="logits")])

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    x = tf.random.stateless_normal([B, 5], seed=[seed, 1], dtype=tf.float64) * 3.0
    y = tf.random.stateless_uniform([B], [seed, 2], maxval=3, dtype=tf.int32)
    reg = loss_fn.registration(x, y)
    return loss_fn, reg, (x, y)


def _loop(loss_fn, reg, args):
    """Per layer: the list of its variables' ``[B, ...]`` per-example gradients."""
    flat = [g.numpy() for g in one_example_loop(loss_fn, args, reg.variables)]
    out, k = [], 0
    for layer in reg.layers:
        out.append(flat[k:k + len(layer.variables)])
        k += len(layer.variables)
    return out


def _sq(grads):
    return sum(np.sum(g.reshape(B, -1) ** 2, 1) for g in grads)


def _reference(per_layer, groups, clips, automatic=False, gamma=0.01, mask=None, denom=B):
    """sum_i sum_k m_i w_ik g_ik / denom, written out."""
    out = [None] * len(per_layer)
    for members, c in zip(groups, clips):
        norms = np.sqrt(sum(_sq(per_layer[i]) for i in members))
        w = c / (norms + gamma) if automatic else np.minimum(1.0, c / norms)
        if mask is not None:
            w = w * mask
        for i in members:
            out[i] = [np.tensordot(w, g, axes=1) / denom for g in per_layer[i]]
    return [g for layer in out for g in layer]


def _close(got, want):
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("method", ["reweight", "materialize"])
def test_per_layer_clipping_is_its_definition(method):
    loss_fn, reg, args = _setup()
    per_layer = _loop(loss_fn, reg, args)
    clips = [0.05, 0.2, 0.1]
    for i, c in enumerate(clips):  # every layer clips some examples and not others
        norms = np.sqrt(_sq(per_layer[i]))
        clips[i] = float(np.median(norms))
    got = kg.dp_gradients(loss_fn, *args, l2_norm_clip=clips, noise_multiplier=0.0,
                          clipping="per_layer", method=method)
    _close(got, _reference(per_layer, [[0], [1], [2]], clips))
    by_name = dict(zip([layer.name for layer in reg.layers], clips))
    again = kg.dp_gradients(loss_fn, *args, l2_norm_clip=by_name, noise_multiplier=0.0,
                            clipping="per_layer", method=method)
    _close(again, _reference(per_layer, [[0], [1], [2]], clips))


@pytest.mark.parametrize("method", ["reweight", "materialize"])
def test_group_clipping_is_its_definition(method):
    loss_fn, reg, args = _setup(1)
    per_layer = _loop(loss_fn, reg, args)
    body = float(np.median(np.sqrt(_sq(per_layer[0]) + _sq(per_layer[1]))))
    head = float(np.median(np.sqrt(_sq(per_layer[2]))))
    got = kg.dp_gradients(loss_fn, *args, l2_norm_clip={"body": body, "head": head},
                          noise_multiplier=0.0, method=method,
                          clipping={"body": ["*hidden*", "*middle*"], "head": ["*logits*"]})
    _close(got, _reference(per_layer, [[0, 1], [2]], [body, head]))


@pytest.mark.parametrize("clipping, groups", [("flat", [[0, 1, 2]]),
                                              ("per_layer", [[0], [1], [2]])])
def test_automatic_clipping_normalises(clipping, groups):
    loss_fn, reg, args = _setup(2)
    per_layer = _loop(loss_fn, reg, args)
    got = kg.dp_gradients(loss_fn, *args, l2_norm_clip=0.5, noise_multiplier=0.0,
                          clipping=clipping, automatic_clipping=True)
    _close(got, _reference(per_layer, groups, [0.5] * len(groups), automatic=True))


@pytest.mark.parametrize("method", ["reweight", "materialize"])
def test_a_masked_example_contributes_exactly_nothing(method):
    loss_fn, reg, (x, y) = _setup(3)
    per_layer = _loop(loss_fn, reg, (x, y))
    mask = np.array([1, 1, 0, 1, 0, 1], np.float64)
    got = kg.dp_gradients(loss_fn, x, y, l2_norm_clip=0.1, noise_multiplier=0.0, method=method,
                          mask=mask, expected_batch_size=4.5)
    _close(got, _reference(per_layer, [[0, 1, 2]], [0.1], mask=mask, denom=4.5))
    keep = mask == 1  # the same as the real examples alone
    alone = kg.dp_gradients(loss_fn, tf.boolean_mask(x, keep), tf.boolean_mask(y, keep),
                            l2_norm_clip=0.1, noise_multiplier=0.0, method=method,
                            mask=np.ones(4), expected_batch_size=4.5)
    _close(got, [g.numpy() for g in alone])
    with pytest.raises(ValueError, match="give expected_batch_size"):
        kg.dp_gradients(loss_fn, x, y, l2_norm_clip=0.1, noise_multiplier=0.0, mask=mask)


def test_noise_follows_the_sensitivity_of_per_layer_clipping():
    loss_fn, reg, args = _setup(4)
    clips = [0.3, 0.4, 1.2]  # sensitivity sqrt(0.09 + 0.16 + 1.44) = 1.3
    common = dict(l2_norm_clip=clips, clipping="per_layer")
    clean = kg.dp_gradients(loss_fn, *args, noise_multiplier=0.0, **common)
    noisy = kg.dp_gradients(loss_fn, *args, noise_multiplier=2.0, seed=(4, 5), **common)
    noise = np.concatenate([np.ravel((n - c) * B) for n, c in zip(noisy, clean)])
    assert abs(noise.std() - 2.0 * 1.3) < 0.25 * 2.0 * 1.3  # ~80 draws


def test_noise_without_a_seed_is_fresh_and_a_secure_mode_refuses_seeds():
    loss_fn, reg, args = _setup(5)
    draws = [kg.dp_gradients(loss_fn, *args, l2_norm_clip=0.1, noise_multiplier=1.0)[0]
             for _ in range(2)]
    assert not np.allclose(draws[0], draws[1])
    in_graph = tf.function(lambda x, y: kg.dp_gradients(loss_fn, x, y, l2_norm_clip=0.1,
                                                        noise_multiplier=1.0)[0])
    assert not np.allclose(in_graph(*args), in_graph(*args))  # OS entropy at every run
    a, b = kg.privacy.NoiseSource(seed=7), kg.privacy.NoiseSource(seed=7)
    np.testing.assert_array_equal(a.next_key(), b.next_key())
    assert not np.array_equal(kg.privacy.NoiseSource().next_key(),
                              kg.privacy.NoiseSource().next_key())
    with pytest.raises(ValueError, match="secure_mode refuses a fixed noise seed"):
        kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=3,
                 secure_mode=True)
    kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0,
             secure_mode=True).step(*args)


@pytest.mark.parametrize("clipping, clip, message", [
    ("per_layer", [1.0, 2.0], "2 thresholds for 3 layers"),
    ("per_layer", {"nope": 1.0}, "no threshold for layer"),
    ({"a": ["*hidden*"]}, 1.0, "matches no group"),
    ({"a": ["*"], "b": ["*logits*"]}, 1.0, "matches groups a, b"),
    ({"a": ["*"], "b": ["zzz"]}, 1.0, "clipping group .b. matches no layer"),
    ("per_example", 1.0, "clipping must be"),
    ("per_layer", -1.0, "l2_norm_clip must be a finite number > 0"),
])
def test_bad_clipping_is_a_one_line_error(clipping, clip, message):
    loss_fn, reg, args = _setup()
    with pytest.raises(ValueError, match=message) as info:
        kg.dp_gradients(loss_fn, *args, l2_norm_clip=clip, noise_multiplier=0.0,
                        clipping=clipping)
    assert "\n" not in str(info.value)


def test_noise_keys_carry_128_bits():
    """Each key is two full int64s, and the noise depends on all their bits:
    keys of 32 bits could be searched against a released update (2^32
    tries) and the noise subtracted."""
    noise = kg.privacy.noise
    keys = np.stack([noise.fresh_key().numpy() for _ in range(8)]
                    + [kg.privacy.NoiseSource().next_key().numpy() for _ in range(8)]
                    + [tf.function(noise.fresh_key)().numpy() for _ in range(8)])
    assert keys.dtype == np.int64 and keys.shape == (24, 2)
    assert np.all(np.any(np.abs(keys) >= 2 ** 40, axis=0)), "the high bits never vary"
    t = [tf.zeros([6])]
    draws = [noise.gaussian(t, 1.0, tf.constant(k, tf.int64))[0].numpy()
             for k in ([5, 9], [5 + 2 ** 40, 9], [5, 9 + 2 ** 40])]
    assert not np.allclose(draws[0], draws[1]) and not np.allclose(draws[0], draws[2])


def test_the_noise_is_standard_normal():
    from scipy import stats
    for dtype in (tf.float32, tf.float64):
        z = kg.privacy.noise.standard_normal([20001], tf.constant([3, 4]), dtype).numpy()
        assert z.dtype == dtype.as_numpy_dtype and z.shape == (20001,)
        assert stats.kstest(z, "norm").pvalue > 1e-3
        pairs = z[:10000], z[10000:20000]  # the cos and sin halves are independent
        assert abs(np.corrcoef(*pairs)[0, 1]) < 0.05


def test_conv_and_shared_weights_clip_by_their_definition():
    """A conv (the reweighted step through its own op) and a dense layer applied
    twice (shared weights: a backward pass of the reweighted loss terms)."""
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(6)
    conv = keras.layers.Conv2D(3, 3, padding="same", activation="tanh", name="conv")
    shared = keras.layers.Dense(12, activation="tanh", name="shared")
    head = keras.layers.Dense(3, name="head")

    @kg.auto_register
    def loss_fn(x, y):
        h = keras.layers.Flatten()(conv(x))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, head(shared(shared(h)))))

    x = tf.random.stateless_normal([B, 2, 2, 3], seed=[6, 1], dtype=tf.float64) * 2.0
    y = tf.random.stateless_uniform([B], [6, 2], maxval=3, dtype=tf.int32)
    reg = loss_fn.registration(x, y)
    assert [layer.uses for layer in reg.layers] == [1, 2, 1]
    per_layer = _loop(loss_fn, reg, (x, y))
    clips = [float(np.median(np.sqrt(_sq(g)))) for g in per_layer]
    for method in ("reweight", "materialize"):
        got = kg.dp_gradients(loss_fn, x, y, l2_norm_clip=clips, noise_multiplier=0.0,
                              clipping="per_layer", method=method)
        _close(got, _reference(per_layer, [[0], [1], [2]], clips))


def test_dpsgd_steps_on_masked_poisson_batches():
    loss_fn, reg, (x, y) = _setup(7)
    per_layer = _loop(loss_fn, reg, (x, y))
    mask = np.array([1, 0, 1, 1, 1, 0], np.float64)
    before = [v.numpy() for v in reg.variables]
    sampling = kg.privacy.Sampling.make(sample_rate=0.1, num_examples=50)  # qN = 5
    opt = kg.DPSGD(loss_fn, learning_rate=0.5, l2_norm_clip=0.2, noise_multiplier=0.0,
                   sampling=sampling)
    opt.step(x, y, mask=tf.constant(mask))
    want = _reference(per_layer, [[0, 1, 2]], [0.2], mask=mask, denom=5.0)
    _close([v.numpy() - b for v, b in zip(reg.variables, before)], [-0.5 * w for w in want])


@pytest.mark.parametrize("method", ["reweight", "materialize"])
def test_mixed_precision_gives_float32_sums_near_the_batch_gradient(method):
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(8)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                              keras.layers.Dense(3, dtype="float32")])

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    x = tf.random.stateless_normal([7, 6], seed=[8, 1])
    y = tf.constant([0, 1, 2, 0, 1, 2, 0])
    reg = loss_fn.registration(x, y)
    with tf.GradientTape() as tape:
        loss = loss_fn(x, y)
    want = tape.gradient(loss, list(reg.variables))
    got = kg.dp_gradients(loss_fn, x, y, l2_norm_clip=1e9, noise_multiplier=0.0, method=method)
    for g, w in zip(got, want):
        assert g.dtype == tf.float32
        np.testing.assert_allclose(g, w, atol=2e-3)


def test_sequence_layers_clip_by_their_definition():
    """Dense and EinsumDense on [B, T, d] (outputs with positions after the
    batch axis), a per-sequence mean loss."""
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(9)
    proj = keras.layers.EinsumDense("btd,de->bte", output_shape=(None, 4), bias_axes="e",
                                    activation="tanh")
    head = keras.layers.Dense(3)

    @kg.auto_register
    def loss_fn(x, y):
        logits = tf.reduce_mean(head(proj(x)), axis=1)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    x = tf.random.stateless_normal([B, 5, 3], seed=[9, 1], dtype=tf.float64) * 2.0
    y = tf.random.stateless_uniform([B], [9, 2], maxval=3, dtype=tf.int32)
    reg = loss_fn.registration(x, y)
    per_layer = _loop(loss_fn, reg, (x, y))
    clip = float(np.median(np.sqrt(sum(_sq(g) for g in per_layer))))
    for method in ("reweight", "materialize"):
        got = kg.dp_gradients(loss_fn, x, y, l2_norm_clip=clip, noise_multiplier=0.0,
                              method=method)
        _close(got, _reference(per_layer, [list(range(len(per_layer)))], [clip]))
