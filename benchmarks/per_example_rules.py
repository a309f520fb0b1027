"""Side-by-side timings of the per-example gradient rule variants.

Prints three tables of *ratios* measured in one process (the machine is
shared: absolute times are noise, ratios of interleaved medians are not):

1. each conv / depthwise / dense layer of the benchmark models: the time of
   each per-example kernel divided by that layer's batch filter gradient;
2. the CNN (batch 64, 3x32x32: conv 32 3x3, conv 64 3x3 stride 2, depthwise
   3x3, 1x1 conv 64, global pool, dense 10): forward + backward + rules for
   per-example gradients (and norms), divided by the batch gradient (target
   for gradients: <= 2.5x);
3. the MLP 784-512-256-10 at batch 128: the same, and per-example gradients
   divided by the time of writing one [B, P] float tensor (target <= 1.5x).

Each with and without XLA (`tf.function(jit_compile=True)`).

    python benchmarks/per_example_rules.py [--reps 15] [--no-xla] [--slow]
        [--only layers|cnn|mlp|patches]

`--slow` also times the grouped kernels under XLA (seconds per call on CPU).
"""

import argparse
import os
import time

import bench_env  # noqa: E402,F401  (first: quiet logs, the repository importable)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from kfac_graph import per_example as pe  # noqa: E402

tf.get_logger().setLevel("ERROR")  # distinct tf.functions per variant
from kfac_graph.layers import conv as conv_lib  # noqa: E402
from kfac_graph.layers import conv_geometry as cg  # noqa: E402
from kfac_graph.layers import dense as dense_lib  # noqa: E402
from kfac_graph.layers import depthwise as dw_lib  # noqa: E402
from rule_models import (batch_gradient_fn, cnn_layers, make_params, mlp_layers,  # noqa: E402
                         per_example_fn, registry_with)


def time_all(fns, reps):
    """Median seconds of each zero-argument callable, calls interleaved."""
    for f in fns.values():
        f()
        f()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            start = time.perf_counter()
            out = f()
            tf.nest.map_structure(lambda t: t.shape, out)  # results are ready
            times[k].append(time.perf_counter() - start)
    return {k: float(np.median(v)) for k, v in times.items()}


def print_table(title, rows, header):
    print(f"\n{title}")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


# --- table 1: single layers --------------------------------------------------


def extract_patches_kernel(a, g, geo):
    """Variant tried and dropped: tf.image.extract_patches + batched matmul."""
    (kh, kw), (sh, sw) = geo.kernel, geo.strides
    ap = cg.pad_input(a, geo)
    p = tf.image.extract_patches(ap, [1, kh, kw, 1], [1, sh, sw, 1], [1, 1, 1, 1], "VALID")
    p = tf.reshape(p, [-1, geo.positions, p.shape[-1]])
    g2 = tf.reshape(g, [-1, geo.positions, g.shape[-1]])
    return tf.reshape(tf.matmul(p, g2, transpose_a=True), [-1, kh, kw, a.shape[-1], g.shape[-1]])


