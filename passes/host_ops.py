"""Ops that touch the host: what a graph reads, writes or runs outside TensorFlow.

A SavedModel is a program: its functions can read and write files, call
back into Python or dump tensors wherever they like. ``HOST_OPS`` is the one
list of such op types (with what each does); a scan reads the graph's
protocol buffers only (nothing is loaded or run) and reports where they are:

- ``loss``: in the loss function, counting every function it calls (a
  ``tf.function`` runs all its stateful ops, wired to the output or not);
  for a GraphDef, in the nodes the loss tensor depends on and their
  functions;
- ``elsewhere``: in the rest of the graph, less ``CHECKPOINT_OPS``: every
  SavedModel saves and restores its variables with those (its
  ``saver_def`` functions), so they count only inside the loss.

``PrintV2`` counts only when it prints to a file (``output_stream``
``file://...``): printing to stderr or the log touches nothing.
``kfac_graph.emit`` refuses to rewrite a loss that holds any of them unless
allowed (``kfac-rewrite --allow_host_ops``).
"""
from __future__ import annotations

import collections
import dataclasses
import os

from google.protobuf import message, text_format
from tensorflow.core.protobuf import saved_model_pb2

from passes import frontends

_FILES = "reads or writes files"
# every SavedModel's save and restore functions hold these
CHECKPOINT_OPS = frozenset(("SaveV2", "RestoreV2", "Save", "Restore", "SaveSlices",
                            "RestoreSlice", "MergeV2Checkpoints"))
HOST_OPS = {
    # files
    "ReadFile": "reads a file", "WriteFile": "writes a file", "MatchingFiles": "lists files",
    "ImmutableConst": "maps a file into memory",
    "InitializeTableFromTextFile": "reads a file", "InitializeTableFromTextFileV2": "reads a file",
    "GenerateVocabRemapping": "reads a file", "LoadAndRemapMatrix": "reads a checkpoint",
    **dict.fromkeys(("WholeFileReader", "WholeFileReaderV2", "TextLineReader",
                     "TextLineReaderV2", "TFRecordReader", "TFRecordReaderV2",
                     "FixedLengthRecordReader", "FixedLengthRecordReaderV2", "LMDBReader"),
                    "reads files"),
    **dict.fromkeys(("TFRecordDataset", "TFRecordDatasetV2", "TextLineDataset",
                     "FixedLengthRecordDataset", "FixedLengthRecordDatasetV2", "LMDBDataset",
                     "ExperimentalLMDBDataset", "LoadDataset", "SaveDataset", "SaveDatasetV2",
                     "DatasetToTFRecord", "ExperimentalDatasetToTFRecord", "SnapshotDataset",
                     "SnapshotDatasetV2", "CacheDataset", "CacheDatasetV2"), _FILES),
    # summaries
    **dict.fromkeys(("CreateSummaryFileWriter", "CreateSummaryDbWriter", "WriteSummary",
                     "WriteScalarSummary", "WriteHistogramSummary", "WriteImageSummary",
                     "WriteAudioSummary", "WriteGraphSummary", "WriteRawProtoSummary",
                     "ImportEvent", "FlushSummaryWriter", "CloseSummaryWriter"),
                    "writes summary files"),
    # Python callbacks
    "PyFunc": "calls Python", "PyFuncStateless": "calls Python", "EagerPyFunc": "calls Python",
    # tensor dumps and printing to files
    **dict.fromkeys(("DebugIdentity", "DebugIdentityV2", "DebugIdentityV3", "DebugNanCount",
                     "DebugNumericSummary", "DebugNumericSummaryV2"), "dumps tensors"),
    "PrintV2": "prints to a file",
    # remote services
    "Rpc": "calls a server", "TryRpc": "calls a server",
    "GcsConfigureCredentials": "configures cloud storage",
    "GcsConfigureBlockCache": "configures cloud storage", "BigQueryReader": "reads BigQuery",
    # checkpoints: counted in the loss function only
    **dict.fromkeys(sorted(CHECKPOINT_OPS), "reads or writes a checkpoint"),
}
# op type -> (attribute, prefix): counted only when the string attribute starts so
ONLY_WHEN = {"PrintV2": ("output_stream", "file://")}


@dataclasses.dataclass(frozen=True)
class HostOp:
    """One node: its op type, name, the library function holding it ("" for
    the top-level graph) and what it does."""

    op: str
    node: str
    function: str
    what: str

    def where(self) -> str:
        return f"{self.function}/{self.node}" if self.function else self.node


@dataclasses.dataclass(frozen=True)
class HostOpScan:
    """What a scan found: in the loss function, and elsewhere (see the module docstring)."""

    loss: tuple[HostOp, ...] = ()
    elsewhere: tuple[HostOp, ...] = ()

    def as_dict(self) -> dict:
        return {key: [dataclasses.asdict(op) for op in getattr(self, key)]
                for key in ("loss", "elsewhere")}

    def lines(self) -> list[str]:
        """Two lines for a report: the loss function's host ops, the others'."""
        return [f"ops that touch the host, {label}: "
                + ("; ".join(f"{op.op} ({op.what}) at {op.where()}" for op in ops) or "none")
                for label, ops in (("in the loss function", self.loss),
                                   ("elsewhere", self.elsewhere))]


