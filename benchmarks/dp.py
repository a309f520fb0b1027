"""DP-SGD against SGD: the cost of a private step, and what privacy costs in
accuracy.

Part 1, step time. For each model (float32, one process, calls interleaved,
medians of ``--reps`` rounds after a warm call) two steps on the same batch:

- ``sgd``: the batch gradient (``tf.GradientTape``) and ``v -= lr * g``, one
  ``tf.function``;
- ``dpsgd``: ``kg.DPSGD.step`` (flat clipping, ``method="auto"``: per-example
  norms by the layers' rules, then one reweighted backward pass; noise from
  OS-keyed Philox), also one ``tf.function``;
- ``dpsgd/pl``: the same with per-layer clipping (one backward pass per layer).

Target: dpsgd / sgd <= 2. Models: ``mlp`` 784-512-512-10 relu, batch 256;
``cnn`` the per-example benchmark's CNN (``per_example.py``: 32x32x3, conv
32, strided conv 64, depthwise, 1x1 conv 64, pool, dense 10), batch 64;
``transformer`` the character transformer LM of ``transformer_lm.py``
(``char_transformer.py``: 2 blocks, d 128, 4 heads, context 64, tied head,
per-token mean cross-entropy), batch 32. ``MODELS`` maps a name to a
builder of ``(keras model, x, y)``.

Part 2, accuracy. ``examples/dp_digits.py``'s training (softmax regression
on scikit-learn's digits, Poisson batches of expected size 128, 10 epochs,
clip 1, SGD with momentum) at epsilon 1, 3 and 8 (delta 1e-5; noise by
``kg.privacy.noise_for_epsilon``), and without privacy, over ``--seeds``
seeds; the mean held-out accuracy (360 digits) is tabulated and, when
matplotlib is importable, plotted to ``--plot``.

    python benchmarks/dp.py [--reps 15] [--models mlp,cnn,transformer] [--epsilons 1,3,8]
        [--seeds 3] [--plot docs/dp_accuracy.png] [--markdown out.md]
"""
import os
import sys
import time

import bench_env  # noqa: E402,F401  (first: quiet logs, the repository importable)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import char_transformer  # noqa: E402
import kfac_graph as kg  # noqa: E402
from char_text import CharText  # noqa: E402

sys.path.insert(0, os.path.join(bench_env.ROOT, "examples"))
import dp_digits  # noqa: E402

tf.get_logger().setLevel("ERROR")
FLAGS = flags.FLAGS
flags.DEFINE_integer("reps", 15, "interleaved rounds (medians)")
flags.DEFINE_list("models", ["mlp", "cnn", "transformer"], "models to time")
flags.DEFINE_list("epsilons", ["1", "3", "8"], "target epsilons for the accuracy table")
flags.DEFINE_integer("seeds", 3, "seeds per accuracy entry")
flags.DEFINE_string("plot", None, "save the accuracy plot here (needs matplotlib)")
flags.DEFINE_string("markdown", None, "also write the tables as markdown here")
flags.DEFINE_bool("skip_accuracy", False, "time the steps only")

TARGET = 2.0  # dpsgd / sgd


def _mlp():
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
    return (model, tf.constant(rng.standard_normal((256, 784)), tf.float32),
            tf.constant(rng.integers(0, 10, 256), tf.int32))


def _cnn():
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    L = keras.layers
    model = keras.Sequential([keras.Input((32, 32, 3)),
                              L.Conv2D(32, 3, padding="same", activation="relu"),
                              L.Conv2D(64, 3, strides=2, padding="same", activation="relu"),
                              L.DepthwiseConv2D(3, padding="same", activation="relu"),
                              L.Conv2D(64, 1, activation="relu"),
                              L.GlobalAveragePooling2D(), L.Dense(10)])
    return (model, tf.constant(rng.standard_normal((64, 32, 32, 3)), tf.float32),
            tf.constant(rng.integers(0, 10, 64), tf.int32))


def _transformer():
    """The character transformer LM of ``transformer_lm.py`` (2 blocks, d 128,
    4 heads, context 64, tied head) on a batch of 32 windows of the text."""
    text = CharText(64)
    model = char_transformer.build(text.vocab_size)
    x, y = text.batches(1, 32, 0)[0]
    return model, tf.constant(x), tf.constant(y)


# name -> builder of (keras model, x, y)
MODELS = {"mlp": _mlp, "cnn": _cnn, "transformer": _transformer}


