"""What the convolution kinds share: their rules' skeleton, and how a use's
spec and operands are read from the graph.

A convolution's per-example gradient is a sum over output locations (and
uses) of input-patch x output-gradient products:

    dW_i = sum_{uses} sum_{y,x} patch(a_i)[y, x] (x) g_i[y, x]
    db_i = sum_{uses} sum_{y,x} g_i[y, x]

A kind's rule (`ConvRule`, `DepthwiseRule`) says how to contract one use's
patches with its gradient (`KERNELS`, chosen by `auto_method` unless the
rule's `method` names one), when the Gram ("ghost") form of the norm is
cheaper (`gram_dims`: the contracted widths), and that form (`gram_norms`).
Everything else is here: channels-last layouts (2-D or 3-D) and geometry
per use (`conv_geometry.nhwc_use`), the sum over uses, the bias, and the norms.
Where a use's spatial size is unknown while tracing (a step traced with
a SavedModel's `[B, None, None, C]`), the kernels' geometry cannot be
built: `run_time_grads` contracts the patches `run_time_patches` gives at
any size instead (and the norms square what it gives); a rule
whose roles differ (the transposed convolution's) overrides `run_time_grads`.
"""

import dataclasses
import math

import tensorflow as tf

from kfac_graph.layers import conv_geometry as cg
from kfac_graph.layers import norms, parts
from kfac_graph.layers import uses as uses_lib
from kfac_graph.layers.kind import reshape_like, variable_shapes


@dataclasses.dataclass(frozen=True)
class PatchRule:
    """Base of the convolution rules (subclasses: frozen dataclasses that
    define `KERNELS`, `NAME`, `auto_method(spec)`, `gram_dims(spec)` and
    `gram_norms(nhwc_uses)`).

    Attributes:
      method: `"auto"` or one of the kind's `KERNELS`.
      norm_method: `"auto"` (the cost rule), `"gram"` or `"materialize"`.
      xla: whether the caller compiles with XLA; None detects it while tracing.
    """

    method: str = "auto"
    norm_method: str = "auto"
    xla: bool = None

    KERNELS = {}
    NAME = "convolution"

    def auto_method(self, spec):
        raise NotImplementedError

    def gram_dims(self, spec):
        raise NotImplementedError

    def gram_norms(self, nhwc_uses):
        raise NotImplementedError

    def groups(self, spec):
        """G: the groups whose input channels each output channel reads."""
        return spec.groups

    def choose_method(self, spec):
        """The kernel for `spec`: `method`, or by `auto_method` for "auto"."""
        if self.method != "auto":
            if self.method not in self.KERNELS:
                raise ValueError(f"unknown {self.NAME} method {self.method!r}")
            return self.method
        return self.auto_method(spec)

    @staticmethod
    def nhwc_uses(uses, spec):
        """`[(a, g, geometry)]` per use, both tensors in NHWC."""
        return [cg.nhwc_use(a, g, spec) for a, g in uses_lib.as_uses(uses)]

    def kernel_grads(self, nhwc_uses, spec):
        """The kernel's per-example gradients, summed over uses."""
        kernel = self.KERNELS[self.choose_method(spec)]
        return uses_lib.add_all([kernel(a, g, geo) for a, g, geo in nhwc_uses])

    @staticmethod
    def bias_grads(nhwc_uses):
        """The bias's per-example gradients `[B, channels out]`, summed over uses."""
        return uses_lib.add_all([tf.reduce_sum(g, axis=list(range(1, len(geo.kernel) + 1)))
                                 for _, g, geo in nhwc_uses])

    def per_example_grads(self, uses, spec):
        """The kernel's `[B, *kernel_shape]` and, if `spec.has_bias`, the bias's."""
        if not _sizes_known(uses, spec):
            return self.run_time_grads(uses, spec)
        nhwc_uses = self.nhwc_uses(uses, spec)
        out = [self.kernel_grads(nhwc_uses, spec)]
        if spec.has_bias:
            out.append(self.bias_grads(nhwc_uses))
        return out

    def run_time_grads(self, uses, spec):
        """`per_example_grads` where the spatial size is known at run time only."""
        return run_time_grads(uses, spec, self.groups(spec))

    def use_gram(self, spec, positions):
        """Whether `squared_norms` takes the Gram form for `positions` in all."""
        if self.norm_method in ("gram", "materialize"):
            return self.norm_method == "gram"
        if self.norm_method != "auto":
            raise ValueError(f"unknown norm_method {self.norm_method!r}")
        return norms.gram_is_cheaper(positions, *self.gram_dims(spec))

    def squared_norms(self, uses, spec):
        """`[B]`: squared norm of each example's gradient over kernel (+ bias)."""
        if not _sizes_known(uses, spec):
            return tf.add_n([norms.sum_of_squares(d) for d in self.per_example_grads(uses, spec)])
        nhwc_uses = self.nhwc_uses(uses, spec)
        positions = sum(geo.positions for _, _, geo in nhwc_uses)
        if self.use_gram(spec, positions):
            total = self.gram_norms(nhwc_uses)
        else:
            total = norms.sum_of_squares(self.kernel_grads(nhwc_uses, spec))
        if spec.has_bias:
            total += norms.sum_of_squares(self.bias_grads(nhwc_uses))
        return total


