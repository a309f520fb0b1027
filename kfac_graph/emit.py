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
(it carries XLA's must-compile attribute; ``jit_compile="auto"``, the
default, exports as ``False`` on the CPU: the preconditioning compiled).
The registration is written as JSON to
``assets.extra/kfac_registration.json``, with the ops that touch the host
(``passes/host_ops.py``: file reads and writes, Python callbacks, ...) in
the loss function and elsewhere, under ``"host_ops"``.

A SavedModel is a program: a loss function that holds ops that touch the
host is refused (``HostOpsError``, found from the SavedModel's protocol
buffers before it is loaded) unless ``allow_host_ops=True``.

Every output path is checked before any work (``check_output``,
``check_side_file``). The model is written to a temporary directory beside
``output``, the report and picture to temporary files beside theirs, and all
are renamed into place only once all are complete, so a failure (a full
disk) leaves nothing behind.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile

import tensorflow as tf

from kfac_graph.auto_register import RegisteredFunction
from kfac_graph.optimizer.kfac import KFAC
from kfac_graph.per_example.gradients import per_example_gradients
from kfac_graph.registration import Registration
from passes import host_ops
from passes.errors import KfacGraphError, LoadError
from passes.frontends import error_line, read_saved_model

EXPORTED = ("kfac_step", "per_example_gradients", "update_inverses", "kfac")
REPORT_PATH = os.path.join("assets.extra", "kfac_registration.json")


class ExportError(KfacGraphError):
    """The rewritten SavedModel could not be built or written."""


class HostOpsError(ExportError):
    """The loss function holds ops that touch the host (``passes/host_ops.py``);
    ``ops``: the ``host_ops.HostOp``s, ``names``: their types, each once."""

    def __init__(self, function: str, ops):
        self.function, self.ops, self.names = function, tuple(ops), host_ops.names(ops)
        super().__init__(f"the loss function {function!r} holds ops that touch the host: "
                         f"{self.names}; pass allow_host_ops=True to rewrite it anyway")


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
    # the output may run anywhere: "auto" would bake this machine's choice in
    if kfac_options.get("jit_compile", "auto") == "auto":
        kfac_options["jit_compile"] = bool(tf.config.list_physical_devices("GPU")
                                           or tf.config.list_physical_devices("TPU"))
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
                      extra_files: dict[str, str] | None = None,
                      side_files: dict[str, str] | None = None) -> None:
    """Saves ``module`` at ``output`` (which must not exist), with
    ``extra_files`` (``{path inside the model: text}``) and ``side_files``
    (``{path: text}`` written beside it, e.g. the report), all or nothing:
    each is written to a temporary path beside its own and renamed into
    place once every one is complete; on any failure none is left."""
    output = check_output(output)
    side = {os.path.abspath(p): text for p, text in (side_files or {}).items()}
    for path in side:
        check_side_file(path, output, side)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.",
                               dir=os.path.dirname(output))
    staged, placed, current = {}, [], output
    try:
        target = os.path.join(staging, "saved_model")
        _save(module, target, signatures)
        for relative, text in (extra_files or {}).items():
            os.makedirs(os.path.dirname(os.path.join(target, relative)), exist_ok=True)
            write_text(os.path.join(target, relative), text)
        for current, text in side.items():
            fd, staged[current] = tempfile.mkstemp(prefix=f".{os.path.basename(current)}.",
                                                   suffix=".partial",
                                                   dir=os.path.dirname(current))
            os.close(fd)
            write_text(staged[current], text)
        for current, temporary in staged.items():
            os.replace(temporary, current)
            placed.append(current)
        current = output
        os.rename(target, output)
    except BaseException as e:
        for path in placed:
            with contextlib.suppress(OSError):
                os.remove(path)
        if isinstance(e, OSError):
            raise ExportError(f"cannot write {current}: {e.strerror or e}") from e
        if isinstance(e, KfacGraphError) or not isinstance(e, Exception):
            raise
        raise ExportError(f"could not save the rewritten model: {error_line(e)}") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        for temporary in staged.values():
            if os.path.lexists(temporary):
                os.remove(temporary)


