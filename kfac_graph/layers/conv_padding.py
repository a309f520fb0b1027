"""A convolution's output size and zero padding along one spatial axis, as
TensorFlow computes them: from static sizes (Python ints) for the kernels'
geometry, or from sizes known at run time only (scalar tensors, with
``maximum=tf.maximum``) for the run-time patches."""


def output_and_padding(size, k, s, d, padding, explicit=(0, 0), maximum=max):
    """Output size and `(before, after)` zero padding of a convolution along one
    spatial axis (input `size`, kernel `k`, stride `s`, dilation `d`,
    `padding` "SAME", "VALID" or "EXPLICIT" with `explicit` pads), as TF does."""
    span = (k - 1) * d + 1
    if padding == "SAME":
        out = -(-size // s)
        total = maximum((out - 1) * s + span - size, 0)
        return out, (total // 2, total - total // 2)
    if padding == "VALID":
        return -(-(size - span + 1) // s), (0, 0)
    before, after = explicit
    return (size + before + after - span) // s + 1, (before, after)
