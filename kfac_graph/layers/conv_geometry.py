"""The one convolution geometry: attributes, output sizes, padding, patches.

A convolution over N = 2 or 3 spatial axes (`Conv2D`, `DepthwiseConv2dNative`,
Conv1D lowered to them; `Conv3D`) is described by `ConvAttrs`, read from the
op's attributes exactly as TensorFlow stores them ((N+2)-lists in
`data_format` order, NHWC/NCHW or NDHWC/NCDHW, so N is `len(strides) - 2`;
padding "SAME", "VALID" or "EXPLICIT" with 2(N+2) `explicit_paddings`), plus
the input's channel count, from which a grouped `Conv2D` (kernel
`[kh, kw, Cin/G, Cout]`) shows its `groups` G. Both the per-example rules and
the Fisher factors see the input through the functions below, which work per
spatial axis: written here in 2-D, 3-D adds a depth axis (tap `r`, stride
`s_d`, ...) the same way, taps and features in `(r, p, q, c)` order.

Groups (Keras `Conv2D(groups=G)`, `Conv1D(groups=G)`): group j reads input
channels `j*cg ... (j+1)*cg - 1` (`cg = Cin/G`) and writes output channels
`j*og ... (j+1)*og - 1` (`og = Cout/G`), so a patch's features `(p, q, c)`
split as `(p, q, j, c')` and `group_features` regroups them per group,
`[..., G, kh*kw*cg]` in the kernel's `(p, q, c')` row order.

Everything downstream works channels-last (NHWC, NDHWC). For output position
`(y, x)` and kernel tap `(p, q)` a convolution reads input row
`y*s_h + p*d_h - pad_top` (and the same for columns); `tap_views` returns, for
every tap, the `[B, Ho, Wo, C]` slab of the padded input that tap multiplies, so that

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

Spatial sizes must be static for the tap views and the gather (batch may be dynamic);
in 2-D `extract_patches` falls back to `tf.image.extract_patches`.
"""

import dataclasses
import itertools
import math
from typing import Optional, Tuple

import tensorflow as tf

from kfac_graph.layers import run_time_patches
from kfac_graph.layers.conv_padding import output_and_padding  # noqa: F401 (cg's callers)
from kfac_graph.layers.uses import batch_size

_PADDINGS = ("SAME", "VALID", "EXPLICIT")
_FORMATS = ("NHWC", "NCHW", "NDHWC", "NCDHW")
_FORMATS_3D = {"NHWC": "NDHWC", "NCHW": "NCDHW"}  # 2-D names read as channels-last/first


def _text(value):
    return value.decode() if isinstance(value, bytes) else str(value)


def _ints(values, name, length=None):
    out = tuple(int(v) for v in values)
    if length is not None and len(out) != length:
        raise ValueError(f"{name} must have {length} entries, got {out}")
    return out


