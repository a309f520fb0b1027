"""``kfac-graph`` (``python -m kfac_graph``): print a registration table, or
check a model (``verify``).

    kfac-graph [--train_steps 200] [--batch_size 64] [--dot graph.dot]
    kfac-graph --saved_model DIR --function NAME [--loss KIND] [--dot graph.dot]
    kfac-graph verify [--saved_model DIR --function NAME] [--batch_size 64]
        [--examples 4] [--estimation_mode exact] [--directions 2] [--seed 0]

With no flags it registers the built-in Keras CNN
(``kfac_graph.builtin_example``), prints its table, then trains it with
``kg.KFAC`` for ``--train_steps`` steps (default 200; 0 skips training) on
scikit-learn's digits (upsampled to the CNN's 16x16x3 input; a synthetic task
when scikit-learn is not importable), printing the loss and the held-out
accuracy. With ``--saved_model`` and ``--function`` it registers that saved
function instead (no training). ``--dot`` also writes a Graphviz picture.

``verify`` runs ``kg.verify`` (per-example gradients against the batch
gradient and one-example gradients, norms, and with ``--estimation_mode``
the Fisher blocks) on the built-in CNN, or on the saved function, on random
inputs of ``--batch_size`` examples made from its input signature (floats
standard normal, integers in [0, 2)); it prints the table and exits with
status 0 when every check passes, 1 when one fails.
Bad input exits with status 2 and one line ``kfac-graph: error: ...``.
"""
from __future__ import annotations

import functools
import os
import sys

from absl import flags

from tools import cli

PROG = "kfac-graph"
MODES = ("verify",)


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
    flags.DEFINE_integer("batch_size", 64, "Batch size of the built-in CNN's training run "
                         "(verify: of the inputs it checks on).", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("examples", 4, "verify: how many examples get the one-example check.",
                         lower_bound=0, flag_values=fv)
    flags.DEFINE_enum("estimation_mode", None, ["exact", "empirical"],
                      "verify: also check the full Fisher blocks against this Fisher.",
                      flag_values=fv)
    flags.DEFINE_integer("directions", 2, "verify: random directions per layer for the Fisher "
                         "check.", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("seed", 0, "verify: picks the examples, directions and random inputs.",
                         flag_values=fv)
    return fv


def main(argv: list[str]) -> int:
    """Runs the tool on ``argv`` (``argv[0]`` is the program; ``argv[1]`` may
    be the mode word ``verify``); the exit status."""
    mode = argv[1] if len(argv) > 1 and argv[1] in MODES else None
    if mode is not None:
        argv = [argv[0], *argv[2:]]
    return cli.main(argv, PROG, __doc__, define_flags, functools.partial(_run, mode=mode))


def _run(fv: flags.FlagValues, mode: str | None = None) -> int:
    if fv.saved_model and not fv.function:
        raise cli.UsageError("--saved_model needs --function")
    if fv.function and not fv.saved_model:
        raise cli.UsageError("--function needs --saved_model")
    if fv.dot:
        cli.check_writable(fv.dot)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import kfac_graph as kg
    from kfac_graph import builtin_example

    if mode == "verify":
        return _verify(fv)
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


def _verify(fv: flags.FlagValues) -> int:
    """``kfac-graph verify``: the table of ``kg.verify``; 0 if it passed, else 1."""
    import kfac_graph as kg
    from kfac_graph import builtin_example

    keep = None  # the loaded SavedModel owns the variables: alive until verified
    if fv.saved_model:
        from kfac_graph import emit

        keep, restored, _ = emit.load_loss_function(fv.saved_model, fv.function)
        fn = emit.registered_loss(restored, fv.function, loss=fv.loss)
        args = _random_inputs(restored.input_signature, fv.batch_size, fv.seed, fv.function)
        title = f"{fv.saved_model} :: {fv.function}, random inputs"
    else:
        _, fn, args = builtin_example.small_cnn(batch_size=fv.batch_size, seed=fv.seed)
        title = "built-in example: small Keras CNN (conv, batch norm, depthwise, 1x1 conv, dense)"
    print(f"verify: {title}")
    report = kg.verify(fn, *args, examples=fv.examples, directions=fv.directions,
                       estimation_mode=fv.estimation_mode, seed=fv.seed)
    print(report.table())
    del keep
    return 0 if report.passed else 1


def _random_inputs(signature, batch: int, seed: int, name: str):
    """Random arguments for ``signature`` (``TensorSpec``s): the first unknown
    axis is the batch (``batch``); floats standard normal, integers in
    [0, 2), booleans fair coins. ``cli.UsageError`` when a spec has another
    unknown axis or a dtype without a random draw."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)

    def make(spec):
        if not isinstance(spec, tf.TensorSpec) or spec.shape.rank is None:
            raise cli.UsageError(f"cannot make inputs for {name}: its signature has {spec!r}")
        dims = spec.shape.as_list()
        if dims and dims[0] is None:
            dims[0] = batch
        if None in dims:
            raise cli.UsageError(f"cannot make inputs for {name}: {spec.name or 'an input'} "
                                 f"has shape {spec.shape} with an unknown axis besides the batch")
        dtype = spec.dtype
        if dtype.is_floating:
            return tf.constant(rng.standard_normal(dims), dtype)
        if dtype.is_integer:
            return tf.constant(rng.integers(0, 2, dims), dtype)
        if dtype == tf.bool:
            return tf.constant(rng.integers(0, 2, dims).astype(bool))
        raise cli.UsageError(f"cannot make inputs for {name}: no random {dtype.name} input")

    return tuple(tf.nest.map_structure(make, tuple(signature)))


def run() -> None:
    sys.exit(main(sys.argv))


if __name__ == "__main__":
    run()