def steps(model, x, y):
    """name -> a no-argument step, all on the same batch and weights."""
    variables = list(model.trainable_variables)

    @kg.auto_register
    def loss_fn(x, y):
        logits = model(x, training=True)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    @tf.function
    def sgd(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(x, y)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(1e-3 * tf.convert_to_tensor(g))
        return loss

    flat = kg.DPSGD(loss_fn, learning_rate=1e-3, l2_norm_clip=1.0, noise_multiplier=1.0)
    n_layers = len(loss_fn.registration(x, y).layers)
    per_layer = kg.DPSGD(loss_fn, learning_rate=1e-3, l2_norm_clip=[1.0] * n_layers,
                         noise_multiplier=1.0, clipping="per_layer")
    return {"sgd": lambda: sgd(x, y), "dpsgd": lambda: flat.step(x, y),
            "dpsgd/pl": lambda: per_layer.step(x, y)}


def time_interleaved(fns, reps):
    for f in fns.values():
        f()
        f()
    names, times = list(fns), {k: [] for k in fns}
    for r in range(reps):
        for k in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            fns[k]().numpy()
            times[k].append(time.perf_counter() - start)
    return {k: float(np.median(v)) for k, v in times.items()}


def accuracy_table(epsilons, seeds):
    """{epsilon or 'none': (mean accuracy, min, max, noise multiplier)}."""
    out = {}
    for eps in epsilons + [None]:
        accs, sigma = [], 0.0
        for seed in range(seeds):
            if eps is None:
                accs.append(_non_private(seed))
            else:
                acc, spent, sigma, _ = dp_digits.train(eps, seed=seed)
                assert spent <= eps
                accs.append(acc)
        out[eps] = (float(np.mean(accs)), min(accs), max(accs), sigma)
        print(f"epsilon {eps}: accuracy {out[eps][0]:.3f} ({min(accs):.3f}-{max(accs):.3f})",
              flush=True)
    return out


def _non_private(seed):
    """The same model, batches and optimizer without clipping or noise."""
    keras.utils.set_random_seed(seed)
    (x, y), (xt, yt) = dp_digits.digits(seed)
    model = dp_digits.model()
    model.compile(optimizer=keras.optimizers.SGD(1.0, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(x, y, batch_size=128, epochs=10, verbose=0)
    return model.evaluate(xt, yt, verbose=0)[1]


def _table(header, rows):
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _markdown(header, rows):
    return "\n".join(["| " + " | ".join(header) + " |",
                      "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
                     + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def main(argv):
    del argv
    started = time.time()
    header = ["model", "params", "batch", "sgd ms", "dpsgd / sgd", "dpsgd per-layer / sgd"]
    rows = []
    for name in FLAGS.models:
        model, x, y = MODELS[name]()
        t = time_interleaved(steps(model, x, y), FLAGS.reps)
        ratio = t["dpsgd"] / t["sgd"]
        rows.append([name, f"{model.count_params():,}", int(x.shape[0]),
                     f"{1e3 * t['sgd']:.1f}",
                     f"{ratio:.2f} {'PASS' if ratio <= TARGET else 'MISS'} (<={TARGET:g})",
                     f"{t['dpsgd/pl'] / t['sgd']:.2f}"])
        print(" | ".join(map(str, rows[-1])), flush=True)
    print("\n" + _table(header, rows))
    md = [_markdown(header, rows)]
    if not FLAGS.skip_accuracy:
        epsilons = [float(e) for e in FLAGS.epsilons]
        acc = accuracy_table(epsilons, FLAGS.seeds)
        acc_header = ["epsilon (delta 1e-5)", "noise multiplier", "held-out accuracy",
                      "min", "max"]
        acc_rows = [[("none (SGD)" if e is None else f"{e:g}"),
                     "-" if e is None else f"{acc[e][3]:.3f}", f"{acc[e][0]:.3f}",
                     f"{acc[e][1]:.3f}", f"{acc[e][2]:.3f}"] for e in epsilons + [None]]
        print("\n" + _table(acc_header, acc_rows))
        md.append(_markdown(acc_header, acc_rows))
        if FLAGS.plot:
            _plot(epsilons, acc, FLAGS.plot)
    command = " ".join(["python"] + sys.argv)
    note = (f"Conditions: TensorFlow {tf.__version__}, Keras {keras.__version__}, "
            f"{os.cpu_count()} CPU cores shared with other jobs, float32. Step ratios: medians "
            f"over {FLAGS.reps} interleaved rounds in one process after a warm call, both "
            "steps plain tf.functions (no XLA). Accuracy: mean over "
            f"{FLAGS.seeds} seeds of the split and weights (noise and sampling from OS "
            f"entropy). Total wall time {time.time() - started:.0f} s.")
    print(f"\ncommand: {command}\n\n{note}")
    if FLAGS.markdown:
        with open(FLAGS.markdown, "w") as f:
            f.write("\n\n".join(md) + f"\n\n`{command}`\n\n{note}\n")


def _plot(epsilons, acc, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no plot")
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    means = [acc[e][0] for e in epsilons]
    ax.errorbar(epsilons, means, yerr=[[m - acc[e][1] for m, e in zip(means, epsilons)],
                                       [acc[e][2] - m for m, e in zip(means, epsilons)]],
                marker="o", capsize=3, label="DP-SGD (kg.DPModel)")
    ax.axhline(acc[None][0], color="gray", linestyle="--", label="SGD, no privacy")
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(epsilons)
    ax.set_xticklabels([f"{e:g}" for e in epsilons])
    ax.set_xlabel("epsilon (delta = 1e-5)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("digits, softmax regression, 10 epochs")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    app.run(main)
