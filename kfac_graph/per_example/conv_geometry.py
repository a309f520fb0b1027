"""Geometry shared by the convolution rules: layouts, padding, tap views.

Everything downstream works in NHWC. For output position `(y, x)` and kernel
tap `(p, q)` a convolution reads input row `y*s_h + p*d_h - pad_top` (and the
same for columns); `tap_views` returns, for every tap, the `[B, Ho, Wo, C]`
slab of the padded input that tap multiplies, so that

    conv(a, W)[y, x, o] = sum_{p,q,c} tap_{p,q}(a)[y, x, c] W[p, q, c, o].

Strided taps are taken without strided slices: the padded input is reshaped to
`[B, Hp/s_h, s_h, Wp/s_w, s_w, C]`, where the rows `p*d_h + s_h*y` are the unit
stride slice `[(p*d_h)//s_h + y, (p*d_h) % s_h]` (TF's strided-slice kernel was
about 5x slower than this on the stride-2 CNN layer, measured on the CPU).

Spatial sizes must be static (batch may be dynamic).
"""

import dataclasses
import math

import tensorflow as tf

from kfac_graph import patch_gather
from kfac_graph.per_example import uses as uses_lib


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Per-dimension numbers of one 2-D convolution, NHWC order."""

    kernel: tuple  # (kh, kw)
    strides: tuple  # (sh, sw)
    dilations: tuple  # (dh, dw)
    pads: tuple  # ((top, bottom), (left, right))
    in_size: tuple  # (H, W)
    out_size: tuple  # (Ho, Wo)

    @property
    def positions(self):
        return self.out_size[0] * self.out_size[1]


def geometry(spec, in_size):
    """The `Geometry` of `spec` (a conv/depthwise spec) on input `(H, W)`."""
    explicit = spec.explicit_paddings_hw or ((0, 0), (0, 0))
    outs, pads = [], []
    for i in range(2):
        out, pad = patch_gather.output_and_padding(
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
    )


def to_nhwc(x, data_format):
    """`x` in NHWC (a transpose for NCHW)."""
    return x if data_format == "NHWC" else tf.transpose(x, [0, 2, 3, 1])


def nhwc_use(a, g, spec):
    """`(a, g, geometry)` for one use, both tensors in NHWC."""
    a = to_nhwc(a, spec.data_format)
    g = to_nhwc(g, spec.data_format)
    geo = geometry(spec, (a.shape[1], a.shape[2]))
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


def gather_im2col(a, geo):
    """`im2col(a, geo)` by one gather of the padded input (`patch_gather.py`)."""
    return patch_gather.gather_patches(
        pad_input(a, geo), geo.kernel, geo.strides, geo.dilations, geo.out_size
    )


def _is_same_padding(geo):
    """Whether `geo.pads` are the pads TF's "SAME" gives this geometry."""
    return all(
        patch_gather.output_and_padding(
            geo.in_size[i], geo.kernel[i], geo.strides[i], geo.dilations[i], "SAME"
        )[1] == tuple(geo.pads[i])
        for i in range(2)
    )


def fold_batch_into_channels(a, g, geo):
    """A per-example filter gradient as one filter gradient: the input and the
    output gradient with the batch folded into the channels (``[1, H, W, B*C]``
    and ``[1, Ho, Wo, B*Cout]``, example-major within the channel axis), and
    the op's ``strides``, ``dilations`` and ``padding``. The op pads "SAME"
    itself (oneDNN's kernels are ~15% faster than on a padded copy, measured
    on the depthwise CNN layer); other padding is applied here, then
    ``"VALID"``."""
    padding = "SAME" if _is_same_padding(geo) else "VALID"
    ap = a if padding == "SAME" else pad_input(a, geo)
    batch = uses_lib.batch_size(a)
    _, hp, wp, c = ap.shape
    _, ho, wo, cout = g.shape
    x = tf.reshape(tf.transpose(ap, [1, 2, 0, 3]), [1, hp, wp, batch * c])
    dy = tf.reshape(tf.transpose(g, [1, 2, 0, 3]), [1, ho, wo, batch * cout])
    strides = [1, geo.strides[0], geo.strides[1], 1]
    dilations = [1, geo.dilations[0], geo.dilations[1], 1]
    return x, dy, strides, dilations, padding
