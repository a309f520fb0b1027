"""Layer names: a matched layer is named by the scope its ops share, read
without the scopes that say how the graph was built rather than what the
layer is (inlined function calls, unrolled loop iterations); names that
collide get a suffix ``_1``, ``_2``, ... in layer order."""
from __future__ import annotations

import collections
import dataclasses
import os
import re

from passes.unroll import ITERATION_SCOPE


def scope_name(nodes) -> str:
    """The scope ``nodes`` share (one node: its own scope)."""
    if not nodes:
        return "layer"
    if len(nodes) == 1:
        scope = nodes[0].rsplit("/", 1)[0] if "/" in nodes[0] else nodes[0]
        return scope
    prefix = os.path.commonprefix([n.split("/") for n in nodes])
    return "/".join(prefix) or nodes[0]


_CALL_SCOPE = re.compile(r"^((Stateful)?PartitionedCall(_\d+)?/)+")
_TRAILING_CALL = re.compile(r"(/(Stateful)?PartitionedCall(_\d+)?)+$")


def readable(name: str) -> str:
    """``name`` without the scopes of inlined function calls it starts with
    (a restored SavedModel function wraps its body in one) or ends with (a
    layer whose op alone sits in an inlined call: Keras compiles a grouped
    convolution in its own function), and without the iteration scopes of
    unrolled loops (``passes.unroll``)."""
    return ITERATION_SCOPE.sub("", _TRAILING_CALL.sub("", _CALL_SCOPE.sub("", name)) or name)


def unique_names(layers) -> list:
    """``layers`` renamed readable and unique (module docstring)."""
    seen = collections.Counter()
    out = []
    for layer in layers:
        name = readable(layer.name)
        seen[name] += 1
        if seen[name] > 1:
            name = f"{name}_{seen[name] - 1}"
        out.append(dataclasses.replace(layer, name=name))
    return out
