"""``kfac-graph`` (``python -m kfac_graph``): print a registration table.

    kfac-graph [--train_steps 200] [--batch_size 64] [--dot graph.dot]
    kfac-graph --saved_model DIR --function NAME [--loss KIND] [--dot graph.dot]

With no flags it registers the built-in Keras CNN
(``kfac_graph.builtin_example``), prints its table, then trains it with
``kg.KFAC`` for ``--train_steps`` steps (default 200; 0 skips training) on
scikit-learn's digits (upsampled to the CNN's 16x16x3 input; a synthetic task
when scikit-learn is not importable), printing the loss and the held-out
accuracy. With ``--saved_model`` and ``--function`` it registers that saved
function instead (no training). ``--dot`` also writes a Graphviz picture.
Bad input exits with status 2 and one line ``kfac-graph: error: ...``.
"""
from __future__ import annotations

import os
import sys

from absl import flags

from tools import cli

PROG = "kfac-graph"


def define_flags(fv: flags.FlagValues) -> flags.FlagValues:
    """Defines the tool's flags on ``fv`` (a fresh ``FlagValues`` per run)."""
    flags.DEFINE_string("saved_model", None, "SavedModel directory to register.",
                        flag_values=fv)
    flags.DEFINE_string("function", None, "Name of the saved tf.function (or signature) "
                        "computing the loss.", flag_values=fv)
    flags.DEFINE_enum("loss", None, ["categorical", "bernoulli", "normal"],
                      "Loss kind, if the pass cannot read it from the graph.", flag_values=fv)
    flags.DEFINE_string("dot", None, "Also write a Graphviz DOT picture of the graph to this "
                        "path.", flag_values=fv)
    flags.DEFINE_integer("train_steps", 200, "K-FAC steps to train the built-in CNN for "
                         "(0: no training).", lower_bound=0, flag_values=fv)
    flags.DEFINE_integer("batch_size", 64, "Batch size of the built-in CNN's training run.",
                         lower_bound=1, flag_values=fv)
    return fv


def main(argv: list[str]) -> int:
    """Runs the tool on ``argv`` (``argv[0]`` is the program); the exit status."""
    return cli.main(argv, PROG, __doc__, define_flags, _run)


def _run(fv: flags.FlagValues) -> int:
    if fv.saved_model and not fv.function:
        raise cli.UsageError("--saved_model needs --function")
    if fv.function and not fv.saved_model:
        raise cli.UsageError("--function needs --saved_model")
    if fv.dot:
        cli.check_writable(fv.dot)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import kfac_graph as kg
    from kfac_graph import builtin_example

    if fv.saved_model:
        registration = kg.register_saved_model(fv.saved_model, fv.function, loss=fv.loss)
        title = f"{fv.saved_model} :: {fv.function}"
    else:
        _, loss_fn, args = builtin_example.small_cnn()
        registration = loss_fn.registration(*args)
        title = "built-in example: small Keras CNN (conv, batch norm, depthwise, 1x1 conv, dense)"
    print(title)
    print(registration.summary())
    if fv.dot:
        registration.to_dot(fv.dot)
        print(f"graph written to {fv.dot}")
    if not fv.saved_model and fv.train_steps > 0:
        print()
        builtin_example.train_small_cnn(steps=fv.train_steps, batch_size=fv.batch_size,
                                        log_every=max(1, fv.train_steps // 4),
                                        momentum_type="qmodel", damping=1e-2)
    return 0


def run() -> None:
    sys.exit(main(sys.argv))


if __name__ == "__main__":
    run()
