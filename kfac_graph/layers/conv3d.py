"""Kinds "conv3d" and "conv3d_transpose": `Conv3D` and `Conv3DBackpropInputV2`
(Keras `Conv3D`, `Conv3DTranspose`), the convolution rules over three spatial
axes.

A `Conv3D` op (input NDHWC or NCDHW, kernel `[kd, kh, kw, Cin, Cout]`, bias
`[Cout]`) is the conv kind's math with one more spatial axis: its spec is
`conv.ConvSpec` read from 5-lists (`ConvAttrs.rank` 3), the rule is
`conv.ConvRule` (kernels "taps", "gather", "im2col"; "grouped", a 2-D
filter-gradient op, is not one of them), and its Kronecker factors are KFC's over the
`T = Do*Ho*Wo` output
locations: A from the `kd*kh*kw*Cin` (+1) input patches (`conv.input_rows`),
G from the `Cout` output gradients (`conv.output_rows`):

    dW_i[r, p, q, c, o] = sum_{uses} sum_{z,y,x} tap_{r,p,q}(a_i)[z, y, x, c] g_i[z, y, x, o]
    F_kernel ~= T (A (x) G)

So it shares the conv kind's blocks ("kron": `ConvKroneckerBlock`,
"kron_reduce": `ConvKroneckerReduceBlock`, "diagonal": `ConvDiagonalBlock`,
"full").

Grouped `Conv3D` (Keras `Conv3D(groups=G)`: kernel `[kd, kh, kw, cg, Cout]`
on `Cin = G*cg` channels, `og = Cout/G`; `spec.groups` from
`input_channels`) is G such layers side by side, as a grouped Conv2D:

    dW_i[r, p, q, c, j*og + o] = sum_{uses} sum_{z,y,x} tap_{r,p,q}(a_i)[z, y, x, j*cg + c]
                                                       g_i[z, y, x, j*og + o]
    F_kernel ~= blockdiag_j T (A_j (x) G_j)

(the rule's "taps", "gather" and "im2col" kernels through
`conv.groups_as_examples`; the blocks per group). TensorFlow's CPU Conv3D
has no groups, forward or backward (Keras compiles a grouped one with XLA),
so the graph the runtime re-runs has each grouped Conv3D written as G
ungrouped ones on channel slices, and an NCDHW one (which the CPU runs in
float32 only) transposed to NDHWC (`passes.grouped_conv3d`).

"conv3d_transpose" is `conv_transpose`'s kind the same way: the forward
convolution's geometry from 5-lists, its rule (the conv rule on `(dy, x)`)
and its blocks (KFC, or K-FAC-reduce with "kron_reduce", on the kernel
`V [Cin_t, kd*kh*kw*Cout_t]`, the bias's exact block beside it; the exact
diagonal; the full block).
"""
import dataclasses

from kfac_graph.layers import conv, conv_transpose

KIND = dataclasses.replace(conv.KIND, name="conv3d", colour="darkseagreen")
TRANSPOSE_KIND = dataclasses.replace(conv_transpose.KIND, name="conv3d_transpose",
                                     colour="mediumaquamarine")
