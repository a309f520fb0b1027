"""K-FAC under ``tf.distribute.MirroredStrategy`` on 1, 2 and 4 logical CPU
devices: step time against the single-device step, and the bytes the
strategy reduces per step with lazy against eager syncing of the factor
statistics.

The model: a float32 tanh MLP ``64-256-256-10`` with a softmax loss, batch
256 (split evenly over the replicas), ``kg.KFAC`` with
``momentum_type="regular"``, covariance update every step, inverses every
``--inverse_update_period`` steps, damping adapted every 5 steps. The logical
devices share this machine's cores, so the times show the cost of the
distributed step's phases and reductions, not a speed-up.

Candidates run side by side in one process, interleaved: each round runs a
block of ``inverse_update_period`` steps of every candidate (one inverse
refresh each), and times are medians over ``--reps`` rounds. Bytes are
counted, not estimated: ``ReductionCounter`` adds the payload (one
replica's copy) of every reduction the strategy runs, explicit or the
implicit one of reading a replica-local variable, and the table gives the
total over the timed steps divided by their number (amortised over the
inverse period).

Columns: ``step ms``: median block time / steps; ``/ 1 device``: over the
single-device step (no strategy); ``bytes/step``: reduced payload per
step; ``/ lazy``: eager's bytes over lazy's for the same devices.

    python benchmarks/distributed.py [--reps 5] [--devices 1,2,4]
        [--inverse_update_period 10] [--markdown out.md]
"""

import time

import bench_env  # noqa: E402,F401  (first: quiet logs, the repository importable)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

tf.get_logger().setLevel("ERROR")

FLAGS = flags.FLAGS
flags.DEFINE_integer("reps", 5, "interleaved rounds (medians)")
flags.DEFINE_list("devices", ["1", "2", "4"], "logical device counts")
flags.DEFINE_integer("inverse_update_period", 10, "K-FAC's inverse period (the block length)")
flags.DEFINE_integer("batch_size", 256, "global batch size")
flags.DEFINE_string("markdown", None, "also write the table as markdown here")

SIZES = (64, 256, 256, 10)


def make_problem(seed=0):
    """``(variables, registered loss)`` of the MLP, initialised from ``seed``."""
    import kfac_graph as kg

    rng = np.random.default_rng(seed)
    variables = []
    for d_in, d_out in zip(SIZES[:-1], SIZES[1:]):
        w = rng.normal(size=(d_in, d_out)) / np.sqrt(d_in)
        variables += [tf.Variable(w.astype("float32")), tf.Variable(np.zeros(d_out, "float32"))]

    def loss_fn(x, y):
        h = x
        for i in range(0, len(variables), 2):
            h = tf.matmul(h, variables[i]) + variables[i + 1]
            if i + 2 < len(variables):
                h = tf.tanh(h)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h))

    return variables, kg.auto_register(loss_fn)


def make_batches(n, batch, seed=1):
    rng = np.random.default_rng(seed)
    return [
        (
            tf.constant(rng.normal(size=(batch, SIZES[0])).astype("float32")),
            tf.constant(rng.integers(0, SIZES[-1], batch).astype("int32")),
        )
        for _ in range(n)
    ]


def candidate(devices, sync):
    """``(name, n_devices, sync, step, counter)``; ``devices`` None: no strategy."""
    import kfac_graph as kg
    from kfac_graph.optimizer.reduction_counter import ReductionCounter

    options = dict(
        momentum_type="regular",
        inverse_update_period=FLAGS.inverse_update_period,
        estimation_mode="empirical",
        damping=1e-2,
    )
    if devices is None:
        _, loss = make_problem()
        opt = kg.KFAC(loss, **options)
        return ("1 device, no strategy", 1, "-", opt.step, None)
    # every strategy its own collective group keys (as TF's own tests do)
    tf.distribute.MirroredStrategy._collective_key_base += 100_000
    strategy = tf.distribute.MirroredStrategy(devices)
    counter = ReductionCounter(strategy)
    with strategy.scope():
        _, loss = make_problem()
        opt = kg.KFAC(loss, sync_statistics=sync, **options)
    name = f"Mirrored, {len(devices)} device{'s' if len(devices) > 1 else ''}, {sync}"
    return (name, len(devices), sync, opt.step, counter)


def run(_):
    counts = [int(d) for d in FLAGS.devices]
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * max(counts)
    )
    names = [d.name for d in tf.config.list_logical_devices("CPU")]
    candidates = [candidate(None, None)]
    for n in counts:
        for sync in ("lazy", "eager"):
            candidates.append(candidate(names[:n], sync))
    period = FLAGS.inverse_update_period
    batches = make_batches(period, FLAGS.batch_size)

    def block(step):
        start = time.perf_counter()
        for x, y in batches:
            loss = step(x, y)
        float(loss)
        return time.perf_counter() - start

    for c in candidates:  # trace and warm up: one whole block
        block(c[3])
    times = {c[0]: [] for c in candidates}
    start_bytes = {c[0]: int(c[4].bytes.numpy()) for c in candidates if c[4] is not None}
    for _ in range(FLAGS.reps):
        for c in candidates:
            times[c[0]].append(block(c[3]))
    steps = FLAGS.reps * period
    base = np.median(times[candidates[0][0]])
    rows, lazy_bytes = [], {}
    for name, n, sync, _, counter in candidates:
        t = np.median(times[name])
        per_step = (
            None if counter is None else (int(counter.bytes.numpy()) - start_bytes[name]) / steps
        )
        if sync == "lazy":
            lazy_bytes[n] = per_step
        ratio_bytes = (
            f"{per_step / lazy_bytes[n]:.2f}" if sync == "eager" and lazy_bytes.get(n) else "-"
        )
        rows.append(
            (
                name,
                f"{1e3 * t / period:.1f}",
                f"{t / base:.2f}",
                "-" if per_step is None else f"{per_step:,.0f}",
                ratio_bytes,
            )
        )
    header = ("candidate", "step ms", "/ 1 device", "bytes/step", "/ lazy")
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    table = "\n".join(lines)
    print(
        f"MLP {'-'.join(map(str, SIZES))}, batch {FLAGS.batch_size}, inverse period {period}, "
        f"{FLAGS.reps} rounds"
    )
    print(table)
    if FLAGS.markdown:
        with open(FLAGS.markdown, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    app.run(run)
