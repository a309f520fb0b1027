"""Train a small Keras CNN on scikit-learn's digits with a raw K-FAC loop.

    python examples/custom_loop.py --steps 200

Write the loss as an ordinary function, wrap it with `kg.auto_register`,
and call `opt.step(x, y)`: one compiled step (forward, backward, Fisher
statistics, preconditioned update) that returns the loss before the update.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import kfac_graph as kg  # noqa: E402
from digits_common import cnn, digits  # noqa: E402

flags.DEFINE_integer("steps", 100, "training steps (batches)")
flags.DEFINE_integer("batch_size", 128, "batch size")
flags.DEFINE_integer("log_every", 25, "steps between log lines")
flags.DEFINE_float("learning_rate", 0.1, "K-FAC learning rate")
flags.DEFINE_float("damping", 1e-2, "K-FAC damping")
flags.DEFINE_integer("seed", 0, "random seed")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    keras.utils.set_random_seed(FLAGS.seed)
    (x_train, y_train), (x_test, y_test) = digits(FLAGS.seed)
    model = cnn()

    @kg.auto_register
    def loss_fn(images, labels):
        logits = model(images, training=True)
        return tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))

    opt = kg.KFAC(loss_fn, learning_rate=FLAGS.learning_rate, damping=FLAGS.damping,
                  seed=FLAGS.seed)
    train = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
             .shuffle(len(x_train), seed=FLAGS.seed).repeat()
             .batch(FLAGS.batch_size, drop_remainder=True))
    running = []
    for step, (images, labels) in enumerate(train.take(FLAGS.steps), start=1):
        running.append(float(opt.step(images, labels)))
        if step == 1:
            print(opt.registration.summary())
        if step % FLAGS.log_every == 0 or step == FLAGS.steps:
            print(f"step {step:5d}  train loss {np.mean(running):.4f}")
            running = []

    logits = model(x_test, training=False)
    test_loss = float(tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(y_test, logits)))
    accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
    print(f"test loss {test_loss:.4f}  test accuracy {accuracy:.4f}  "
          f"(K-FAC steps {int(opt.iterations.numpy())})")


if __name__ == "__main__":
    app.run(main)
