"""Kind "conv3d": `Conv3D` (Keras `Conv3D`), the convolution rule over three
spatial axes.

A `Conv3D` op (input NDHWC or NCDHW, kernel `[kd, kh, kw, Cin, Cout]`, bias
`[Cout]`) is the conv kind's math with one more spatial axis: its spec is
`conv.ConvSpec` read from 5-lists (`ConvAttrs.rank` 3), the rule is
`conv.ConvRule` (kernels "taps", "gather", "im2col"; "grouped" is 2-D
only), and its Kronecker factors are KFC's over the `T = Do*Ho*Wo` output
locations: A from the `kd*kh*kw*Cin` (+1) input patches (`conv.input_rows`),
G from the `Cout` output gradients (`conv.output_rows`):

    dW_i[r, p, q, c, o] = sum_{uses} sum_{z,y,x} tap_{r,p,q}(a_i)[z, y, x, c] g_i[z, y, x, o]
    F_kernel ~= T (A (x) G)

So it shares the conv kind's blocks ("kron": `ConvKroneckerBlock`,
"diagonal": `ConvDiagonalBlock`, "full"). Grouped `Conv3D` is not
registered (TensorFlow's CPU Conv3D has no groups; the pass leaves it
generic).
"""
import dataclasses

from kfac_graph.layers import conv

KIND = dataclasses.replace(conv.KIND, name="conv3d", colour="darkseagreen")
