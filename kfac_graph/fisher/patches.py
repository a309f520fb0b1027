"""Convolution geometry and patch extraction for the KFC factors.

`ConvGeometry` holds the Conv2D / DepthwiseConv2dNative attributes exactly as
TensorFlow has them (4-lists in data-format order, padding "SAME", "VALID" or
"EXPLICIT" with 8 `explicit_paddings`, data format "NHWC" or "NCHW").

`extract_patches(x, ...)` returns `[B, T, kh*kw*C]`: for each of the `T`
output locations (row-major over the output's H', W') the input patch the
kernel sees there, flattened in `(kh, kw, C)` order -- the same row-major
order as the kernel `[kh, kw, C, Cout]`, so `patches @ reshape(kernel,
[-1, Cout])` is the convolution's output.  Zero padding appears as zeros.
"""

import dataclasses

import tensorflow as tf

from kfac_graph import patch_gather


def _text(x):
    return x.decode() if isinstance(x, bytes) else str(x)


@dataclasses.dataclass(frozen=True)
class ConvGeometry:
    """Static attributes of a 2-D convolution (see module docstring)."""

    strides: tuple = (1, 1, 1, 1)
    dilations: tuple = (1, 1, 1, 1)
    padding: str = "VALID"
    explicit_paddings: tuple = ()
    data_format: str = "NHWC"

    @classmethod
    def from_attrs(cls, attrs=None):
        """Builds from a dict of op attributes (bytes or str values allowed)."""
        attrs = dict(attrs or {})
        fmt = _text(attrs.get("data_format", "NHWC"))
        if fmt not in ("NHWC", "NCHW"):
            raise ValueError(f"ConvGeometry: unsupported data_format {fmt!r}")
        pad = _text(attrs.get("padding", "VALID")).upper()
        if pad not in ("SAME", "VALID", "EXPLICIT"):
            raise ValueError(f"ConvGeometry: unsupported padding {pad!r}")
        strides = tuple(int(s) for s in attrs.get("strides", (1, 1, 1, 1)))
        dil = tuple(int(s) for s in attrs.get("dilations", None) or (1, 1, 1, 1))
        if len(strides) != 4 or len(dil) != 4:
            raise ValueError("ConvGeometry: strides and dilations must have 4 ints")
        expl = tuple(int(p) for p in attrs.get("explicit_paddings", ()) or ())
        if pad == "EXPLICIT" and len(expl) != 8:
            raise ValueError("ConvGeometry: EXPLICIT padding needs 8 paddings")
        return cls(strides, dil, pad, expl, fmt)

    def _spatial(self, values):
        return (values[2], values[3]) if self.data_format == "NCHW" else (values[1], values[2])

    @property
    def spatial_strides(self):
        return self._spatial(self.strides)

    @property
    def spatial_dilations(self):
        return self._spatial(self.dilations)

    @property
    def spatial_paddings(self):
        """((top, bottom), (left, right)) for EXPLICIT padding."""
        p = self.explicit_paddings
        pairs = [(p[2 * i], p[2 * i + 1]) for i in range(4)]
        return self._spatial(pairs)


def channels_last(x, data_format):
    """NCHW -> NHWC (identity for NHWC)."""
    return tf.transpose(x, [0, 2, 3, 1]) if data_format == "NCHW" else x


def output_locations(g, data_format):
    """The conv output gradient as `[B, T, C]` (T = H' W' locations)."""
    g = channels_last(g, data_format)
    shape = tf.shape(g)
    return tf.reshape(g, [shape[0], shape[1] * shape[2], g.shape[-1]])


def extract_patches(x, kernel_hw, geometry):
    """Input patches `[B, T, kh*kw*C]` of the convolution (module docstring).

    One gather (`patch_gather.py`) when the spatial size is static, else
    `tf.image.extract_patches` (EXPLICIT padding applied first)."""
    x = channels_last(x, geometry.data_format)
    strides, dilations = geometry.spatial_strides, geometry.spatial_dilations
    explicit = geometry.spatial_paddings if geometry.padding == "EXPLICIT" else ((0, 0), (0, 0))
    if x.shape[1] is not None and x.shape[2] is not None:
        outs, pads = zip(*(
            patch_gather.output_and_padding(x.shape[1 + i], kernel_hw[i], strides[i],
                                            dilations[i], geometry.padding, explicit[i])
            for i in range(2)))
        if any(p != (0, 0) for p in pads):
            x = tf.pad(x, [[0, 0], list(pads[0]), list(pads[1]), [0, 0]])
        return patch_gather.gather_patches(x, kernel_hw, strides, dilations, outs)
    padding = geometry.padding
    if padding == "EXPLICIT":
        x = tf.pad(x, [[0, 0], list(explicit[0]), list(explicit[1]), [0, 0]])
        padding = "VALID"
    (kh, kw), (sh, sw), (dh, dw) = kernel_hw, strides, dilations
    patches = tf.image.extract_patches(
        x, sizes=[1, kh, kw, 1], strides=[1, sh, sw, 1], rates=[1, dh, dw, 1], padding=padding
    )
    shape = tf.shape(patches)
    return tf.reshape(patches, [shape[0], shape[1] * shape[2], kh * kw * x.shape[-1]])
