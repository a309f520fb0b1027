"""The one convolution geometry: attributes, output sizes, padding, patches.

A 2-D convolution (`Conv2D`, `DepthwiseConv2dNative`, and Conv1D lowered to
them) is described by `ConvAttrs`, read from the op's attributes exactly as
TensorFlow stores them (4-lists in `data_format` order; padding "SAME",
"VALID" or "EXPLICIT" with 8 `explicit_paddings`), plus the input's channel
count, from which a grouped `Conv2D` (kernel `[kh, kw, Cin/G, Cout]`) shows
its `groups` G. Both the per-example rules and the Fisher factors see the
input through the functions below.

Groups (Keras `Conv2D(groups=G)`, `Conv1D(groups=G)`): group j reads input
channels `j*cg ... (j+1)*cg - 1` (`cg = Cin/G`) and writes output channels
`j*og ... (j+1)*og - 1` (`og = Cout/G`), so a patch's features `(p, q, c)`
split as `(p, q, j, c')` and `group_features` regroups them per group,
`[..., G, kh*kw*cg]` in the kernel's `(p, q, c')` row order.

Everything downstream works in NHWC. For output position `(y, x)` and kernel
tap `(p, q)` a convolution reads input row `y*s_h + p*d_h - pad_top` (and the
same for columns); `tap_views` returns, for every tap, the `[B, Ho, Wo, C]`
slab of the padded input that tap multiplies, so that

    conv(a, W)[y, x, o] = sum_{p,q,c} tap_{p,q}(a)[y, x, c] W[p, q, c, o].

Strided taps are taken without strided slices: the padded input is reshaped to
`[B, Hp/s_h, s_h, Wp/s_w, s_w, C]`, where the rows `p*d_h + s_h*y` are the unit
stride slice `[(p*d_h)//s_h + y, (p*d_h) % s_h]` (TF's CPU strided-slice kernel
is slower; see README's kernel-choice section).

Patches (im2col) by one gather: for a zero-padded NHWC input `x [B, Hp, Wp,
C]` applied VALID, output position `(y, x)` sees, at kernel tap `(p, q)`, the
input row

    r(y, x, p, q) = (y*sh + p*dh) * Wp + (x*sw + q*dw)

of `x` flattened to `[B, Hp*Wp, C]`. Gathering those rows in `(y, x, p, q)`
order gives the patch matrix `[B, Ho*Wo, kh*kw*C]`, features in `(p, q, c)`
order like the flattened kernel `[kh, kw, C, ...]`: the matrix of
`tf.image.extract_patches`, in one copy of contiguous C-channel rows (faster,
see README's kernel-choice table). The indices are computed in the graph
(constant-folded), so a large image adds no constant to a saved graph.

Spatial sizes must be static for the tap views and the gather (batch may be
dynamic); `extract_patches` falls back to `tf.image.extract_patches` when
they are not.
"""

import dataclasses
import math
from typing import Optional, Tuple

import tensorflow as tf

