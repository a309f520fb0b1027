"""One K-FAC run from the command line, shared by the benchmarks that race
K-FAC settings (``convergence.py``, ``recurrent_lm.py``,
``transformer_lm.py``).

A spec is space-separated ``key=value`` pairs: ``label=NAME`` names the row;
a key that is a ``kg.KFAC`` option sets it (``momentum_type=regular
cov_update_period=5``); any other key is a layer kind or layer name given an
approximation (``dense=kron_reduce``), passed as ``approximations``.
``cosine_lr=R`` makes the learning rate a schedule as AdamW's in the
benchmarks: linear warm-up from 0 to ``R`` over ``warmup`` steps, then cosine
decay to 0 at ``steps`` (``cosine_warmup=N`` and ``cosine_steps=N`` override
the two). With the quadratic model (``momentum_type=qmodel``) it scales the
model's step: ``cosine_lr=1 cosine_warmup=0`` anneals it. Values are read as
Python literals where they are one (``5``, ``1e-3``, ``False``) and kept as
strings otherwise. ``""`` is the defaults.
"""
import ast

import keras

import kfac_graph as kg


def parse(spec: str, default_label: str = "defaults", steps: int | None = None,
          warmup: int = 0):
    """``spec`` -> ``(label, options for kg.KFAC)``; ``steps`` and ``warmup``:
    the run's length and warm-up, for ``cosine_lr``."""
    label, options, approximations = default_label, {}, {}
    items = spec.split()
    for item in items:  # the decay's warm-up and horizon first: cosine_lr reads them
        key, _, value = item.partition("=")
        if key == "cosine_steps":
            steps = int(value)
        elif key == "cosine_warmup":
            warmup = int(value)
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"K-FAC spec {spec!r}: {item!r} is not key=value")
        if key == "label":
            label = value
            continue
        if key in ("cosine_steps", "cosine_warmup"):  # read above
            continue
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass
        if key == "cosine_lr":
            if steps is None:
                raise ValueError(f"K-FAC spec {spec!r}: cosine_lr needs the run's steps")
            options["learning_rate"] = keras.optimizers.schedules.CosineDecay(
                0.0, max(steps - warmup, 1), warmup_target=float(value), warmup_steps=warmup)
        elif key in kg.KFAC.OPTIONS:
            options[key] = value
        else:
            approximations[key] = value
    if approximations:
        options["approximations"] = approximations
    return label, options
