"""``KFACKerasOptimizer``: the Keras optimizer face of a ``kg.KFAC`` (what
``KFACModel.fit``'s callbacks and Keras saving see; ``keras_fit.py``).

It never applies gradients: it carries Keras's ``iterations`` and the
``learning_rate`` callbacks read and set, and the ``kg.KFAC`` instance
(``kfac``). ``save_own_variables`` writes Keras's ``iterations`` and
``learning_rate``, then every variable of the K-FAC module but the model's
own weights, in ``tf.Module.variables`` order, as ``kfac_<i>``;
``load_own_variables`` reads them back, holding them until the K-FAC state
is built if it is not yet (``restore_pending``).
"""
from __future__ import annotations

import warnings

import keras
import numpy as np
import tensorflow as tf

from kfac_graph import options

_KFAC_PREFIX = "kfac_"


@keras.saving.register_keras_serializable(package="kfac_graph")
class KFACKerasOptimizer(keras.optimizers.Optimizer):
    """The Keras face of a ``kg.KFAC``: what callbacks and saving see.

    It never applies gradients (``KFACModel.train_step`` runs K-FAC's own
    step). ``save_own_variables`` writes Keras's ``iterations`` and
    ``learning_rate``, then the K-FAC module's variables as ``kfac_<i>``."""

    def __init__(self, learning_rate=0.1, name="kfac", **kwargs):
        # a number > 0 (a schedule, tensor or variable as Keras takes it)
        options.check("kg.KFACKerasOptimizer", "learning_rate", learning_rate,
                      options.Real(0.0, low_open=True, dynamic=True))
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.kfac = None
        self._pending_kfac_state = None
        # The model's weights, which K-FAC's state leaves out; held by a plain
        # holder so that Keras does not track them as optimizer variables.
        self._model_weights = _Holder(())

    def update_step(self, gradient, variable, learning_rate):
        raise RuntimeError("KFACKerasOptimizer does not apply gradients; train with "
                           "KFACModel.fit (kg.KFAC.step updates the weights)")

    # -- state ------------------------------------------------------------------------
    def kfac_variables(self, exclude=()) -> list:
        """The K-FAC module's variables in a stable order (``tf.Module.variables``),
        without any in ``exclude`` (the model's own weights)."""
        if self.kfac is None:
            return []
        skip = {_ref(v) for v in exclude}
        return [v for v in self.kfac.variables if _ref(v) not in skip]

    def set_model_weights(self, weights):
        """The model's weights, left out of the saved K-FAC state."""
        self._model_weights = _Holder(tuple(weights))

    def _model_variables(self):
        return self._model_weights.value

    def save_own_variables(self, store):
        super().save_own_variables(store)
        if self.kfac is not None and self.kfac.built:
            state = self.kfac_variables(self._model_variables())
        elif self._pending_kfac_state is not None:  # loaded, not built yet: keep it
            for i, value in enumerate(self._pending_kfac_state):
                store[f"{_KFAC_PREFIX}{i}"] = value
            return
        else:
            state = []
        for i, v in enumerate(state):
            store[f"{_KFAC_PREFIX}{i}"] = np.asarray(v.numpy())

    def load_own_variables(self, store):
        keys = list(store.keys())
        own = sorted((k for k in keys if not k.startswith(_KFAC_PREFIX)), key=int)
        if len(own) == len(self.variables):
            for i, v in enumerate(self.variables):
                v.assign(store[str(i)])
        else:
            warnings.warn(f"{self.name}: {len(own)} saved Keras optimizer variables, "
                          f"{len(self.variables)} here; not restored", stacklevel=2)
        kfac_keys = sorted((k for k in keys if k.startswith(_KFAC_PREFIX)),
                           key=lambda k: int(k[len(_KFAC_PREFIX):]))
        values = [np.asarray(store[k]) for k in kfac_keys]
        if not values:
            return
        if self.kfac is not None and self.kfac.built:
            self._assign_kfac_state(values)
        else:
            self._pending_kfac_state = values

    def restore_pending(self):
        """Assigns K-FAC state loaded before K-FAC was built (called after build)."""
        if self._pending_kfac_state is not None:
            values, self._pending_kfac_state = self._pending_kfac_state, None
            with tf.init_scope():
                self._assign_kfac_state(values)

    def _assign_kfac_state(self, values):
        state = self.kfac_variables(self._model_variables())
        shapes_match = len(state) == len(values) and all(
            tuple(v.shape) == tuple(np.shape(x)) for v, x in zip(state, values))
        if not shapes_match:
            warnings.warn(f"{self.name}: the saved K-FAC state ({len(values)} variables) does "
                          f"not match this optimizer's ({len(state)}); K-FAC state not restored",
                          stacklevel=3)
            return
        for v, x in zip(state, values):
            v.assign(x)


class _Holder:
    """A plain box (Keras tracks neither it nor what it holds)."""

    def __init__(self, value):
        self.value = value


def _ref(v):
    try:
        return v.ref()
    except AttributeError:
        return id(v)
