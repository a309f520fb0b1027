"""Runs ``kg.KFAC`` under ``tf.distribute`` in a fresh process (logical CPU
devices and ``TF_CONFIG`` must be set before TensorFlow starts), and the
single-device reference on the same problem; writes the results to an npz.

    python tests/distributed_support.py mirrored --devices 2 --out r.npz
    python tests/distributed_support.py mirrored_apart --devices 2 --out r.npz
    python tests/distributed_support.py keras --devices 2 --out r.npz
    python tests/distributed_support.py dp_keras --devices 2 --out r.npz
    python tests/distributed_support.py worker --out r.npz   # TF_CONFIG set
    python tests/distributed_support.py xla --devices 2 --out r.npz
    python tests/distributed_support.py xla_embedding --devices 2 --out r.npz

The problem: a float64 tanh MLP (5-8-3, softmax loss) and 20 batches of 16.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import distributed_dp_fit  # noqa: E402
from distributed_keras_fit import keras_fit  # noqa: E402
from distributed_xla_embedding import train_tokens  # noqa: E402

STEPS, BATCH = 20, 16
# regular momentum exercises the damping rule's curvature product, l2 and
# burn-in; qmodel the exact Fisher forms; all refresh inverses every 3 steps;
# regular_blocks keeps its factors in diagonal blocks (factor_blocks.py)
CONFIGS = {
    "regular": dict(momentum_type="regular", estimation_mode="exact", inverse_update_period=3,
                    num_burnin_steps=2, damping=1e-2, damping_adaptation_interval=2,
                    l2_reg=1e-3),
    "qmodel": dict(
        momentum_type="qmodel", estimation_mode="empirical", inverse_update_period=3, damping=1e-2
    ),
    # factors in diagonal blocks: A 6 -> 2 of 3, G 8 -> 2 of 4, A 9 -> 3 of 3
    "regular_blocks": dict(
        momentum_type="regular", estimation_mode="exact", inverse_update_period=3,
        damping=1e-2, factor_block_size=4,
    ),
}


def problem(seed=0):
    rng = np.random.default_rng(seed)
    weights = [
        rng.normal(size=(5, 8)) * 0.5,
        np.zeros(8),
        rng.normal(size=(8, 3)) * 0.5,
        np.zeros(3),
    ]
    batches = [
        (rng.normal(size=(BATCH, 5)), rng.integers(0, 3, BATCH).astype(np.int32))
        for _ in range(STEPS)
    ]
    return weights, batches


def make_loss(weights):
    import tensorflow as tf

    import kfac_graph as kg

    w1, b1, w2, b2 = [tf.Variable(w, dtype=tf.float64) for w in weights]

    def loss_fn(x, y):
        h = tf.tanh(tf.matmul(x, w1) + b1)
        logits = tf.matmul(h, w2) + b2
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    return [w1, b1, w2, b2], kg.auto_register(loss_fn)


def train(config, strategy=None, sync="lazy", counter=None, order=None, slice_stride=None,
          **extra):
    """Final parameters (and the optimizer) after ``STEPS`` steps on whole
    batches, their examples in ``order`` if given; ``slice_stride``: spread
    slices that far apart (what an overhead budget may pick), set once built."""
    import contextlib
    import dataclasses

    import tensorflow as tf

    import kfac_graph as kg

    weights, batches = problem()
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        variables, loss = make_loss(weights)
        opt = kg.KFAC(loss, sync_statistics=sync, **CONFIGS[config], **extra)
    if slice_stride:
        opt.build(*(tf.constant(t) for t in batches[0]))
        opt.schedule = dataclasses.replace(opt.schedule, slice_stride=slice_stride)
    losses = []
    for x, y in batches:
        if order is not None:
            x, y = x[order], y[order]
        losses.append(float(opt.step(tf.constant(x), tf.constant(y))))
    return [v.numpy() for v in variables], opt, losses


def leading_order(devices, fraction):
    """The examples of a batch reordered so that its first ``ceil(fraction B)``
    are the replicas' own first ``ceil(fraction B / devices)`` each: where
    one device's ``qmodel_batch_fraction`` forms are those of the replicas."""
    share = BATCH // devices
    lead = int(np.ceil(fraction * share))
    assert devices * lead == int(np.ceil(fraction * BATCH))
    first = [r * share + i for r in range(devices) for i in range(lead)]
    return np.array(first + [i for i in range(BATCH) if i not in first])