from kfac_graph.layers.uses import batch_size

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
class ConvAttrs:
    """Attributes of `Conv2D` and `DepthwiseConv2dNative`, plus the kernel.

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
    input_channels: Optional[int] = None

    def __post_init__(self):
        put = lambda k, v: object.__setattr__(self, k, v)  # frozen dataclass  # noqa: E731
        put("kernel_shape", _ints(self.kernel_shape, "kernel_shape", 4))
        put("strides", _ints(self.strides, "strides", 4))
        put("dilations", _ints(self.dilations or (1, 1, 1, 1), "dilations", 4))
        put("padding", _text(self.padding).upper())
        put("data_format", _text(self.data_format).upper())
        put("explicit_paddings", _ints(self.explicit_paddings or (), "explicit_paddings"))
        if self.padding not in _PADDINGS:
            raise ValueError(f"padding must be one of {_PADDINGS}, got {self.padding}")
        if self.data_format not in _FORMATS:
            raise ValueError(f"data_format must be one of {_FORMATS}, got {self.data_format}")
        if self.padding == "EXPLICIT" and len(self.explicit_paddings) != 8:
            raise ValueError("EXPLICIT padding needs 8 explicit_paddings")
        if self.input_channels is not None:
            put("input_channels", int(self.input_channels))
            per_group, cout = self.kernel_shape[2], self.kernel_shape[3]
            if self.input_channels % per_group or cout % (self.input_channels // per_group or 1):
                raise ValueError(f"{self.input_channels} input channels do not split into groups "
                                 f"of the kernel's {per_group} with {cout} outputs")

    @property
    def groups(self):
        """G: input channels over the kernel's input channels (1 when unknown)."""
        if self.input_channels is None:
            return 1
        return self.input_channels // self.kernel_shape[2]

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
        keys = ("strides", "dilations", "padding", "explicit_paddings", "data_format",
                "input_channels")
        attrs = attrs or {}
        return cls(kernel_shape=tuple(kernel_shape), has_bias=has_bias,
                   **{k: attrs[k] for k in keys if k in attrs})


