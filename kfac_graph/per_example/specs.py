"""Frozen descriptions of the layers a per-example gradient rule handles.

A spec carries what the rule cannot read off the tensors `(a, g)` it is given:
the op's attributes exactly as TensorFlow stores them, the shape of the weights
where the tensors do not determine it, and whether the layer has a bias (or a
shift). Specs are small immutable values: hashable, comparable, safe to share.

Conventions (shapes are those of the TF ops, `B` is the batch):

* `DenseSpec`: `a [B, ..., d_in]`, `g [B, ..., d_out]`, kernel `[d_in, d_out]`
  (or `[d_out, d_in]` when `transpose_kernel`), optional bias `[d_out]`.
* `ConvSpec`: `Conv2D` input/output in `data_format`, kernel `[kh, kw, Cin,
  Cout]`, optional bias `[Cout]`.
* `DepthwiseSpec`: `DepthwiseConv2dNative`, kernel `[kh, kw, C, M]`, output
  channels `C*M` (channel `c*M + m`), optional bias `[C*M]`.
* `ScaleShiftSpec`: `y = scale * xhat + shift`, `scale_shape` broadcastable
  against `xhat [B, ...]` (e.g. `(C,)` or `(1, C, 1, 1)`).
* `EmbeddingSpec`: `tf.gather(table, ids)` on axis 0 of a `[vocab_size, D]` table.
"""

import dataclasses
from typing import Tuple

_PADDINGS = ("SAME", "VALID", "EXPLICIT")
_FORMATS = ("NHWC", "NCHW")


def _text(value):
    return value.decode() if isinstance(value, bytes) else str(value)


def _ints(values, name, length=None):
    out = tuple(int(v) for v in values)
    if length is not None and len(out) != length:
        raise ValueError(f"{name} must have {length} entries, got {out}")
    return out


@dataclasses.dataclass(frozen=True)
class DenseSpec:
    """A matmul `s = a @ W (+ b)` applied at every position of `a`.

    Attributes:
      has_bias: the layer has a bias `[d_out]` (its gradient comes second).
      transpose_kernel: the kernel is stored `[d_out, d_in]` (`s = a @ W^T`).
    """

    has_bias: bool = False
    transpose_kernel: bool = False


@dataclasses.dataclass(frozen=True)
class _Conv2DAttrs:
    """Attributes shared by `Conv2D` and `DepthwiseConv2dNative`.

    `strides`, `dilations` are 4-lists in `data_format` order; `explicit_paddings`
    is TF's 8-int list (pairs per dimension, in `data_format` order), used only
    when `padding == "EXPLICIT"`. Lists are stored as tuples; byte strings (as
    read from a NodeDef) are accepted for `padding` and `data_format`.
    """

    kernel_shape: Tuple[int, int, int, int]
    strides: Tuple[int, ...] = (1, 1, 1, 1)
    dilations: Tuple[int, ...] = (1, 1, 1, 1)
    padding: str = "VALID"
    explicit_paddings: Tuple[int, ...] = ()
    data_format: str = "NHWC"
    has_bias: bool = False

    def __post_init__(self):
        put = lambda k, v: object.__setattr__(self, k, v)  # frozen dataclass
        put("kernel_shape", _ints(self.kernel_shape, "kernel_shape", 4))
        put("strides", _ints(self.strides, "strides", 4))
        put("dilations", _ints(self.dilations, "dilations", 4))
        put("padding", _text(self.padding).upper())
        put("data_format", _text(self.data_format).upper())
        put("explicit_paddings", _ints(self.explicit_paddings, "explicit_paddings"))
        if self.padding not in _PADDINGS:
            raise ValueError(f"padding must be one of {_PADDINGS}, got {self.padding}")
        if self.data_format not in _FORMATS:
            raise ValueError(f"data_format must be one of {_FORMATS}")
        if self.padding == "EXPLICIT" and len(self.explicit_paddings) != 8:
            raise ValueError("EXPLICIT padding needs 8 explicit_paddings")

    @property
    def _spatial(self):
        """Indices of H and W in `data_format` order."""
        return (1, 2) if self.data_format == "NHWC" else (2, 3)

    @property
    def kernel_hw(self):
        return self.kernel_shape[0], self.kernel_shape[1]

    @property
    def strides_hw(self):
        h, w = self._spatial
        return self.strides[h], self.strides[w]

    @property
    def dilations_hw(self):
        h, w = self._spatial
        return self.dilations[h], self.dilations[w]

    @property
    def explicit_paddings_hw(self):
        """((top, bottom), (left, right)) for EXPLICIT padding, else None."""
        if self.padding != "EXPLICIT":
            return None
        p = self.explicit_paddings
        h, w = self._spatial
        return (p[2 * h], p[2 * h + 1]), (p[2 * w], p[2 * w + 1])

    @classmethod
    def from_attrs(cls, kernel_shape, attrs, has_bias=False):
        """Builds the spec from a mapping of TF op attrs (missing ones default)."""
        keys = ("strides", "dilations", "padding", "explicit_paddings", "data_format")
        return cls(
            kernel_shape=tuple(kernel_shape),
            has_bias=has_bias,
            **{k: attrs[k] for k in keys if k in attrs},
        )


@dataclasses.dataclass(frozen=True)
class ConvSpec(_Conv2DAttrs):
    """`Conv2D`: kernel_shape = (kh, kw, Cin, Cout); bias `[Cout]`."""


@dataclasses.dataclass(frozen=True)
class DepthwiseSpec(_Conv2DAttrs):
    """`DepthwiseConv2dNative`: kernel_shape = (kh, kw, C, M); bias `[C*M]`."""


@dataclasses.dataclass(frozen=True)
class ScaleShiftSpec:
    """`y = scale * xhat (+ shift)`, `scale`/`shift` of shape `scale_shape`.

    `scale_shape` is right-aligned against `xhat [B, ...]` by broadcasting; if
    it has the rank of `xhat` its first entry (the batch axis) must be 1.
    """

    scale_shape: Tuple[int, ...]
    has_shift: bool = False

    def __post_init__(self):
        object.__setattr__(self, "scale_shape", _ints(self.scale_shape, "scale_shape"))


@dataclasses.dataclass(frozen=True)
class EmbeddingSpec:
    """`tf.gather(table, ids)` with `table [vocab_size, D]` (no bias)."""

    vocab_size: int

    def __post_init__(self):
        object.__setattr__(self, "vocab_size", int(self.vocab_size))