@dataclasses.dataclass(frozen=True)
class ConvAttrs:
    """Attributes of `Conv2D`, `DepthwiseConv2dNative` and `Conv3D`, plus the kernel.

    `strides`, `dilations` are (N+2)-lists in `data_format` order (N = `rank`,
    2, or 3 for 5-lists); `explicit_paddings` is TF's 2(N+2)-int list (pairs
    per dimension, in `data_format` order), used only when
    `padding == "EXPLICIT"`. The `*_hw` properties are per spatial axis:
    `(H, W)`, or `(D, H, W)` in 3-D. Lists are stored as tuples; byte strings (as
    read from a NodeDef) are accepted for `padding` and `data_format`.
    """

    kernel_shape: Tuple[int, ...]
    strides: Tuple[int, ...] = (1, 1, 1, 1)
    dilations: Tuple[int, ...] = ()
    padding: str = "VALID"
    explicit_paddings: Tuple[int, ...] = ()
    data_format: str = "NHWC"
    has_bias: bool = False
    input_channels: Optional[int] = None
    layer: str = dataclasses.field(default="", compare=False)  # named in errors

    def __post_init__(self):
        put = lambda k, v: object.__setattr__(self, k, v)  # frozen dataclass  # noqa: E731
        put("strides", _ints(self.strides, "strides"))
        n = len(self.strides)
        if n not in (4, 5):
            raise ValueError(f"strides must have 4 or 5 entries, got {self.strides}")
        put("kernel_shape", _ints(self.kernel_shape, "kernel_shape", n))
        put("dilations", _ints(self.dilations or (1,) * n, "dilations", n))
        put("padding", _text(self.padding).upper())
        fmt = _text(self.data_format).upper()
        put("data_format", _FORMATS_3D.get(fmt, fmt) if n == 5 else fmt)
        put("explicit_paddings", _ints(self.explicit_paddings or (), "explicit_paddings"))
        if self.padding not in _PADDINGS:
            raise ValueError(f"padding must be one of {_PADDINGS}, got {self.padding}")
        if self.data_format not in _FORMATS or len(self.data_format) != n:
            raise ValueError(f"data_format must be one of {_FORMATS} with {n} axes, "
                             f"got {self.data_format}")
        if self.padding == "EXPLICIT" and len(self.explicit_paddings) != 2 * n:
            raise ValueError(f"EXPLICIT padding needs {2 * n} explicit_paddings")
        if self.input_channels is not None:
            put("input_channels", int(self.input_channels))
            per_group, cout = self.kernel_shape[-2], self.kernel_shape[-1]
            if self.input_channels % per_group or cout % (self.input_channels // per_group or 1):
                raise ValueError(f"{self.input_channels} input channels do not split into groups "
                                 f"of the kernel's {per_group} with {cout} outputs")

    @property
    def groups(self):
        """G: input channels over the kernel's input channels (1 when unknown)."""
        if self.input_channels is None:
            return 1
        return self.input_channels // self.kernel_shape[-2]

    @property
    def rank(self):
        """N: the number of spatial axes (2, or 3 for `Conv3D`)."""
        return len(self.strides) - 2

    @property
    def _spatial(self):
        """Indices of the spatial axes ((D,) H, W) in `data_format` order."""
        first = 1 if self.data_format.endswith("C") else 2
        return tuple(range(first, first + self.rank))

    @property
    def kernel_hw(self):
        return self.kernel_shape[:self.rank]

    @property
    def strides_hw(self):
        return tuple(self.strides[i] for i in self._spatial)

    @property
    def dilations_hw(self):
        return tuple(self.dilations[i] for i in self._spatial)

    @property
    def explicit_paddings_hw(self):
        """((top, bottom), (left, right)) (3-D: depth's pair first) for
        EXPLICIT padding, else None."""
        if self.padding != "EXPLICIT":
            return None
        p = self.explicit_paddings
        return tuple((p[2 * i], p[2 * i + 1]) for i in self._spatial)

    @classmethod
    def from_attrs(cls, kernel_shape, attrs, has_bias=False, layer=""):
        """Builds the spec from a mapping of TF op attrs (missing ones default);
        ``layer``: the name its run-time errors give."""
        keys = ("strides", "dilations", "padding", "explicit_paddings", "data_format",
                "input_channels")
        attrs = attrs or {}
        return cls(kernel_shape=tuple(kernel_shape), has_bias=has_bias, layer=layer,
                   **{k: attrs[k] for k in keys if k in attrs})


def gather_patches(x, kernel, strides, dilations, out_size):
    """`[B, Ho*Wo, kh*kw*C]` patches of the padded channels-last `x` (module
    docstring; 3-D: `[B, Do*Ho*Wo, kd*kh*kw*C]`).

    `x` must have static spatial dimensions and hold every row the
    convolution reads: `(Ho-1)*sh + (kh-1)*dh < Hp`, likewise per axis.
    """
    sizes, c, n = tuple(x.shape[1:-1]), x.shape[-1], len(kernel)
    if any((o - 1) * s + (k - 1) * d >= size
           for k, s, d, o, size in zip(kernel, strides, dilations, out_size, sizes)):
        raise ValueError(
            f"gather_patches: a {sizes} input is too small for {tuple(out_size)} outputs of a "
            f"{tuple(kernel)} kernel with strides {tuple(strides)} and dilations {tuple(dilations)}"
        )
    along = lambda v, j: tf.reshape(v, [-1 if a == j else 1 for a in range(2 * n)])  # noqa: E731
    index = 0  # [*out_size, *kernel]: the flat row, Horner's rule over the axes
    for i in range(n):
        index = (index * sizes[i] + along(tf.range(out_size[i]) * strides[i], i)
                 + along(tf.range(kernel[i]) * dilations[i], n + i))
    flat = tf.reshape(x, [-1, math.prod(sizes), c])
    patches = tf.gather(flat, tf.reshape(index, [-1]), axis=1)
    return tf.reshape(patches, [-1, math.prod(out_size), math.prod(kernel) * c])


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Per-axis numbers of one convolution, spatial axes in channels-last
    order ((D,) H, W)."""

    kernel: tuple  # (kh, kw)
    strides: tuple  # (sh, sw)
    dilations: tuple  # (dh, dw)
    pads: tuple  # ((top, bottom), (left, right))
    in_size: tuple  # (H, W)
    out_size: tuple  # (Ho, Wo)
    groups: int = 1

    @property
    def positions(self):
        return math.prod(self.out_size)


def geometry(spec, in_size):
    """The `Geometry` of `spec` (a conv/depthwise spec) on input `(H, W)`
    (3-D: `(D, H, W)`)."""
    explicit = spec.explicit_paddings_hw or ((0, 0),) * spec.rank
    outs, pads = [], []
    for i in range(spec.rank):
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
    """`x` channels-last (a transpose for NCHW, NCDHW)."""
    if data_format.endswith("C"):
        return x
    return tf.transpose(x, [0, *range(2, len(data_format)), 1])


def nhwc_use(a, g, spec):
    """`(a, g, geometry)` for one use, both tensors channels-last."""
    a = to_nhwc(a, spec.data_format)
    g = to_nhwc(g, spec.data_format)
    geo = geometry(spec, tuple(a.shape[1:-1]))
    channels = spec.kernel_shape[-2] * spec.groups
    if a.shape[-1] is not None and a.shape[-1] != channels:
        raise ValueError(f"the input has {a.shape[-1]} channels; the kernel reads {channels} "
                         f"({spec.groups} group(s) of {spec.kernel_shape[-2]})")
    if tuple(g.shape[1:-1]) != geo.out_size:
        raise ValueError(
            f"g spatial shape {g.shape[1:-1]} does not match the convolution's output "
            f"{geo.out_size}"
        )
    return a, g, geo


def pad_input(a, geo, multiple_of=None, min_size=None):
    """Zero-pads channels-last `a` as the convolution does, then (at the end)
    further up to at least `min_size` and to a multiple of `multiple_of` per
    spatial axis (default: neither)."""
    paddings = [[0, 0]]
    for i, (before, after) in enumerate(geo.pads):
        size = geo.in_size[i] + before + after
        target = max(size, min_size[i]) if min_size else size
        if multiple_of:
            target = multiple_of[i] * math.ceil(target / multiple_of[i])
        paddings.append([before, after + target - size])
    paddings.append([0, 0])
    if all(p == [0, 0] for p in paddings):
        return a
    return tf.pad(a, paddings)


def tap_views(a, geo):
    """List over taps `(p, q)` (row-major; 3-D `(r, p, q)`) of `[B, Ho, Wo, C]`
    (3-D `[B, Do, Ho, Wo, C]`) input slabs."""
    axes = list(zip(geo.kernel, geo.strides, geo.dilations, geo.out_size))
    need = tuple(s * ((k - 1) * d // s + o) for k, s, d, o in axes)
    ap = pad_input(a, geo, multiple_of=geo.strides, min_size=need)
    taps = itertools.product(*(range(k) for k in geo.kernel))
    every = slice(None)
    if all(s == 1 for s in geo.strides):
        return [ap[(every, *(slice(t * d, t * d + o) for t, (_, _, d, o) in zip(tap, axes)), every)]
                for tap in taps]
    r = tf.reshape(ap, [-1, *(v for size, s in zip(ap.shape[1:-1], geo.strides)
                              for v in (size // s, s)), ap.shape[-1]])
    views = []
    for tap in taps:
        index = [every]
        for t, (_, s, d, o) in zip(tap, axes):
            start, phase = divmod(t * d, s)
            index += [slice(start, start + o), phase]
        views.append(r[(*index, every)])
    return views


def im2col(a, geo):
    """`[B, Ho*Wo, kh*kw*C]` patches, features ordered `(p, q, c)` like the
    flattened kernel `[kh, kw, C, ...]` (3-D: `(r, p, q, c)`)."""
    views = tap_views(a, geo)
    c = a.shape[-1]
    if len(views) == 1:
        return tf.reshape(views[0], [-1, geo.positions, c])
    patches = tf.stack(views, axis=len(geo.kernel) + 1)  # [B, Ho, Wo, kh*kw, C]
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
        for i in range(len(geo.pads))
    )


def fold_batch_into_channels(a, g, geo):
    """A per-example filter gradient as one filter gradient: the input and the
    output gradient with the batch folded into the channels (``[1, H, W, B*C]``
    and ``[1, Ho, Wo, B*Cout]``, example-major within the channel axis), and
    the op's ``strides``, ``dilations`` and ``padding`` (2-D only). The op pads "SAME"
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
    row-major order (3-D: `[B, Do*Ho*Wo, kd*kh*kw*C]`): one gather when the
    spatial size is static, else `run_time_patches.patches`."""
    x = to_nhwc(x, spec.data_format)
    if None not in x.shape[1:-1]:
        return gather_im2col(x, geometry(spec, tuple(x.shape[1:-1])))
    return run_time_patches.patches(x, spec)
