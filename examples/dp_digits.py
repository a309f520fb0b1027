"""Train a Keras model on scikit-learn's digits with DP-SGD through `fit`,
with the noise calibrated for a target epsilon.

    python examples/dp_digits.py --epsilon 8 --epochs 30

`kg.privacy.noise_for_epsilon` picks the noise multiplier for the planned
epochs; `kg.DPModel.fit` draws Poisson batches at rate batch_size / N, logs
epsilon (RDP) after every step, and the held-out accuracy and the privacy
statement are printed at the end. The model: softmax regression on the 64
pixels (``--hidden 0``, the default: at this data size DP favours few
parameters) or an MLP with one tanh hidden layer; the 8x8 digits ship with
scikit-learn (no download).
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
from absl import app, flags  # noqa: E402

import kfac_graph as kg  # noqa: E402
from digits_common import digits  # noqa: E402

flags.DEFINE_float("epsilon", 8.0, "target epsilon at --delta after --epochs")
flags.DEFINE_float("delta", 1e-5, "target delta")
flags.DEFINE_integer("epochs", 10, "epochs (each floor(N / batch_size) Poisson steps)")
flags.DEFINE_integer("batch_size", 128, "expected batch size")
flags.DEFINE_integer("hidden", 0, "hidden units (0: softmax regression)")
flags.DEFINE_float("l2_norm_clip", 1.0, "per-example clipping threshold")
flags.DEFINE_float("learning_rate", 1.0, "SGD learning rate")
flags.DEFINE_integer("seed", 0, "seed of the weights and the split (the noise and the "
                     "sampling always come from OS entropy)")
flags.DEFINE_integer("verbose", 2, "Keras verbosity")
FLAGS = flags.FLAGS


def model(hidden=0):
    hidden_layers = [keras.layers.Dense(hidden, activation="tanh")] if hidden else []
    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), *hidden_layers,
                             keras.layers.Dense(10)], name=f"digits_{hidden}")


def train(epsilon, epochs=10, batch_size=128, l2_norm_clip=1.0, learning_rate=1.0,
          delta=1e-5, seed=0, verbose=0, hidden=0):
    """(held-out accuracy, epsilon spent, noise multiplier, the DPModel);
    SGD with momentum 0.9."""
    keras.utils.set_random_seed(seed)
    (x_train, y_train), (x_test, y_test) = digits(seed)
    n = len(x_train)
    sigma = kg.privacy.noise_for_epsilon(epsilon, delta, epochs=epochs, num_examples=n,
                                         batch_size=batch_size)
    dp = kg.DPModel(model(hidden), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                       l2_norm_clip=l2_norm_clip, noise_multiplier=sigma, delta=delta)
    dp.compile(optimizer=keras.optimizers.SGD(learning_rate, momentum=0.9),
               metrics=["accuracy"])
    dp.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, verbose=verbose)
    _, accuracy = dp.evaluate(x_test, y_test, verbose=0)
    return accuracy, dp.epsilon(), sigma, dp


def main(argv):
    del argv
    accuracy, spent, sigma, model = train(FLAGS.epsilon, FLAGS.epochs, FLAGS.batch_size,
                                          FLAGS.l2_norm_clip, FLAGS.learning_rate,
                                          FLAGS.delta, FLAGS.seed, FLAGS.verbose, FLAGS.hidden)
    print(model.privacy_statement())
    print(f"noise multiplier {sigma:.4f}; test accuracy {accuracy:.4f} at epsilon "
          f"{spent:.3f} (delta {FLAGS.delta:g})")


if __name__ == "__main__":
    app.run(main)
