"""Train a small Keras CNN on scikit-learn's digits with K-FAC through `fit`.

    python examples/keras_cnn.py --steps 200

The 8x8 digits ship with scikit-learn (no download). `kg.KFACModel` wraps
the Keras model; `compile` takes metrics but no optimizer; `fit`, its
progress bar and callbacks, `evaluate` and `predict` are Keras's own.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import kfac_graph as kg  # noqa: E402
from digits_common import cnn, digits  # noqa: E402

flags.DEFINE_integer("steps", 100, "training steps (batches)")
flags.DEFINE_integer("batch_size", 128, "batch size")
flags.DEFINE_integer("steps_per_epoch", 25, "steps between Keras epoch logs")
flags.DEFINE_float("learning_rate", 0.1, "K-FAC learning rate")
flags.DEFINE_float("damping", 1e-2, "K-FAC damping")
flags.DEFINE_integer("seed", 0, "random seed")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    keras.utils.set_random_seed(FLAGS.seed)
    (x_train, y_train), (x_test, y_test) = digits(FLAGS.seed)
    model = kg.KFACModel(
        cnn(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        learning_rate=FLAGS.learning_rate, damping=FLAGS.damping, seed=FLAGS.seed)
    model.compile(metrics=["accuracy"])
    train = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
             .shuffle(len(x_train), seed=FLAGS.seed).repeat()
             .batch(FLAGS.batch_size, drop_remainder=True))
    per_epoch = max(1, min(FLAGS.steps_per_epoch, FLAGS.steps))
    model.fit(train, steps_per_epoch=per_epoch, epochs=max(1, FLAGS.steps // per_epoch),
              shuffle=False, verbose=2)
    print(model.kfac.registration.summary())
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(f"test loss {loss:.4f}  test accuracy {accuracy:.4f}  "
          f"(K-FAC steps {int(model.kfac.iterations.numpy())})")


if __name__ == "__main__":
    app.run(main)
