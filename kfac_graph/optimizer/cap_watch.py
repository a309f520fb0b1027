"""Watching the quadratic model's cap (``qmodel.cap``) for a model it
cannot steer.

Where the undamped quadratic model of the batch promises a fall below zero
(more than the whole objective ``h``), the update is shortened to where it
promises ``h``. Once in a while that is a model running off a flat
direction. On every step it is a regime: the batch's exact-Fisher model can
fit the batch's own examples in one step, so each step fits its own batch
and the next batch gains nothing from it. ``keras.applications.ResNet50``
on the digits at batch 32 is capped on every step: the gradients of two
batches agree to ``g_1.P g_2 / g.P g`` about 0.003 there (README, "Cold
start and scale"), the model picks a momentum of 0, and the loss on the
whole set stays where it started, while regular momentum trains it.

The same regime need not reach the cap. At batch 8 on
``keras.applications`` MobileNetV3Small, EfficientNetB0, ResNet50,
DenseNet121 and ConvNeXtTiny the model's promises stay below the loss,
each step still fits its own batch (``rho`` 0.7 to 1.1 on it), and the loss
over the whole set ends above where it started (MobileNetV3Small: 1.609,
then 1.820 after 30 steps) or stays there, while regular momentum trains
them all. So the watch also reads the loss: where a window's mean loss is
still at least ``STALLED`` of the first window's, the steps have made no
progress since the start (``stalled``). A run that made some (the digits
models, keras-hub's transformers, an LSTM, a U-Net: 60 steps at batch 8
each, handed over nowhere) is not touched.

``CapWatch`` counts the applied steps the cap shortened (``capped_steps``)
and sums their losses; at the end of every window of ``WINDOW`` applied
steps it logs one warning the first time at least ``SHARE`` of that
window's steps were capped or the window stalled (``warned``), naming the
option that trains such models; with ``qmodel_fallback`` the optimizer then
hands its step over to that option (``qmodel_fallback.py``).
"""
from __future__ import annotations

import tensorflow as tf

WINDOW = 20
SHARE = 0.75
STALLED = 0.95


class CapWatch(tf.Module):
    """``capped_steps``: applied steps the cap shortened (a checkpointed
    counter); ``count`` adds a step's verdict, ``check`` warns (module
    docstring)."""

    def __init__(self, window: int = WINDOW, share: float = SHARE, remedy: str = "",
                 stalled: float = STALLED):
        super().__init__(name="cap_watch")
        self.window, self.share, self.remedy = int(window), float(share), remedy
        self.stalled_share = float(stalled)
        self.calls = 0  # poll()'s count of calls (Python; not checkpointed)
        with tf.init_scope():
            counter = lambda name: tf.Variable(tf.zeros([], tf.int64), trainable=False,
                                               name=name)
            self.capped_steps = counter("capped_steps")
            self.capped_before_window = counter("capped_before_window")
            self.warned = tf.Variable(False, trainable=False, name="warned")
            self.stalled = tf.Variable(False, trainable=False, name="stalled")
            self.window_loss = tf.Variable(tf.zeros([], tf.float32), trainable=False,
                                           name="window_loss")
            self.first_window_loss = tf.Variable(tf.constant(float("nan"), tf.float32),
                                                 trainable=False, name="first_window_loss")

    def count(self, capped, loss):
        """Adds one to ``capped_steps`` where ``capped`` (a scalar bool), and
        the step's ``loss`` to its window's."""
        self.capped_steps.assign_add(tf.cast(capped, tf.int64))
        self.window_loss.assign_add(tf.cast(loss, tf.float32))

    def check(self, applied_steps):
        """At the end of a window (``applied_steps`` a positive multiple of
        the window), warns once if the window's capped share reached
        ``share``; then starts the next window."""
        steps = tf.cast(applied_steps, tf.int64)
        at_end = (steps > 0) & tf.equal(steps % self.window, 0)

        def end_window():
            recent = self.capped_steps - self.capped_before_window
            capped = tf.cast(recent, tf.float64) >= self.share * self.window
            mean = self.window_loss / self.window
            first = self.first_window_loss
            stalled = ~tf.math.is_nan(first) & (mean >= self.stalled_share * first)

            def warn():
                tf.print("kfac_graph.KFAC: the quadratic model promised to remove the whole "
                         "loss on", recent, "of the last", self.window, "steps, and their "
                         "mean loss is", mean, "against", first, "over the first", self.window,
                         ": it fits each batch on its own and the loss does not fall (a batch "
                         "small against the model); momentum_type='regular' with a "
                         "learning_rate trains such models" + self.remedy,
                         output_stream=tf.compat.v1.logging.warning)
                self.warned.assign(True)
                self.stalled.assign(stalled)
                return tf.constant(True)

            tf.cond((capped | stalled) & ~self.warned, warn, lambda: tf.constant(True))
            self.capped_before_window.assign(self.capped_steps)
            self.first_window_loss.assign(tf.where(tf.math.is_nan(first), mean, first))
            self.window_loss.assign(tf.zeros_like(self.window_loss))
            return tf.constant(True)

        tf.cond(at_end, end_window, lambda: tf.constant(True))

    def poll(self) -> bool:
        """Whether the watch has warned, read (one variable, one sync) on
        every ``window``-th call only; False on the others."""
        self.calls += 1
        return self.calls % self.window == 0 and bool(self.warned)