def _save(module, target, signatures) -> None:
    """``tf.saved_model.save`` with the input's custom gradients (Keras's swish
    and silu): saved without them, the rewritten model's own ``loss`` (the
    input's function) could not be differentiated when loaded ("No gradient
    defined for operation IdentityN"), and in a process that had loaded
    another such model it took that model's gradient functions, numbered
    alike. The step's functions hold their own gradients; the re-run graph's
    gradient overrides (a grouped Conv2D's) are no ``tf.custom_gradient``
    functions and cannot be saved as such: with one, the model is saved
    without custom gradients, as before (TensorFlow's traceback of that
    first try, printed before it raises, is not shown)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            tf.saved_model.save(module, target, signatures=signatures or None,
                                options=tf.saved_model.SaveOptions(
                                    experimental_custom_gradients=True))
    except ValueError:  # ("Error when tracing gradients for SavedModel")
        shutil.rmtree(target, ignore_errors=True)
        tf.saved_model.save(module, target, signatures=signatures or None,
                            options=tf.saved_model.SaveOptions(
                                experimental_custom_gradients=False))


def write_text(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` (every file ``write_saved_model`` writes itself)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def rewrite_saved_model(input_path: str, function: str, output: str, *,
                        loss: str | None = None, allow_host_ops: bool = False,
                        report: str | None = None, dot: str | None = None,
                        **kfac_options) -> Registration:
    """Writes the K-FAC training SavedModel for ``input_path``'s ``function``
    at ``output``, and the report (``report_json``) at ``report`` and the
    Graphviz picture at ``dot`` if given (all or nothing); returns the
    registration. ``kfac_options`` go to ``kg.KFAC``; ``loss`` names the
    loss kind if the pass cannot read it; a loss function with ops that
    touch the host raises ``HostOpsError`` unless ``allow_host_ops``. Every
    output path is checked first, then the host ops, then the model loaded."""
    output = check_output(output)
    sides = [path for path in (report, dot) if path]
    for path in sides:
        check_side_file(path, output, sides)
    scan = host_op_scan(input_path, function)
    if scan.loss and not allow_host_ops:
        raise HostOpsError(function, scan.loss)
    loaded, fn, specs = load_loss_function(input_path, function)
    module, registration, signatures = training_module(loaded, function, fn, specs, loss=loss,
                                                       **kfac_options)
    text = report_json(registration, scan)
    side_files = {**({report: text} if report else {}),
                  **({dot: registration.to_dot()} if dot else {})}
    write_saved_model(module, output, signatures, {REPORT_PATH: text}, side_files)
    return registration


def host_op_scan(path: str, function: str) -> host_ops.HostOpScan:
    """The ops that touch the host in the SavedModel directory (or GraphDef
    file) at ``path``, for the loss ``function`` (a GraphDef: the loss tensor);
    read from the protocol buffers, nothing loaded. Empty when unreadable."""
    if os.path.isfile(path):
        return host_ops.scan_graph_def(path, function)
    return host_ops.scan_saved_model(path, function) or host_ops.HostOpScan()


def report_json(registration: Registration, scan: host_ops.HostOpScan) -> str:
    """The report: the registration (``Registration.as_dict``) and ``"host_ops"``."""
    return json.dumps({**registration.as_dict(), "host_ops": scan.as_dict()}, indent=2) + "\n"


def check_output(output: str) -> str:
    """``output`` made absolute; a one-line ``ExportError`` if it exists or
    cannot be created (checked before any work, and again when writing)."""
    output = os.path.abspath(output)
    if os.path.lexists(output):
        raise ExportError(f"the output {output} already exists; choose a new directory")
    _check_parent(output)
    return output


def check_side_file(path: str, output: str | None = None, others=()) -> str:
    """``path`` (a file written beside the output: report, picture) made
    absolute; a one-line ``ExportError`` if it is a directory, the output,
    given twice in ``others``, or its folder is missing or not writable."""
    path = os.path.abspath(path)
    if output is not None and path == os.path.abspath(output):
        raise ExportError(f"cannot write {path}: it is also the output directory")
    if sum(os.path.abspath(p) == path for p in others) > 1:
        raise ExportError(f"cannot write {path} twice; give each output its own path")
    if os.path.isdir(path):
        raise ExportError(f"cannot write {path}: it is a directory")
    _check_parent(path)
    return path


def _check_parent(path: str) -> None:
    parent = os.path.dirname(path)
    if os.path.lexists(parent) and not os.path.isdir(parent):
        raise ExportError(f"cannot write {path}: {parent} is not a directory")
    if not os.path.isdir(parent):
        raise ExportError(f"cannot write {path}: its parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"cannot write {path}: no write permission in {parent}")


def _children(loaded) -> dict:
    """The loaded root's public children (functions, variables, objects)."""
    children = tf.train.TrackableView(loaded).children(loaded)
    return {name: child for name, child in children.items()
            if not name.startswith("_") and name != "signatures"}
