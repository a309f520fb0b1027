"""``kfac-rewrite``: turn a SavedModel into one that trains itself with K-FAC.

    kfac-rewrite --input model_dir --function loss --output trained_dir
    kfac-rewrite --input model_dir --function loss --dry_run
    kfac-rewrite --input graph.pb --function loss/value --dry_run

``--function`` names the saved ``tf.function`` computing the scalar loss
(its input signature fixes the shapes); for a GraphDef file (``.pb`` /
``.pbtxt``, inspection with ``--dry_run`` only) it names the loss tensor.
The output SavedModel needs only TensorFlow: ``kfac_step(*inputs)``,
``per_example_gradients(*inputs)``, ``update_inverses()``, the loss and
every other saved function (``kfac_graph.emit``). ``--report`` writes the
registration as JSON, ``--dot`` a Graphviz picture; ``--dry_run`` prints
the registration and writes nothing. Both reports list the ops that touch
the host (file reads and writes, Python callbacks, ...;
``passes/host_ops.py``), in the loss function and elsewhere; a loss
function that holds any is not rewritten without ``--allow_host_ops``.
K-FAC flags left unset take ``kg.KFAC``'s defaults; a set one must be in
``kg.KFAC``'s range (``KFAC.OPTIONS``). Bad input exits with status 2 and
one line ``kfac-rewrite: error: ...``, found before any work where it can
be (flags, every output path, the host ops), and nothing is left behind:
the model, the report and the picture are written whole or not at all.
"""
from __future__ import annotations

import os
import sys

from absl import flags

from tools import cli

PROG = "kfac-rewrite"
GRAPH_DEF_SUFFIXES = (".pb", ".pbtxt")
# (flag, kind, help): K-FAC options passed to kg.KFAC when set
KFAC_FLAGS = (
    ("learning_rate", "float", "Learning rate (momentum types regular and adam)."),
    ("damping", "float", "Initial damping lambda."),
    ("momentum", "float", "Momentum (regular and adam)."),
    ("momentum_type", ("regular", "adam", "qmodel"), "How the update is formed."),
    ("l2_reg", "float", "L2 regularisation added to the gradient and damping."),
    ("norm_constraint", "float", "KL clipping bound (regular and adam); 0 turns it off."),
    ("cov_update_period", "integer", "Steps between covariance updates."),
    ("inverse_update_period", "integer", "Steps between inverse refreshes."),
    ("stagger_inverses", "boolean", "Refresh each block's inverses in its own step of the "
     "inverse period."),
    ("overhead_budget", "float", "Pick the periods so the counted step is at most this many "
     "SGD steps (explicit periods win)."),
    ("cov_ema_decay", "float", "Decay of the factors' moving averages."),
    ("num_burnin_steps", "integer", "Steps that only accumulate statistics."),
    ("estimation_mode", ("sampled", "empirical", "exact"), "How the Fisher is estimated."),
    ("num_samples", "integer", "Sampled targets per example (sampled mode)."),
    ("adapt_damping", "boolean", "Adapt the damping by the Levenberg-Marquardt rule."),
    ("damping_adaptation_interval", "integer", "Steps between damping adaptations."),
    ("min_damping", "float", "Lower bound on the adapted damping."),
    ("qmodel_curvature", ("exact", "kfac"), "The quadratic model's curvature."),
    ("qmodel_batch_fraction", "float", "The share of the batch whose exact Fisher forms the "
     "quadratic model uses."),
    ("seed", "integer", "Seed of the sampled targets."),
    ("max_factor_size", "integer",
     "Kronecker factors wider than this keep their diagonal (default 4096); 0 turns it off."),
    ("factor_block_size", "integer", "Full Kronecker factors wider than this keep their "
     "diagonal blocks of at most this size (default: none)."),
    ("jit_compile", ("true", "false", "auto"),
     "XLA-compile the whole step (the preconditioning is compiled in every case)."),
)


