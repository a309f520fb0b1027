"""Samplers: Poisson batch sizes, padding and masks; fixed-size batches."""
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg


def _data(n=2000):
    x = np.arange(n * 2, dtype="float32").reshape(n, 2) + 1.0  # no real row is all zeros
    return x, np.arange(n, dtype="int64")


def test_poisson_batch_sizes_have_the_binomial_mean_and_variance():
    n, q, steps = 2000, 0.05, 400
    batches = kg.privacy.poisson_batches(_data(n), q, steps=steps, seed=3)
    sizes, counts = [], np.zeros(n)
    for x, y, mask in batches:
        real = mask.numpy() == 1.0
        sizes.append(real.sum())
        counts[y.numpy()[real]] += 1
    sizes = np.array(sizes)
    assert len(sizes) == steps
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes.mean() - mean) < 5 * np.sqrt(var / steps)
    assert 0.7 * var < sizes.var() < 1.3 * var
    # each example is drawn with probability q at each step
    assert abs(counts.mean() - q * steps) < 0.05 * q * steps
    assert 0.7 * q * (1 - q) * steps < counts.var() < 1.3 * q * (1 - q) * steps


def test_poisson_batches_are_padded_to_few_sizes_with_a_mask():
    x, y = _data(500)
    q = 0.1
    m = int(np.ceil(np.sqrt(q * 500)))
    shapes = set()
    for xb, yb, mask in kg.privacy.poisson_batches((x, y), q, steps=40, seed=1):
        xb, yb, mask = xb.numpy(), yb.numpy(), mask.numpy()
        b = int(mask.sum())
        assert len(mask) % m == 0 and len(mask) - b < m and len(mask) >= m
        np.testing.assert_array_equal(mask, np.r_[np.ones(b), np.zeros(len(mask) - b)])
        np.testing.assert_array_equal(xb[:b], x[yb[:b]])  # real rows are examples
        assert len(set(yb[:b])) == b                      # each at most once
        assert not xb[b:].any() and not yb[b:].any()      # padding is zeros
        shapes.add(len(mask))
    assert len(shapes) <= 6


def test_poisson_batches_draw_afresh_each_pass_and_follow_the_seed():
    data = _data(300)
    first = [y.numpy() for _, y, _ in kg.privacy.poisson_batches(data, 0.1, steps=3, seed=5)]
    again = [y.numpy() for _, y, _ in kg.privacy.poisson_batches(data, 0.1, steps=3, seed=5)]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    repeated = kg.privacy.poisson_batches(data, 0.1, steps=3, seed=5).repeat(2)
    ys = [y.numpy() for _, y, _ in repeated]
    assert len(ys) == 6 and any(not np.array_equal(a, b) for a, b in zip(ys[:3], ys[3:]))
    secret = [y.numpy() for _, y, _ in kg.privacy.poisson_batches(data, 0.1, steps=1)]
    assert not np.array_equal(secret[0], first[0])


def test_a_dataset_pipeline_and_its_sampling_record():
    x, y = _data(100)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).map(lambda a, b: (a * 2.0, b))
    batches = kg.privacy.poisson_batches(ds, 0.2, seed=0)
    assert batches.privacy_sampling == kg.privacy.Sampling("poisson", 0.2, 100, 20.0)
    assert len(list(batches)) == 5  # one epoch: floor(1 / q) steps
    xb, yb, mask = next(iter(batches))
    b = int(mask.numpy().sum())
    np.testing.assert_array_equal(xb.numpy()[:b], 2.0 * x[yb.numpy()[:b]])


def test_the_fingerprint_names_what_decides_the_batches():
    """``dataset.privacy_fingerprint()``, which ``DPModel.fit`` compares across
    the workers of a ``MultiWorkerMirroredStrategy``: the same for the same
    seed, global ``tf.random`` seed and examples (and the same batches);
    another seed, global seed or example changes it."""
    from tensorflow.python.eager import context  # the global seed, to put back

    x, y = _data(50)
    make = lambda x=x, seed=5: kg.privacy.poisson_batches((x, y), 0.2, steps=2, seed=seed)
    first, again = make(), make()
    assert first.privacy_fingerprint() == again.privacy_fingerprint()
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a[1].numpy(), b[1].numpy())
    fixed = kg.privacy.fixed_size_batches((x, y), 10, seed=5)
    assert fixed.privacy_fingerprint() == first.privacy_fingerprint()  # one seed, one data
    other = x.copy()
    other[7, 1] += 1.0
    assert make(x=other).privacy_fingerprint() != first.privacy_fingerprint()
    assert make(seed=6).privacy_fingerprint() != first.privacy_fingerprint()
    words = lambda w: kg.privacy.poisson_batches((np.array(w), y[:2]), 0.5, seed=5)
    assert (words(["a", "bc"]).privacy_fingerprint() == words(["a", "bc"]).privacy_fingerprint()
            != words(["ab", "c"]).privacy_fingerprint())  # strings by their bytes
    previous = context.global_seed()
    try:
        tf.random.set_seed(1 if previous != 1 else 2)
        assert make().privacy_fingerprint() != first.privacy_fingerprint()
    finally:
        tf.random.set_seed(previous)


def test_fixed_size_batches_are_uniform_distinct_subsets():
    n, b, steps = 50, 10, 300
    batches = kg.privacy.fixed_size_batches(_data(n), b, steps=steps, seed=2)
    assert batches.privacy_sampling == kg.privacy.Sampling("fixed", 0.2, 50, 10)
    counts = np.zeros(n)
    for x, y in batches:
        y = y.numpy()
        assert len(y) == b and len(set(y)) == b
        counts[y] += 1
    expected = steps * b / n
    assert np.abs(counts - expected).max() < 5 * np.sqrt(expected)


@pytest.mark.parametrize("make, message", [
    (lambda: kg.privacy.poisson_batches(tf.data.Dataset.range(3).repeat(), 0.1),
     "finite dataset"),
    (lambda: kg.privacy.poisson_batches((np.zeros(3), np.zeros(4)), 0.1),
     "same number of examples"),
    (lambda: kg.privacy.poisson_batches(_data(10), 0.0), "sampling rate must be in"),
    (lambda: kg.privacy.fixed_size_batches(_data(10), 11), "batch_size must be an integer"),
    (lambda: kg.privacy.poisson_batches(_data(10), 0.5, pad_multiple=0), "pad_multiple"),
])
def test_bad_input_is_a_one_line_error(make, message):
    with pytest.raises(ValueError, match=message) as info:
        make()
    assert "\n" not in str(info.value)