def names(ops) -> str:
    """``"WriteFile (writes a file), PyFunc (calls Python)"``: each op type once."""
    kinds = collections.OrderedDict((op.op, op.what) for op in ops)
    return ", ".join(f"{kind} ({what})" for kind, what in kinds.items())


def scan_saved_model(path: str, function: str) -> HostOpScan | None:
    """The scan of the SavedModel at ``path`` for its saved ``tf.function``
    ``function``; None when there is no readable SavedModel or no such
    function (the loader words that error)."""
    proto = _read_saved_model(path)
    if proto is None or not proto.meta_graphs:
        return None
    meta = proto.meta_graphs[0]
    roots = _saved_function(meta.object_graph_def, function)
    if roots is None:
        return None
    library = {f.signature.name: f for f in meta.graph_def.library.function}
    reached = _closure(roots, library)
    loss = [op for name in sorted(reached) for op in _found(library[name].node_def, name)]
    others = [op for name in sorted(set(library) - reached)
              for op in _found(library[name].node_def, name)]
    others += _found(meta.graph_def.node, "")
    return HostOpScan(tuple(loss), tuple(op for op in others if op.op not in CHECKPOINT_OPS))


def scan_graph_def(path_or_graph_def, output: str) -> HostOpScan:
    """The scan of a GraphDef (a file or a proto) for the loss tensor ``output``."""
    graph_def = path_or_graph_def
    if isinstance(path_or_graph_def, (str, os.PathLike)):
        graph_def = frontends.read_graph_def(os.fspath(path_or_graph_def))
    nodes = {n.name: n for n in graph_def.node}
    library = {f.signature.name: f for f in graph_def.library.function}
    seen, stack = set(), [output.lstrip("^").split(":")[0]]
    while stack:
        name = stack.pop()
        if name in nodes and name not in seen:
            seen.add(name)
            stack.extend(t.lstrip("^").split(":")[0] for t in nodes[name].input)
    reached = _closure({f for name in seen for f in _callees(nodes[name], library)}, library)
    loss = _found([nodes[n] for n in sorted(seen)], "")
    loss += [op for name in sorted(reached) for op in _found(library[name].node_def, name)]
    others = _found([n for n in graph_def.node if n.name not in seen], "")
    others += [op for name in sorted(set(library) - reached)
               for op in _found(library[name].node_def, name)]
    return HostOpScan(tuple(loss), tuple(op for op in others if op.op not in CHECKPOINT_OPS))


def _read_saved_model(path: str):
    for name, binary in (("saved_model.pb", True), ("saved_model.pbtxt", False)):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        proto = saved_model_pb2.SavedModel()
        try:
            with open(file, "rb") as f:
                data = f.read()
            if binary:
                proto.ParseFromString(data)
            else:
                text_format.Parse(data.decode("utf-8"), proto)
        except (OSError, message.DecodeError, UnicodeDecodeError, text_format.ParseError):
            return None
        return proto
    return None


def _saved_function(object_graph, function: str) -> set[str] | None:
    """The concrete functions' names of the root's child ``function``."""
    if not object_graph.nodes:
        return None
    for child in object_graph.nodes[0].children:
        if child.local_name != function:
            continue
        node = object_graph.nodes[child.node_id]
        kind = node.WhichOneof("kind")
        if kind == "function":
            return set(node.function.concrete_functions)
        if kind == "bare_concrete_function":
            return {node.bare_concrete_function.concrete_function_name}
    return None


def _closure(roots, library) -> set[str]:
    """``roots`` and every library function they call, directly or not."""
    reached, stack = set(), [r for r in roots if r in library]
    while stack:
        name = stack.pop()
        if name in reached:
            continue
        reached.add(name)
        for node in library[name].node_def:
            stack.extend(_callees(node, library))
    return reached


def _callees(node, library) -> list[str]:
    """The library functions a node calls: its op, or a function attribute
    (``f`` of a call, the branches and bodies of control flow)."""
    out = [node.op] if node.op in library else []
    for value in node.attr.values():
        if value.HasField("func"):
            out.append(value.func.name)
        out.extend(f.name for f in value.list.func)
    return [name for name in out if name in library]


def _found(nodes, function: str) -> list[HostOp]:
    out = []
    for node in nodes:
        what = HOST_OPS.get(node.op)
        if what is None:
            continue
        if node.op in ONLY_WHEN:
            attr, prefix = ONLY_WHEN[node.op]
            value = node.attr[attr].s if attr in node.attr else b""
            if not value.decode("utf-8", "replace").startswith(prefix):
                continue
        out.append(HostOp(node.op, node.name, function, what))
    return out