def _sizes_known(uses, spec) -> bool:
    """Whether every use's input and output gradient have a static spatial
    size while tracing."""
    return all(None not in cg.to_nhwc(t, spec.data_format).shape[1:-1]
               for use in uses_lib.as_uses(uses) for t in use)


def run_time_grads(uses, spec, groups):
    """Per-example gradients of a 2-D convolution whose spatial size is
    known at run time only (a SavedModel's ``[B, None, None, C]``, a Conv1D
    on sequences of any length): each use's patches ``[B, P, taps, G, cg]``
    (``tf.image.extract_patches``, ``conv_geometry.extract_patches``)
    contracted with its output gradient ``[B, P, G, og]`` over the ``P``
    positions,

        dW_i[t, c, j, o] = sum_{uses} sum_p patch_i[p, t, j, c] g_i[p, j, o],

    which is the kernel ``[*taps, cg, G og]`` (a depthwise kernel
    ``[kh, kw, C, M]``: ``G = C`` groups of ``cg = 1``), and the bias
    ``sum_p g_i[p]``."""
    taps = math.prod(spec.kernel_shape[:-2])
    kernels, biases = [], []
    for a, g in uses_lib.as_uses(uses):
        patches = cg.extract_patches(a, spec)
        g = cg.to_nhwc(g, spec.data_format)
        batch = tf.shape(g)[0]
        p = tf.reshape(patches, [batch, -1, taps, groups, patches.shape[-1] // (taps * groups)])
        d = tf.reshape(g, [batch, -1, groups, g.shape[-1] // groups])
        kernels.append(tf.reshape(tf.einsum("bptgc,bpgo->btcgo", p, d), [-1, *spec.kernel_shape]))
        biases.append(tf.reduce_sum(tf.reshape(g, [batch, -1, g.shape[-1]]), 1))
    return [uses_lib.add_all(kernels)] + ([uses_lib.add_all(biases)] if spec.has_bias else [])


def spec_reader(spec_type):
    """The record's ``spec(layer, use)`` for a convolution kind: ``spec_type``
    (a ``ConvAttrs``) from the op's attributes and kernel shape (the op's:
    Conv1D's kernel has a unit axis more than its variable)."""

    def spec(layer, use):
        attrs = layer.use_attrs[use]
        shapes = variable_shapes(layer)
        return spec_type.from_attrs(attrs.get("kernel_shape") or shapes[0], attrs,
                                    has_bias=len(shapes) == 2, layer=layer.name)

    return spec


def operands(layer, use, tensors, grads):
    """`a` and each `g` reshaped to the op's static input and output shapes;
    a use of a part of the kernel along its output channels (ConvLSTM's
    gates, `parts.py`) has `g` zero-padded to all of them."""
    attrs = layer.use_attrs[use]
    grads = [reshape_like(g, attrs.get("output_shape")) for g in grads]
    box = parts.part(layer, use, 0)
    if box is not None:
        fmt = attrs.get("data_format") or "NHWC"
        axis = 1 if (fmt.decode() if isinstance(fmt, bytes) else fmt).startswith("NC") else -1
        channels = variable_shapes(layer)[0][-1]
        grads = [parts.pad_axis(g, box, axis, -1, channels) for g in grads]
    return reshape_like(tensors[0], attrs.get("input_shape")), grads
