"""Emit a SavedModel that trains itself with K-FAC and runs on stock TensorFlow.

``rewrite_saved_model(input, function, output)`` loads the SavedModel at
``input``, registers its saved ``tf.function`` ``function`` (a scalar loss
with an input signature, which fixes the shapes), builds ``kg.KFAC`` on it,
and writes a SavedModel at ``output`` whose root exposes

- ``kfac_step(*inputs) -> loss``: one K-FAC step (the loss before the
  update); it updates the model's variables and the K-FAC state (factors,
  inverses, velocities, damping, counters), all saved with the model;
- ``per_example_gradients(*inputs)``: a list aligned with the
  registration's variables, entry ``k`` shaped ``[batch, *var.shape]``;
- ``update_inverses()``: refreshes the cached inverses from the current
  factors (``kfac_step`` does it every ``inverse_update_period`` steps);
- ``kfac``: the optimizer's state (``kfac.iterations``, ``kfac.damping``, ...);
- the original loss function under its own name, and every other function,
  variable, object and signature of the input.

Everything is traced into graphs here: loading the output needs TensorFlow
alone. The preconditioning is an inner function with ``jit_compile=True``
(it carries XLA's must-compile attribute). The registration is written as
JSON to ``assets.extra/kfac_registration.json``.

The output is written to a temporary directory beside ``output`` and
renamed into place only once complete, so a failure leaves nothing behind.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import tensorflow as tf

from kfac_graph.auto_register import RegisteredFunction
from kfac_graph.optimizer.kfac import KFAC
from kfac_graph.per_example.gradients import per_example_gradients
from kfac_graph.registration import Registration
from passes.errors import KfacGraphError, LoadError
from passes.frontends import error_line, read_saved_model

EXPORTED = ("kfac_step", "per_example_gradients", "update_inverses", "kfac")
REPORT_PATH = os.path.join("assets.extra", "kfac_registration.json")


class ExportError(KfacGraphError):
    """The rewritten SavedModel could not be built or written."""


def load_loss_function(path: str, function: str):
    """``(loaded root, restored function, input signature)``; one-line
    ``LoadError``s for a missing directory, a directory that is not a
    SavedModel, an unknown function, or one saved without an input signature."""
    loaded = read_saved_model(path)
    fn = getattr(loaded, function, None) if not function.startswith("_") else None
    if fn is None or not hasattr(fn, "concrete_functions"):
        found = sorted(name for name, child in _children(loaded).items()
                       if hasattr(child, "concrete_functions"))
        raise LoadError(f"the SavedModel at {path} has no tf.function {function!r}; "
                        f"it has: {', '.join(found) or 'none'}")
    signature = getattr(fn, "input_signature", None)
    if signature is None:
        raise LoadError(f"the function {function!r} in {path} was saved without an input "
                        "signature; save it as tf.function(..., input_signature=[...])")
    specs = [tf.TensorSpec(s.shape, s.dtype) for s in tf.nest.flatten(signature)]
    return loaded, fn, specs


def registered_loss(fn, function: str, loss: str | None = None) -> RegisteredFunction:
    """The restored loss ``fn`` as a ``kg.auto_register``ed function named ``function``."""
    registered = RegisteredFunction(fn, loss=loss)
    registered.__name__ = function
    return registered


def training_module(loaded, function: str, fn, specs, *, loss: str | None = None,
                    **kfac_options) -> tuple[tf.Module, Registration, dict]:
    """``(module, registration, signatures)``: the output root (see the module
    docstring) for the restored loss ``fn`` with input signature ``specs``."""
    children = _children(loaded)
    clashes = sorted(set(children) & set(EXPORTED))
    if clashes:
        raise ExportError(f"the input already has {', '.join(clashes)}; rename it before "
                          "rewriting")
    registered = registered_loss(fn, function, loss)
    try:
        optimizer = KFAC(registered, **kfac_options)
    except TypeError as e:
        raise ExportError(f"bad K-FAC option: {error_line(e)}") from e
    optimizer.build(*specs)
    registration = optimizer.registration

    module = tf.Module(name="kfac_training")
    for name, child in children.items():
        setattr(module, name, child)
    module.kfac = optimizer
    module.kfac_step = tf.function(lambda *args: optimizer.step(*args), input_signature=specs,
                                   autograph=False)
    module.per_example_gradients = tf.function(
        lambda *args: per_example_gradients(registered, *args), input_signature=specs,
        autograph=False)
    def update_inverses():
        optimizer.refresh_inverses()
        return optimizer.iterations.read_value()

    module.update_inverses = tf.function(update_inverses, input_signature=[], autograph=False)
    signatures = dict(getattr(loaded, "signatures", {}) or {})
    return module, registration, signatures


def write_saved_model(module: tf.Module, output: str, signatures=None,
                      extra_files: dict[str, str] | None = None) -> None:
    """Saves ``module`` at ``output`` (which must not exist) atomically: into a
    temporary directory beside it, renamed into place when complete."""
    output = check_output(output)
    parent = os.path.dirname(output)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.", dir=parent)
    try:
        target = os.path.join(staging, "saved_model")
        tf.saved_model.save(module, target, signatures=signatures or None)
        for relative, text in (extra_files or {}).items():
            path = os.path.join(target, relative)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        os.rename(target, output)
    except OSError as e:
        raise ExportError(f"cannot write {output}: {e.strerror or e}") from e
    except KfacGraphError:
        raise
    except Exception as e:  # noqa: BLE001 - TF raises many types while saving
        raise ExportError(f"could not save the rewritten model: {error_line(e)}") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def rewrite_saved_model(input_path: str, function: str, output: str, *,
                        loss: str | None = None, **kfac_options) -> Registration:
    """Writes the K-FAC training SavedModel for ``input_path``'s ``function``
    at ``output``; returns the registration. ``kfac_options`` go to
    ``kg.KFAC``; ``loss`` names the loss kind if the pass cannot read it."""
    check_output(output)
    loaded, fn, specs = load_loss_function(input_path, function)
    module, registration, signatures = training_module(loaded, function, fn, specs, loss=loss,
                                                       **kfac_options)
    report = json.dumps(registration.as_dict(), indent=2) + "\n"
    write_saved_model(module, output, signatures, {REPORT_PATH: report})
    return registration


def check_output(output: str) -> str:
    """``output`` made absolute; a one-line ``ExportError`` if it exists or
    cannot be created (checked before any work, and again when writing)."""
    output = os.path.abspath(output)
    if os.path.lexists(output):
        raise ExportError(f"the output {output} already exists; choose a new directory")
    parent = os.path.dirname(output)
    if not os.path.isdir(parent):
        raise ExportError(f"cannot write {output}: its parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"cannot write {output}: no write permission in {parent}")
    return output


def _children(loaded) -> dict:
    """The loaded root's public children (functions, variables, objects)."""
    children = tf.train.TrackableView(loaded).children(loaded)
    return {name: child for name, child in children.items()
            if not name.startswith("_") and name != "signatures"}