def slice_order(devices, period):
    """The examples of a batch reordered so that one device's ``j``-th
    ``spread_covariances`` slice holds the replicas' own ``j``-th slices."""
    share = BATCH // devices
    n = -(-share // period)
    assert devices * n == -(-BATCH // period) and period * n == share
    return np.array([r * share + j * n + i for j in range(period) for r in range(devices)
                     for i in range(n)])


def logical_devices(n):
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    return [d.name for d in tf.config.list_logical_devices("CPU")]


# Mirrored runs in one process must pack their statistics alike: every new
# MirroredStrategy on the same devices reuses the collectives' group and
# instance keys, and TensorFlow's collective runtime keeps the shapes an
# earlier run gave them ("Shape mismatch in the collective instance"). The
# configs APART run in a process of their own (mode "mirrored_apart").
APART = ("regular_blocks",)


def run_mirrored(devices, out, configs, options):
    """``configs``, then the runs ``options`` names (``{run: syncs}``, from
    ``OPTIONS`` and ``"checkpoint"``)."""
    names = logical_devices(devices)
    results = {}
    for config in configs:
        mirrored_config(config, names, out, results, options.get("checkpoint", ()))
    mirrored_options(devices, names, results, options)
    np.savez(out, **results)


def mirrored_config(config, names, out, results, checkpoint_syncs):
    """``config``'s single-device reference and its lazy and eager mirrored
    runs (losses, reduced bytes, replica spread, skips, a NaN batch, and for
    the syncs of ``checkpoint_syncs`` a checkpoint round trip) into ``results``."""
    import tensorflow as tf

    from kfac_graph.optimizer.reduction_counter import ReductionCounter

    ref, _, ref_losses = train(config)
    results[f"{config}/reference"] = np.concatenate([p.ravel() for p in ref])
    results[f"{config}/reference_losses"] = np.array(ref_losses)
    for sync in ("lazy", "eager"):
        strategy = tf.distribute.MirroredStrategy(names)
        counter = ReductionCounter(strategy)
        params, opt, losses = train(config, strategy, sync)
        key = f"{config}/{sync}"
        results[key] = np.concatenate([p.ravel() for p in params])
        results[key + "_losses"] = np.array(losses)
        results[key + "_bytes"] = np.array(int(counter.bytes.numpy()))
        # every replica holds the same parameters
        spread = max(
            float(np.max(np.abs(c.numpy() - v.values[0].numpy())))
            for v in opt.registration.variables
            for c in v.values
        )
        results[key + "_replica_spread"] = np.array(spread)
        results[key + "_skipped"] = np.array(int(opt.skipped_steps.numpy()))
        results[key + "_nan_batch"] = nan_batch_changes_nothing(opt)
        if sync in checkpoint_syncs:
            results[key + "_checkpoint"] = checkpoint_round_trip(
                config, names, sync, os.path.dirname(os.path.abspath(out)))


# option -> (config, one device's batch order, options), runs against one device's on
# reordered batches: each replica's forms on its own first half (qmodel_fraction), its
# statistics from its own slice (spread), a slice every 2nd step of period 4 (stride)
OPTIONS = {
    "qmodel_fraction": ("qmodel", lambda n: leading_order(n, 0.5),
                        dict(qmodel_batch_fraction=0.5)),
    "spread": ("regular", lambda n: slice_order(n, 2),
               dict(cov_update_period=2, spread_covariances=True)),
    "stride": ("regular", lambda n: slice_order(n, 2),
               dict(cov_update_period=4, spread_covariances=True, slice_stride=2)),
}


def mirrored_options(devices, names, results, selection):
    """The ``OPTIONS`` runs ``selection`` names (``{option: syncs}``) into ``results``."""
    for key, syncs in selection.items():
        if key in OPTIONS:
            config, order, options = OPTIONS[key]
            against_reordered(results, key, config, names, order(devices), syncs, **options)


def against_reordered(results, key, config, names, order, syncs, **options):
    """``results[key/...]``: the final parameters, flat, of one device's run on
    batches reordered by ``order`` (``reference``), of a mirrored run per
    statistics sync of ``syncs``, and of one device's run on the batches as
    they are (``unordered``)."""
    import tensorflow as tf
    flat = lambda params: np.concatenate([p.ravel() for p in params])  # noqa: E731
    results[f"{key}/reference"] = flat(train(config, order=order, **options)[0])
    for sync in syncs:
        strategy = tf.distribute.MirroredStrategy(names)
        results[f"{key}/{sync}"] = flat(train(config, strategy, sync, **options)[0])
    results[f"{key}/unordered"] = flat(train(config, **options)[0])


def checkpoint_round_trip(config, names, sync, directory):
    """``[uninterrupted, resumed]`` final parameters: 20 steps straight, and
    10 steps, a ``tf.train.Checkpoint`` save, a fresh optimizer and fresh
    variables (other initial values) under a new strategy restored from it,
    then the last 10 steps."""
    import tensorflow as tf

    import kfac_graph as kg

    weights, batches = problem()

    def run(steps, restore=None, save=None, initial=weights):
        strategy = tf.distribute.MirroredStrategy(names)
        with strategy.scope():
            variables, loss = make_loss(initial)
            opt = kg.KFAC(loss, sync_statistics=sync, **CONFIGS[config])
        checkpoint = tf.train.Checkpoint(params=variables, opt=opt)
        if restore is not None:
            opt.build(tf.constant(batches[0][0]), tf.constant(batches[0][1]))
            checkpoint.restore(restore).assert_consumed()
        for x, y in steps:
            opt.step(tf.constant(x), tf.constant(y))
        path = checkpoint.save(save) if save is not None else None
        return np.concatenate([v.numpy().ravel() for v in variables]), path

    straight, _ = run(batches)
    _, path = run(batches[:10], save=os.path.join(directory, f"{config}_{sync}"))
    other = [w + 1.0 for w in weights]  # overwritten by the restore
    resumed, _ = run(batches[10:], restore=path, initial=other)
    return np.stack([straight, resumed])


def nan_batch_changes_nothing(opt):
    """A batch with a NaN on one replica's share: the step is skipped on every
    replica (counted once), every replica's parameters and statistics stay as
    they were, and the next finite batch is applied. ``[skipped, changed,
    applied next]``."""
    import tensorflow as tf

    _, batches = problem(seed=1)
    x, y = batches[0]
    bad = x.copy()
    bad[-1, 0] = np.nan  # in the last replica's share

    def state():  # every copy of every variable but the skip counter
        return [c.numpy().copy() for v in opt.variables if v is not opt.skipped_steps
                for c in getattr(v, "values", [v])]

    before = state()
    skipped, iterations = int(opt.skipped_steps.numpy()), int(opt.iterations.numpy())
    opt.step(tf.constant(bad), tf.constant(y))
    after = state()
    changed = any(not np.array_equal(a, b, equal_nan=True) for a, b in zip(before, after)
                  if a.shape == b.shape)
    counted = int(opt.skipped_steps.numpy()) - skipped
    opt.step(tf.constant(x), tf.constant(y))
    applied = int(opt.iterations.numpy()) == iterations + 1
    return np.array([counted, int(changed), int(applied)])


def run_xla(devices, out):
    """The distributed step with every per-replica function compiled by XLA,
    and the op types in those compiled functions (for the host-callback check)."""
    import tensorflow as tf

    names = logical_devices(devices)
    ref, _, _ = train("qmodel")
    strategy = tf.distribute.MirroredStrategy(names)
    params, opt, _ = train("qmodel", strategy, jit_compile=True)
    op_types = set()
    compiled = 0
    for fn in opt._replicated._replica_fns.values():
        for concrete in fn._list_all_concrete_functions():
            if not concrete.function_def.attr["_XlaMustCompile"].b:
                continue
            compiled += 1
            graph_def = concrete.graph.as_graph_def()
            op_types.update(n.op for n in graph_def.node)
            for f in graph_def.library.function:
                op_types.update(n.op for n in f.node_def)
    np.savez(
        out,
        reference=np.concatenate([p.ravel() for p in ref]),
        xla=np.concatenate([p.ravel() for p in params]),
        whole_step_jit=np.array(opt.whole_step_jit),
        compiled=np.array(compiled),
        op_types=np.array(sorted(op_types)),
    )


def run_keras(devices, out):
    import tensorflow as tf

    names = logical_devices(devices)
    ref, ref_history, _ = keras_fit(None)
    strategy = tf.distribute.MirroredStrategy(names)
    params, history, iterations = keras_fit(strategy)
    np.savez(
        out,
        reference=ref,
        distributed=params,
        iterations=np.array(iterations),
        reference_loss=np.array(ref_history["loss"]),
        loss=np.array(history["loss"]),
        reference_accuracy=np.array(ref_history["accuracy"]),
        accuracy=np.array(history["accuracy"]),
    )


def run_xla_embedding(devices, out):
    """``distributed_xla_embedding.py``'s problem: one device without XLA, and
    the replicas' XLA-compiled step, regular momentum and the quadratic model."""
    import tensorflow as tf

    names = logical_devices(devices)
    results = {}
    for rule in ("regular", "qmodel"):
        results[f"{rule}/reference"], _ = train_tokens(rule)
        strategy = tf.distribute.MirroredStrategy(names)
        results[f"{rule}/xla"], results[f"{rule}/skipped"] = train_tokens(rule, strategy, True)
    np.savez(out, **results)


def run_worker(out, configs, parts):
    """One worker of a ``MultiWorkerMirroredStrategy`` cluster (``TF_CONFIG``):
    ``configs``, and of ``parts`` ``keras`` (``KFACModel.fit``) and the
    samplings ``fixed`` and ``poisson`` of ``DPModel.fit``."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    results = {}
    for config in configs:
        for sync in ("lazy", "eager"):
            params, opt, _losses = train(config, strategy, sync)
            results[f"{config}/{sync}"] = np.concatenate([p.ravel() for p in params])
            results[f"{config}/{sync}_blocks"] = np.array(opt._replicated.local_blocks)
    results["replicas"] = np.array(strategy.num_replicas_in_sync)
    if "keras" in parts:
        results["keras"], _, results["keras_iterations"] = keras_fit(strategy)
        results["keras_reference"], _, results["keras_reference_iterations"] = keras_fit(None)
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    samplings = [p for p in ("fixed", "poisson") if p in parts]
    results.update(distributed_dp_fit.run_worker(strategy, task, samplings))
    np.savez(out.replace(".npz", f"_{task}.npz"), **results)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["mirrored", "mirrored_apart", "keras", "dp_keras",
                                         "worker", "xla", "xla_embedding"])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated")
    parser.add_argument("--parts", default="keras,fixed,poisson", help="worker: comma-separated")
    parser.add_argument("--options", default=",".join(f"{o}:lazy:eager" for o in (
        *OPTIONS, "checkpoint")), help="mirrored: option:sync:sync,...")
    args = parser.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    options = {o.split(":")[0]: tuple(o.split(":")[1:]) for o in args.options.split(",") if o}
    if args.mode == "mirrored":
        run_mirrored(args.devices, args.out, [c for c in configs if c not in APART], options)
    elif args.mode == "mirrored_apart":
        run_mirrored(args.devices, args.out, [c for c in configs if c in APART],
                     {"checkpoint": options.get("checkpoint", ())})
    elif args.mode == "keras":
        run_keras(args.devices, args.out)
    elif args.mode == "dp_keras":
        distributed_dp_fit.run(logical_devices(args.devices), args.out)
    elif args.mode == "xla":
        run_xla(args.devices, args.out)
    elif args.mode == "xla_embedding":
        run_xla_embedding(args.devices, args.out)
    else:
        run_worker(args.out, configs, args.parts.split(","))


if __name__ == "__main__":
    main()