def layer_table(reps, xla_modes, slow):
    rng = np.random.default_rng(0)
    def same3x3(cin, cout, stride=1):
        return pe.ConvSpec((3, 3, cin, cout), strides=(1, stride, stride, 1), padding="SAME")

    conv_cases = [
        ("conv 3->32 3x3 @32x32", 64, 32, cnn_layers()[0][1]),
        ("conv 16->32 3x3 @32x32", 64, 32, same3x3(16, 32)),
        ("conv 32->32 3x3 @16x16", 64, 16, same3x3(32, 32)),
        ("conv 64->64 3x3 @16x16", 64, 16, same3x3(64, 64)),
        ("conv 32->64 3x3 s2 @32x32", 64, 32, cnn_layers()[1][1]),
        ("conv 64->128 3x3 s2 @16x16", 64, 16, same3x3(64, 128, 2)),
        ("conv 1x1 64->64 @16x16", 64, 16, cnn_layers()[3][1]),
    ]
    rows = []
    for xla in xla_modes:
        for name, batch, size, spec in conv_cases:
            geo = cg.geometry(spec, (size, size))
            a = tf.constant(
                rng.standard_normal((batch, size, size, spec.kernel_shape[2])), tf.float32
            )
            g = tf.constant(
                rng.standard_normal((batch,) + geo.out_size + (spec.kernel_shape[3],)), tf.float32
            )
            variants = {
                "batch": lambda a, g, spec=spec: tf.raw_ops.Conv2DBackpropFilter(
                    input=a,
                    filter_sizes=list(spec.kernel_shape),
                    out_backprop=g,
                    strides=list(spec.strides),
                    padding=spec.padding,
                ),
                "taps": lambda a, g, geo=geo: conv_lib.taps_kernel_grads(a, g, geo),
                "gather": lambda a, g, geo=geo: conv_lib.gather_kernel_grads(a, g, geo),
                "im2col": lambda a, g, geo=geo: conv_lib.im2col_kernel_grads(a, g, geo),
                "extract_patches": lambda a, g, geo=geo: extract_patches_kernel(a, g, geo),
            }
            if not xla or slow:
                variants["grouped"] = lambda a, g, geo=geo: conv_lib.grouped_kernel_grads(a, g, geo)
            rows += _layer_rows(name, variants, a, g, xla, reps)
        spec = cnn_layers()[2][1]
        geo = cg.geometry(spec, (16, 16))
        a = tf.constant(rng.standard_normal((64, 16, 16, 64)), tf.float32)
        g = tf.constant(rng.standard_normal((64, 16, 16, 64)), tf.float32)
        variants = {
            "batch": lambda a, g: tf.raw_ops.DepthwiseConv2dNativeBackpropFilter(
                input=a,
                filter_sizes=[3, 3, 64, 1],
                out_backprop=g,
                strides=[1, 1, 1, 1],
                padding="SAME",
            ),
            "taps": lambda a, g: dw_lib.taps_kernel_grads(a, g, geo),
        }
        if not xla or slow:
            variants["grouped"] = lambda a, g: dw_lib.grouped_kernel_grads(a, g, geo)
        rows += _layer_rows("depthwise 3x3 64 @16x16", variants, a, g, xla, reps)
        a = tf.constant(rng.standard_normal((128, 784)), tf.float32)
        g = tf.constant(rng.standard_normal((128, 512)), tf.float32)
        variants = {
            "batch": lambda a, g: tf.matmul(a, g, transpose_a=True),
            "outer": lambda a, g: a[:, :, None] * g[:, None, :],
            "outer (XLA island)": lambda a, g: dense_lib.outer_product(a, g),
            "matmul": lambda a, g: tf.matmul(a[:, None, :], g[:, None, :], transpose_a=True),
        }
        rows += _layer_rows("dense 784->512 B=128", variants, a, g, xla, reps)
    print_table(
        "1. per-example kernel / batch filter gradient, same layer",
        rows,
        ["layer", "xla", "variant", "ratio"],
    )


def _layer_rows(name, variants, a, g, xla, reps):
    fns = {}
    for k, v in variants.items():
        f = tf.function(v, jit_compile=xla)
        fns[k] = lambda f=f: f(a, g)
    times = time_all(fns, reps)
    return [
        (name, "yes" if xla else "no", k, f"{times[k] / times['batch']:.2f}")
        for k in variants
        if k != "batch"
    ]


# --- tables 2 and 3: whole models --------------------------------------------


def model_table(title, layers, x, y, combos, reps, xla_modes, write_floor):
    rng = np.random.default_rng(1)
    params = make_params(layers, x.shape[-1], rng)
    n_params = sum(int(np.prod(v.shape)) for w in params for v in w)
    rows = []
    for xla in xla_modes:
        fns = {"batch": tf.function(batch_gradient_fn(layers, params), jit_compile=xla)}
        for label, reg in combos(xla):
            fns[label] = tf.function(per_example_fn(layers, params, reg), jit_compile=xla)
        fns["norms (auto)"] = tf.function(
            per_example_fn(layers, params, pe.default_registry(), True), jit_compile=xla
        )
        if write_floor:
            batch = x.shape[0]
            fns["write [B,P]"] = tf.function(
                lambda x, y: tf.fill([batch, n_params], x[0, 0]), jit_compile=xla
            )
        times = time_all({k: (lambda f=f: f(x, y)) for k, f in fns.items()}, reps)
        for k in fns:
            if k == "batch":
                continue
            row = [("yes" if xla else "no"), k, f"{times[k] / times['batch']:.2f}"]
            if write_floor:
                row.append(f"{times[k] / times['write [B,P]']:.2f}")
            rows.append(row)
    header = ["xla", "variant", "/ batch grad"]
    if write_floor:
        header.append("/ write [B,P]")
    print_table(title, rows, header)