def output_and_padding(size, k, s, d, padding, explicit=(0, 0)):
    """Output size and `(before, after)` zero padding of a convolution along one
    spatial axis (input `size`, kernel `k`, stride `s`, dilation `d`,
    `padding` "SAME", "VALID" or "EXPLICIT" with `explicit` pads), as TF does."""
    span = (k - 1) * d + 1
    if padding == "SAME":
        out = -(-size // s)
        total = max((out - 1) * s + span - size, 0)
        return out, (total // 2, total - total // 2)
    if padding == "VALID":
        return -(-(size - span + 1) // s), (0, 0)
    before, after = explicit
    return (size + before + after - span) // s + 1, (before, after)


def gather_patches(x, kernel, strides, dilations, out_size):
    """`[B, Ho*Wo, kh*kw*C]` patches of the padded NHWC `x` (module docstring).

    `x` must have static spatial dimensions and hold every row the
    convolution reads: `(Ho-1)*sh + (kh-1)*dh < Hp`, likewise for columns.
    """
    (kh, kw), (sh, sw), (dh, dw), (ho, wo) = kernel, strides, dilations, out_size
    hp, wp, c = x.shape[1], x.shape[2], x.shape[3]
    if (ho - 1) * sh + (kh - 1) * dh >= hp or (wo - 1) * sw + (kw - 1) * dw >= wp:
        raise ValueError(
            f"gather_patches: a {hp}x{wp} input is too small for {ho}x{wo} outputs of a "
            f"{kh}x{kw} kernel with strides {(sh, sw)} and dilations {(dh, dw)}"
        )
    rows = tf.range(ho)[:, None, None, None] * sh + tf.range(kh)[None, None, :, None] * dh
    cols = tf.range(wo)[None, :, None, None] * sw + tf.range(kw)[None, None, None, :] * dw
    index = tf.reshape(rows * wp + cols, [-1])
    flat = tf.reshape(x, [-1, hp * wp, c])
    patches = tf.gather(flat, index, axis=1)
    return tf.reshape(patches, [-1, ho * wo, kh * kw * c])


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Per-dimension numbers of one 2-D convolution, NHWC order."""

    kernel: tuple  # (kh, kw)
    strides: tuple  # (sh, sw)
    dilations: tuple  # (dh, dw)
    pads: tuple  # ((top, bottom), (left, right))
    in_size: tuple  # (H, W)
    out_size: tuple  # (Ho, Wo)
    groups: int = 1

    @property
    def positions(self):
        return self.out_size[0] * self.out_size[1]


def geometry(spec, in_size):
    """The `Geometry` of `spec` (a conv/depthwise spec) on input `(H, W)`."""
    explicit = spec.explicit_paddings_hw or ((0, 0), (0, 0))
    outs, pads = [], []
    for i in range(2):
        out, pad = output_and_padding(
            in_size[i],
            spec.kernel_hw[i],
            spec.strides_hw[i],
            spec.dilations_hw[i],
            spec.padding,
            explicit[i],
        )
        outs.append(out)
        pads.append(pad)
    return Geometry(
        tuple(spec.kernel_hw),
        tuple(spec.strides_hw),
        tuple(spec.dilations_hw),
        tuple(pads),
        tuple(in_size),
        tuple(outs),
        spec.groups,
    )


def to_nhwc(x, data_format):
    """`x` in NHWC (a transpose for NCHW)."""
    return x if data_format == "NHWC" else tf.transpose(x, [0, 2, 3, 1])


def nhwc_use(a, g, spec):
    """`(a, g, geometry)` for one use, both tensors in NHWC."""
    a = to_nhwc(a, spec.data_format)
    g = to_nhwc(g, spec.data_format)
    geo = geometry(spec, (a.shape[1], a.shape[2]))
    channels = spec.kernel_shape[2] * spec.groups
    if a.shape[-1] is not None and a.shape[-1] != channels:
        raise ValueError(f"the input has {a.shape[-1]} channels; the kernel reads {channels} "
                         f"({spec.groups} group(s) of {spec.kernel_shape[2]})")
    if (g.shape[1], g.shape[2]) != geo.out_size:
        raise ValueError(
            f"g spatial shape {g.shape[1:3]} does not match the convolution's output {geo.out_size}"
        )
    return a, g, geo


def pad_input(a, geo, multiple_of=(1, 1), min_size=(0, 0)):
    """Zero-pads NHWC `a` as the convolution does, then (at the end) further up
    to at least `min_size` and to a multiple of `multiple_of` per dimension."""
    paddings = [[0, 0]]
    for i in range(2):
        before, after = geo.pads[i]
        size = geo.in_size[i] + before + after
        target = max(size, min_size[i])
        target = multiple_of[i] * math.ceil(target / multiple_of[i])
        paddings.append([before, after + target - size])
    paddings.append([0, 0])
    if all(p == [0, 0] for p in paddings):
        return a
    return tf.pad(a, paddings)


def tap_views(a, geo):
    """List over taps `(p, q)` (row-major) of `[B, Ho, Wo, C]` input slabs."""
    (kh, kw), (sh, sw), (dh, dw) = geo.kernel, geo.strides, geo.dilations
    ho, wo = geo.out_size
    need = (sh * ((kh - 1) * dh // sh + ho), sw * ((kw - 1) * dw // sw + wo))
    ap = pad_input(a, geo, multiple_of=(sh, sw), min_size=need)
    hp, wp, c = ap.shape[1], ap.shape[2], ap.shape[3]
    if sh == 1 and sw == 1:
        return [
            ap[:, p * dh : p * dh + ho, q * dw : q * dw + wo, :]
            for p in range(kh)
            for q in range(kw)
        ]
    r = tf.reshape(ap, [-1, hp // sh, sh, wp // sw, sw, c])
    views = []
    for p in range(kh):
        for q in range(kw):
            y0, ry = divmod(p * dh, sh)
            x0, rx = divmod(q * dw, sw)
            views.append(r[:, y0 : y0 + ho, ry, x0 : x0 + wo, rx, :])
    return views


def im2col(a, geo):
    """`[B, Ho*Wo, kh*kw*C]` patches, features ordered `(p, q, c)` like the
    flattened kernel `[kh, kw, C, ...]`."""
    views = tap_views(a, geo)
    c = a.shape[-1]
    if len(views) == 1:
        return tf.reshape(views[0], [-1, geo.positions, c])
    patches = tf.stack(views, axis=3)  # [B, Ho, Wo, kh*kw, C]
    return tf.reshape(patches, [-1, geo.positions, len(views) * c])


def group_features(patches, channels, groups):
    """`[..., kh*kw*channels]` patch features `(p, q, j, c)` -> `[..., G,
    kh*kw*cg]`, group j's features in `(p, q, c)` order (module docstring)."""
    taps, per_group = patches.shape[-1] // channels, channels // groups
    lead = [-1 if d is None else d for d in patches.shape[:-1]]
    if lead.count(-1) > 1:
        lead = tf.unstack(tf.shape(patches)[:-1])
    split = tf.transpose(tf.reshape(patches, [-1, taps, groups, per_group]), [0, 2, 1, 3])
    return tf.reshape(split, lead + [groups, taps * per_group])


def gather_im2col(a, geo):
    """`im2col(a, geo)` by one gather of the padded input (`gather_patches`)."""
    return gather_patches(
        pad_input(a, geo), geo.kernel, geo.strides, geo.dilations, geo.out_size
    )


def _is_same_padding(geo):
    """Whether `geo.pads` are the pads TF's "SAME" gives this geometry."""
    return all(
        output_and_padding(
            geo.in_size[i], geo.kernel[i], geo.strides[i], geo.dilations[i], "SAME"
        )[1] == tuple(geo.pads[i])
        for i in range(2)
    )


def fold_batch_into_channels(a, g, geo):
    """A per-example filter gradient as one filter gradient: the input and the
    output gradient with the batch folded into the channels (``[1, H, W, B*C]``
    and ``[1, Ho, Wo, B*Cout]``, example-major within the channel axis), and
    the op's ``strides``, ``dilations`` and ``padding``. The op pads "SAME"
    itself (oneDNN's kernels are faster than on a padded copy; see README's
    kernel-choice section); other padding is applied here, then
    ``"VALID"``."""
    padding = "SAME" if _is_same_padding(geo) else "VALID"
    ap = a if padding == "SAME" else pad_input(a, geo)
    batch = batch_size(a)
    _, hp, wp, c = ap.shape
    _, ho, wo, cout = g.shape
    x = tf.reshape(tf.transpose(ap, [1, 2, 0, 3]), [1, hp, wp, batch * c])
    dy = tf.reshape(tf.transpose(g, [1, 2, 0, 3]), [1, ho, wo, batch * cout])
    strides = [1, geo.strides[0], geo.strides[1], 1]
    dilations = [1, geo.dilations[0], geo.dilations[1], 1]
    return x, dy, strides, dilations, padding


def extract_patches(x, spec):
    """Input patches `[B, T, kh*kw*C]` of the convolution `spec` (a
    `ConvAttrs`) on `x` in its data format, `T = Ho*Wo` output locations in
    row-major order: one gather when the spatial size is static, else
    `tf.image.extract_patches` (EXPLICIT padding applied first)."""
    x = to_nhwc(x, spec.data_format)
    if x.shape[1] is not None and x.shape[2] is not None:
        return gather_im2col(x, geometry(spec, (x.shape[1], x.shape[2])))
    padding = spec.padding
    if padding == "EXPLICIT":
        (top, bottom), (left, right) = spec.explicit_paddings_hw
        x = tf.pad(x, [[0, 0], [top, bottom], [left, right], [0, 0]])
        padding = "VALID"
    (kh, kw), (sh, sw), (dh, dw) = spec.kernel_hw, spec.strides_hw, spec.dilations_hw
    patches = tf.image.extract_patches(
        x, sizes=[1, kh, kw, 1], strides=[1, sh, sw, 1], rates=[1, dh, dw, 1], padding=padding
    )
    shape = tf.shape(patches)
    return tf.reshape(patches, [shape[0], shape[1] * shape[2], kh * kw * x.shape[-1]])


def output_locations(g, data_format):
    """The convolution's output (gradient) as `[B, T, C]`, `T = Ho*Wo`."""
    g = to_nhwc(g, data_format)
    shape = tf.shape(g)
    return tf.reshape(g, [shape[0], shape[1] * shape[2], g.shape[-1]])