def define_flags(fv: flags.FlagValues) -> flags.FlagValues:
    """Defines the tool's flags on ``fv`` (a fresh ``FlagValues`` per run)."""
    flags.DEFINE_string("input", None, "SavedModel directory (or a GraphDef file with "
                        "--dry_run).", flag_values=fv)
    flags.DEFINE_string("function", None, "Saved tf.function computing the loss (for a "
                        "GraphDef: the loss tensor).", flag_values=fv)
    flags.DEFINE_string("output", None, "Directory to write the training SavedModel to (must "
                        "not exist).", flag_values=fv)
    flags.DEFINE_string("report", None, "Also write the registration as JSON here.",
                        flag_values=fv)
    flags.DEFINE_string("dot", None, "Also write a Graphviz DOT picture here.", flag_values=fv)
    flags.DEFINE_boolean("dry_run", False, "Print the registration; write nothing.",
                         flag_values=fv)
    flags.DEFINE_enum("loss", None, ["categorical", "bernoulli", "normal"],
                      "Loss kind, if the pass cannot read it from the graph.", flag_values=fv)
    flags.DEFINE_boolean("allow_host_ops", False, "Rewrite a loss function that holds ops "
                         "that touch the host (file reads and writes, Python callbacks, ...).",
                         flag_values=fv)
    for name, kind, text in KFAC_FLAGS:
        if isinstance(kind, tuple):
            flags.DEFINE_enum(name, None, list(kind), text, flag_values=fv)
        elif kind == "boolean":
            flags.DEFINE_boolean(name, None, text, flag_values=fv)
        else:
            cli.define_number(name, kind == "integer", text, fv)
    return fv


def kfac_options(fv: flags.FlagValues) -> dict:
    """The K-FAC flags that were set, as ``kg.KFAC`` keyword arguments
    (unchecked: ``checked_kfac_options``)."""
    options = {name: fv[name].value for name, _, _ in KFAC_FLAGS if fv[name].value is not None}
    for name in ("norm_constraint", "max_factor_size"):
        if options.get(name) == 0:
            options[name] = None
    if "jit_compile" in options:
        options["jit_compile"] = {"true": True, "false": False}.get(options["jit_compile"], "auto")
    return options


def checked_kfac_options(fv: flags.FlagValues) -> dict:
    """``kfac_options`` checked by ``kg.KFAC``'s own ranges; a ``UsageError``
    ``--damping must be a finite number >= 0, got -1.0`` otherwise."""
    import kfac_graph as kg
    from kfac_graph import options as checks

    given = kfac_options(fv)
    try:
        if given.get("norm_constraint") is not None:  # 0 turns it off
            checks.check(None, "--norm_constraint", given["norm_constraint"], checks.Real(0.0))
        return kg.KFAC.check_options(None, "--", **given)
    except ValueError as e:
        raise cli.UsageError(str(e)) from None


def main(argv: list[str]) -> int:
    """Runs the tool on ``argv`` (``argv[0]`` is the program); the exit status."""
    return cli.main(argv, PROG, __doc__, define_flags, _run)


def _run(fv: flags.FlagValues) -> int:
    for name in ("input", "function"):
        if not fv[name].value:
            raise cli.UsageError(f"--{name} is required")
    if fv.dry_run:
        if fv.output or fv.report or fv.dot:
            raise cli.UsageError("--dry_run writes nothing; drop --output, --report and --dot")
    elif not fv.output:
        raise cli.UsageError("--output is required (or --dry_run to only print the registration)")
    graph_def = os.path.isfile(fv.input) and fv.input.endswith(GRAPH_DEF_SUFFIXES)
    if graph_def and not fv.dry_run:
        raise cli.UsageError(f"{fv.input} is a GraphDef; it can only be inspected with --dry_run "
                         "(rewriting needs a SavedModel)")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import kfac_graph as kg
    from kfac_graph import emit

    options = checked_kfac_options(fv)
    if fv.dry_run:
        if graph_def:
            registration = kg.register_graph_def(fv.input, fv.function, loss=fv.loss)
        else:
            _, fn, specs = emit.load_loss_function(fv.input, fv.function)
            registration = emit.registered_loss(fn, fv.function, fv.loss).registration(*specs)
        scan = emit.host_op_scan(fv.input, fv.function)
        print(f"{fv.input} :: {fv.function}")
        print(registration.summary())
        print("\n".join(scan.lines()))
        if scan.loss and not graph_def:
            print(f"{PROG} rewrites it only with --allow_host_ops")
        return 0
    try:
        registration = emit.rewrite_saved_model(
            fv.input, fv.function, fv.output, loss=fv.loss, allow_host_ops=fv.allow_host_ops,
            report=fv.report, dot=fv.dot, **options)
    except emit.HostOpsError as e:
        raise cli.UsageError(f"the loss function {e.function!r} holds ops that touch the host: "
                             f"{e.names}; rewrite it anyway with --allow_host_ops") from None
    print(registration.summary())
    print(f"wrote {os.path.abspath(fv.output)}: kfac_step, per_example_gradients, "
          f"update_inverses, {fv.function}")
    return 0


def run() -> None:
    sys.exit(main(sys.argv))


if __name__ == "__main__":
    run()
