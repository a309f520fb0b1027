"""``python -m kfac_graph`` / ``kfac-graph``: print a registration table.

With no flags it registers the built-in Keras CNN, prints its table, then
trains it with ``kg.KFAC`` for ``--train_steps`` steps (default 200; 0 skips
training) on scikit-learn's digits (upsampled to the CNN's 16x16x3 input;
a synthetic task when scikit-learn is not importable), printing the loss
and the held-out accuracy. With ``--saved_model`` and ``--function`` it
registers that saved function instead (no training).
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("saved_model", None, "SavedModel directory to register.")
flags.DEFINE_string("function", None, "Name of the saved tf.function (or signature) computing the loss.")
flags.DEFINE_string("loss", None, 'Loss kind, if the pass cannot read it: "categorical", "bernoulli" or "normal".')
flags.DEFINE_string("dot", None, "Also write a Graphviz DOT picture of the graph to this path.")
flags.DEFINE_integer("train_steps", 200, "K-FAC steps to train the built-in CNN for (0: no training).")
flags.DEFINE_integer("batch_size", 64, "Batch size of the built-in CNN's training run.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    import kfac_graph as kg
    from kfac_graph import examples

    if FLAGS.saved_model:
        if not FLAGS.function:
            raise app.UsageError("--saved_model needs --function")
        try:
            registration = kg.register_saved_model(FLAGS.saved_model, FLAGS.function, loss=FLAGS.loss)
        except kg.KfacGraphError as e:
            print(f"kfac-graph: {e}", file=sys.stderr)
            return 1
        title = f"{FLAGS.saved_model} :: {FLAGS.function}"
    else:
        _, loss_fn, args = examples.small_cnn()
        registration = loss_fn.registration(*args)
        title = "built-in example: small Keras CNN (conv, batch norm, depthwise, 1x1 conv, dense)"
    print(title)
    print(registration.summary())
    if FLAGS.dot:
        registration.to_dot(FLAGS.dot)
        print(f"graph written to {FLAGS.dot}")
    if not FLAGS.saved_model and FLAGS.train_steps > 0:
        print()
        examples.train_small_cnn(steps=FLAGS.train_steps, batch_size=FLAGS.batch_size,
                                 log_every=max(1, FLAGS.train_steps // 4),
                                 momentum_type="qmodel", damping=1e-2)
    return 0


def run():
    app.run(main)


if __name__ == "__main__":
    run()