def cnn_combos(xla):
    combos = [("pxg auto", pe.default_registry())]
    conv_methods = ["taps", "gather", "im2col"] + ([] if xla else ["grouped"])
    dw_methods = ["taps"] + ([] if xla else ["grouped"])
    for cm in conv_methods:
        for dm in dw_methods:
            combos.append((f"pxg conv={cm} dw={dm}", registry_with(cm, dm)))
    return combos


def mlp_combos(xla):
    combos = [
        ("pxg auto", pe.default_registry()),
        ("pxg dense=matmul", registry_with("auto", "auto", "matmul")),
    ]
    if not xla:
        combos.append(
            (
                "pxg dense=outer, no XLA island",
                registry_with("auto", "auto", "outer", xla_island=False),
            )
        )
    return combos


# --- table 4: patch matrices -------------------------------------------------


def patches_table(reps, xla_modes):
    rng = np.random.default_rng(3)
    cases = [(256, 8, 1, 1, "SAME"), (256, 8, 16, 2, "SAME"), (64, 32, 3, 1, "SAME"),
             (64, 32, 32, 2, "SAME"), (64, 16, 64, 1, "VALID")]
    rows = []
    for xla in xla_modes:
        for batch, size, channels, stride, padding in cases:
            geometry = cg.ConvAttrs((3, 3, channels, 1), strides=(1, stride, stride, 1),
                                    padding=padding)
            x = tf.constant(rng.standard_normal((batch, size, size, channels)), tf.float32)
            fns = {
                "extract_patches": tf.function(
                    lambda x: tf.image.extract_patches(
                        x, [1, 3, 3, 1], [1, stride, stride, 1], [1, 1, 1, 1], padding),
                    jit_compile=xla),
                "gather": tf.function(
                    lambda x, g=geometry: cg.extract_patches(x, g), jit_compile=xla),
            }
            times = time_all({k: (lambda f=f: f(x)) for k, f in fns.items()}, reps)
            name = f"B={batch} {size}x{size}x{channels} 3x3 s{stride} {padding}"
            rows.append((name, "yes" if xla else "no",
                         f"{times['extract_patches'] / times['gather']:.2f}"))
    print_table("4. patch matrix: tf.image.extract_patches time / one gather's",
                rows, ["input", "xla", "ratio"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--no-xla", action="store_true")
    parser.add_argument("--slow", action="store_true")
    parser.add_argument("--only", choices=["layers", "cnn", "mlp", "patches"])
    args = parser.parse_args()
    xla_modes = [False] if args.no_xla else [False, True]
    rng = np.random.default_rng(2)
    print(
        f"TensorFlow {tf.__version__}, {os.cpu_count()} CPUs, float32, "
        f"median of {args.reps} interleaved calls"
    )
    if args.only in (None, "layers"):
        layer_table(args.reps, xla_modes, args.slow)
    if args.only in (None, "cnn"):
        x = tf.constant(rng.standard_normal((64, 32, 32, 3)), tf.float32)
        y = tf.constant(rng.integers(0, 10, 64), tf.int32)
        model_table(
            "2. CNN, batch 64: per-example gradients / batch gradient (target <= 2.5)",
            cnn_layers(),
            x,
            y,
            cnn_combos,
            args.reps,
            xla_modes,
            write_floor=False,
        )
    if args.only in (None, "mlp"):
        x = tf.constant(rng.standard_normal((128, 784)), tf.float32)
        y = tf.constant(rng.integers(0, 10, 128), tf.int32)
        model_table(
            "3. MLP 784-512-256-10, batch 128 (target: / write <= 1.5)",
            mlp_layers(),
            x,
            y,
            mlp_combos,
            args.reps,
            xla_modes,
            write_floor=True,
        )
    if args.only in (None, "patches"):
        patches_table(args.reps, xla_modes)


if __name__ == "__main__":
    main()
