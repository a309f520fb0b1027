"""Memory of the K-FAC state beside the parameters', with and without the
factor size budget (``max_factor_size``), from ``FisherEstimator.memory()``.

For each model it builds the estimator (no update: the sizes are those of
the variables) with the default budget (4096) and with none, and prints the
bytes of the parameters, of the blocks' statistics (factors) and of their
cached inverses, the ratio of the K-FAC state to the parameters, and how
many factors the budget kept diagonal. Without a budget a model whose full
factors would take more than ``--max_gib`` is not built; its row gives the
size those factors would take (groups x width^2 x 4 bytes, from the
budgeted estimator's factor widths).

    python benchmarks/fisher_memory.py [--models autoencoder,resnet50,lm] [--max_gib 2]
"""
from __future__ import annotations

import bench_env  # noqa: F401  (first: quiet logs, the repository importable)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import kfac_graph as kg  # noqa: E402
from kfac_graph.fisher.report import human_bytes  # noqa: E402

flags.DEFINE_list("models", ["autoencoder", "resnet50", "lm"], "Which models to report.")
flags.DEFINE_float("max_gib", 2.0, "Build the unbudgeted estimator only below this size.")
FLAGS = flags.FLAGS


def _autoencoder():
    widths = [256, 128, 32, 128, 256, 64]
    layers = [keras.layers.Dense(w, activation="tanh") for w in widths[:-1]]
    layers.append(keras.layers.Dense(widths[-1]))

    def loss_fn(x):
        z = x
        for layer in layers:
            z = layer(z)
        return tf.reduce_mean(tf.reduce_sum(
            tf.nn.sigmoid_cross_entropy_with_logits(labels=x, logits=z), axis=-1))

    return loss_fn, (tf.zeros([2, 64]),)


def _resnet50():
    model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)

    def loss_fn(x, y):
        probs = model(x, training=False)
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, probs))

    return loss_fn, (tf.zeros([2, 64, 64, 3]), tf.zeros([2], tf.int32))


def _lm(vocab=50257, width=128):
    """A GPT-2-sized vocabulary: embedding, an MLP, an untied head."""
    embed = keras.layers.Embedding(vocab, width)
    mlp = [keras.layers.Dense(4 * width, activation="relu"), keras.layers.Dense(width)]
    head = keras.layers.Dense(vocab)

    def loss_fn(ids, targets):
        h = embed(ids)
        h = h + mlp[1](mlp[0](h))
        logits = head(h)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits))

    ids = tf.zeros([2, 8], tf.int32)
    return loss_fn, (ids, ids)


MODELS = {"autoencoder": _autoencoder, "resnet50": _resnet50, "lm": _lm}


def _full_bytes(report, dtype_size=4):
    """What the factors and their inverses would take kept full."""
    return 2 * sum((f["groups"] or 1) * f["dim"] ** 2 * dtype_size
                   for layer in report["layers"] for f in layer["factors"]
                   if f["layout"] != "diagonal")


def _row(name, budget, report, note=""):
    total = report["total"]
    state = total["factors_bytes"] + total["inverses_bytes"]
    wide = sum(f["layout"] == "diagonal (wide)" for layer in report["layers"]
               for f in layer["factors"])
    return (f"| {name} | {budget} | {human_bytes(total['parameters'])} | "
            f"{human_bytes(total['factors_bytes'])} | {human_bytes(total['inverses_bytes'])} | "
            f"{state / total['parameters']:.2f} | {wide} |{note}")


def main(argv):
    del argv
    print("| model | max_factor_size | parameters | factors | inverses | (factors + inverses)"
          " / parameters | factors kept diagonal for the budget |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in FLAGS.models:
        loss_fn, args = MODELS[name]()
        fn = kg.auto_register(loss_fn)
        est = kg.FisherEstimator(fn)
        est.build(*args)
        report = est.memory()
        print(_row(name, "4096 (default)", report))
        full = _full_bytes(report)
        if full > FLAGS.max_gib * 2 ** 30:
            params = human_bytes(report["total"]["parameters"])
            print(f"| {name} | None | {params} | - | - | - | - | not built: its factors and "
                  f"inverses would take {human_bytes(full)} |")
            continue
        est = kg.FisherEstimator(fn, max_factor_size=None)
        est.build(*args)
        print(_row(name, "None", est.memory()))


if __name__ == "__main__":
    app.run(main)
