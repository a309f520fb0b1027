"""The ``DPModel.fit`` problem ``distributed_support.py`` runs on one device and
under ``MirroredStrategy`` or ``MultiWorkerMirroredStrategy``: a tanh MLP
(4-5-3) with an L2 kernel penalty, three batches of one fixed ``tf.data``
pipeline (the same batches on every run and every worker), fixed-size (16)
or padded Poisson batches (every fifth example masked out; 16 rows each, or
``sizes`` rows: 15, 15 and 16, which two replicas split 8/7, 8/7, 8/8, so
that one replica's share changes shape at the third step and the other's
does not), noise from one seed."""

import numpy as np


def dp_fit(strategy, sampling, noise_multiplier, dtype="float32", seed=3, sizes=None):
    """``(parameters, history, iterations)`` after one epoch of three steps, in
    Keras's float type ``dtype`` (put back afterwards), the noise from
    ``seed``, the batches of ``sizes`` rows (default 16 each)."""
    import keras

    previous = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)  # Keras may have cached another policy
    try:
        return _dp_fit(strategy, sampling, noise_multiplier, dtype, seed, sizes or (16,) * 3)
    finally:
        keras.config.set_floatx(previous[0])
        keras.config.set_dtype_policy(previous[1])


def _dp_fit(strategy, sampling, noise_multiplier, dtype, seed, sizes):
    import keras
    import tensorflow as tf

    import kfac_graph as kg

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(dtype)
    y = rng.integers(0, 3, 64)
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy is not None else tf.init_scope():
        inner = keras.Sequential([
            keras.Input((4,)),
            keras.layers.Dense(5, activation="tanh", kernel_regularizer="l2"),
            keras.layers.Dense(3)])
        model = kg.DPModel(inner, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), l2_norm_clip=0.5, noise_multiplier=noise_multiplier,
            sampling=sampling, seed=seed, num_examples=64, batch_size=16)
        model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"])
    # made in the scope, the generator's state is mirrored (the chief's on every
    # worker); one made outside keeps each worker's own seed, so that only the
    # step's all-reduce of replica 0's key can make the noise one draw
    model.noise = kg.privacy.NoiseSource(seed)
    data = (x, y) if sampling == "fixed" else (x, y, (np.arange(64) % 5 != 0).astype("float32"))
    ends = np.cumsum(sizes)
    batches = tf.data.Dataset.from_tensor_slices((ends - sizes, ends)).map(
        lambda start, end: tuple(t[start:end] for t in map(tf.constant, data)))
    history = model.fit(batches, epochs=1, verbose=0)
    params = np.concatenate([v.numpy().ravel() for v in inner.trainable_variables])
    return params, history.history, int(model.optimizer.iterations.numpy())


def run(devices, out):
    """``DPModel.fit`` on one device and under MirroredStrategy on ``devices``,
    per sampler; the results in the npz ``out``."""
    import tensorflow as tf

    results = {}
    for sampling in ("fixed", "poisson"):
        ref, ref_history, _ = dp_fit(None, sampling, 1.3)
        params, history, iterations = dp_fit(tf.distribute.MirroredStrategy(devices), sampling,
                                             1.3)
        results.update({f"{sampling}/reference": ref, f"{sampling}/distributed": params,
                        f"{sampling}/iterations": np.array(iterations)})
        for key in ("loss", "accuracy", "epsilon"):
            results[f"{sampling}/reference_{key}"] = np.array(ref_history[key])
            results[f"{sampling}/{key}"] = np.array(history[key])
    np.savez(out, **results)


def run_worker(strategy, task, samplings=("fixed", "poisson")):
    """The float64 ``DPModel.fit`` on one device (noise seed 3) and under
    ``strategy`` (worker ``task``'s ``MultiWorkerMirroredStrategy``, noise
    seed ``3 + task``: only the chief's key may count), for ``samplings``:
    fixed-size batches and padded Poisson batches of 15, 15 and 16 rows; the batches of
    ``poisson_batches`` from the seed the workers agree on; whether
    ``check_sampler`` passes samplers of one seed and data, and refuses
    per-worker seeds or examples; the refusal of validation:
    ``{name: array}``."""
    import tensorflow as tf

    import kfac_graph as kg
    from kfac_graph.privacy import replicas

    results = {}

    def record(name, fit):  # parameters, history, iterations
        results[name], history, results[f"{name}_iterations"] = fit
        results.update({f"{name}_{k}": history[k] for k in ("loss", "accuracy", "epsilon")})

    cases = [c for c in (("fixed", None), ("poisson", (15, 15, 16))) if c[0] in samplings]
    for sampling, sizes in cases:  # the references first: a worker ahead need not wait
        record(f"dp_{sampling}/reference", dp_fit(None, sampling, 1.3, "float64", 3, sizes))
    for sampling, sizes in cases:
        record(f"dp_{sampling}/distributed",
               dp_fit(strategy, sampling, 1.3, "float64", 3 + task, sizes))
    data = (np.arange(64.0)[:, None], np.arange(64))
    seed = replicas.sampler_seed(strategy)
    batches = kg.privacy.poisson_batches(data, 0.25, seed=seed, steps=3)
    results["dp_sampler_seed"] = np.array(seed)
    results["dp_sampler_batches"] = tf.concat([b[1] for b in batches], 0).numpy()
    samplers = (("same", 5, 0), ("other_seed", 5 + task, 0), ("other_examples", 5, task))
    checks = {f"sampler_{name}": lambda seed=seed, shift=shift: replicas.check_sampler(
        strategy, kg.privacy.poisson_batches((data[0] + shift, data[1]), 0.5, seed=seed))
        for name, seed, shift in samplers}
    checks["validation"] = lambda: replicas.check_validation(strategy, 0.25, None)
    for name, check in checks.items():
        try:
            check()
            results[f"dp_{name}"] = np.array("")
        except ValueError as error:
            results[f"dp_{name}"] = np.array(str(error))
    return results
