"""The models and rule wiring ``per_example_rules.py`` times: a CNN (conv
32 3x3, conv 64 3x3 stride 2, depthwise 3x3, 1x1 conv 64, global pool,
dense 10) and an MLP 784-512-256-10, each a list of ``(kind, spec)``
layers run with zero "probes" added to their pre-activations, so one
backward pass gives every layer's output gradient; the batch gradient and
the per-example gradients (or norms) of ``per_example``'s rules."""
import numpy as np
import tensorflow as tf

from kfac_graph import per_example as pe


def cnn_layers():
    return [
        ("conv2d", pe.ConvSpec((3, 3, 3, 32), padding="SAME", has_bias=True)),
        (
            "conv2d",
            pe.ConvSpec((3, 3, 32, 64), strides=(1, 2, 2, 1), padding="SAME", has_bias=True),
        ),
        ("depthwise_conv2d", pe.DepthwiseSpec((3, 3, 64, 1), padding="SAME", has_bias=True)),
        ("conv2d", pe.ConvSpec((1, 1, 64, 64), padding="SAME", has_bias=True)),
        ("pool", None),
        ("dense", pe.DenseSpec(has_bias=True)),
    ]


def mlp_layers():
    return [("dense", pe.DenseSpec(has_bias=True))] * 3


def make_params(layers, in_dim, rng):
    params, dim = [], in_dim
    dense_sizes = iter([512, 256, 10] if in_dim == 784 else [10])
    for kind, spec in layers:
        if kind == "pool":
            continue
        if kind == "dense":
            out = next(dense_sizes)
            shapes = [(dim, out), (out,)]
            dim = out
        elif kind == "conv2d":
            shapes = [spec.kernel_shape, (spec.kernel_shape[3],)]
            dim = spec.kernel_shape[3]
        else:
            kh, kw, c, m = spec.kernel_shape
            shapes = [spec.kernel_shape, (c * m,)]
            dim = c * m
        params.append(
            [tf.Variable(rng.standard_normal(s).astype(np.float32) * 0.1) for s in shapes]
        )
    return params


def apply_layer(kind, spec, a, weights):
    kernel, bias = weights
    if kind == "dense":
        s = tf.matmul(a, kernel)
    elif kind == "conv2d":
        s = tf.nn.conv2d(a, kernel, spec.strides, spec.padding)
    else:
        s = tf.nn.depthwise_conv2d(a, kernel, spec.strides, spec.padding)
    return s + bias


def forward(layers, params, x, probes=None):
    """Logits and the (kind, spec, a, s) of every parametric layer."""
    records, h, k = [], x, 0
    for index, (kind, spec) in enumerate(layers):
        if kind == "pool":
            h = tf.reduce_mean(h, axis=[1, 2])
            continue
        s = apply_layer(kind, spec, h, params[k])
        if probes is not None:
            s = s + probes[k]
        records.append((kind, spec, h, s))
        h = s if index == len(layers) - 1 else tf.nn.relu(s)
        k += 1
    return h, records


def losses(logits, y):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)


def batch_gradient_fn(layers, params):
    variables = [v for w in params for v in w]

    def fn(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(losses(forward(layers, params, x)[0], y))
        return tape.gradient(loss, variables)

    return fn


def per_example_fn(layers, params, registry, norms_only=False):
    """Forward + one backward to the probes + the rules."""

    def fn(x, y):
        _, recs = forward(layers, params, x)
        probes = [tf.zeros_like(s) for _, _, _, s in recs]
        with tf.GradientTape() as tape:
            tape.watch(probes)
            logits, recs = forward(layers, params, x, probes)
            loss = tf.reduce_sum(losses(logits, y))
        gs = tape.gradient(loss, probes)
        if norms_only:
            return tf.add_n(
                [
                    registry.squared_norms(kind, (a, g), spec)
                    for (kind, spec, a, _), g in zip(recs, gs)
                ]
            )
        out = []
        for (kind, spec, a, _), g in zip(recs, gs):
            out += registry.per_example_grads(kind, (a, g), spec)
        return out

    return fn


def registry_with(conv_method, dw_method, dense_method="auto", xla_island=True):
    return (
        pe.default_registry()
        .with_rule("conv2d", pe.ConvRule(method=conv_method))
        .with_rule("depthwise_conv2d", pe.DepthwiseRule(method=dw_method))
        .with_rule("dense", pe.DenseRule(method=dense_method, xla_island=xla_island))
    )
