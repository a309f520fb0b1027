"""What a ``kg.KFAC`` step reports: its warnings (``report``) and its
``tf.summary`` records (``write``): loss, damping, learning rate,
momentum, rho, skipped steps (and for the quadratic model the steps its cap
shortened, ``cap_watch.py``) and each factor's trace, every
``summary_period`` steps."""
from __future__ import annotations

import tensorflow as tf

from kfac_graph.fisher.report import factors_of


def report(opt, loss, applied, t):
    """What step ``t`` reports once the core has run: a warning where it was
    skipped (``applied`` false), the cap watch's (``cap_watch.py``) for the
    quadratic model, and the summaries where ``opt`` has a writer."""
    def warn():
        tf.print("kfac_graph.KFAC: non-finite loss or statistics at step", t,
                 "; update skipped (", opt.skipped_steps, "skipped so far)",
                 output_stream=tf.compat.v1.logging.warning)
        return tf.constant(True)

    tf.cond(applied, lambda: tf.constant(True), warn)
    if opt.momentum_type == "qmodel":
        opt.cap_watch.check(opt.iterations)
    if opt.summary_writer is not None:
        write(opt, loss, t)


def write(opt, loss, t):
    """Records step ``t``'s summaries of the optimizer ``opt``."""
    record = tf.equal(t % opt.summary_period, 0)
    with opt.summary_writer.as_default(step=t), tf.summary.record_if(record):
        tf.summary.scalar("kfac/loss", loss)
        tf.summary.scalar("kfac/damping", opt.damping)
        tf.summary.scalar("kfac/learning_rate", opt.learning_rate)
        tf.summary.scalar("kfac/momentum", opt.momentum)
        if opt.adapt_damping:
            tf.summary.scalar("kfac/rho", opt.rho)
        tf.summary.scalar("kfac/skipped_steps", opt.skipped_steps)
        if opt.momentum_type == "qmodel":
            tf.summary.scalar("kfac/capped_steps", opt.cap_watch.capped_steps)
        for layer, block in zip(opt.registration.layers, opt.estimator.blocks):
            for label, factor in factors_of(block):
                trace = factor.trace()
                tf.summary.scalar(f"factors/{layer.name}/{label}_trace",
                                  tf.reduce_sum(trace))

