"""Independent references for the Fisher tests (numpy and GradientTape).

Nothing here calls kfac_graph.fisher: patches are cut by hand in numpy, the
brute-force Fisher comes from per-example Jacobians of the model output.
"""

import numpy as np
import tensorflow as tf

F64 = tf.float64


def brute_fisher(model, params, x, fisher_z):
    """(1/B) sum_i J_i^T F_i J_i, J_i = dz_i/dtheta (canonical order).

    model(params, x) -> z [B, K]; fisher_z(z) -> [B, K, K] (closed form).
    """
    with tf.GradientTape(persistent=True) as tape:
        z = model(params, x)
    jacs = tape.jacobian(z, params, experimental_use_pfor=False)
    b, k = z.shape
    j = np.concatenate([np.reshape(jj.numpy(), [b, k, -1]) for jj in jacs], -1)
    fz = fisher_z(z).numpy()
    return np.einsum("bkn,bkl,blm->nm", j, fz, j) / b


def column_grads_wrt(model_parts, params, x, sqrt_cols):
    """Per-column cotangents pulled back to the layer output and params.

    model_parts(params, x, tape) -> (layer_input, layer_output, z).
    Returns (a, [g_c], [per-example param grads per column]) where g_c is
    d(sum_k z_k S_kc)/d s for each example (not scaled) and the param grads
    are per-example lists [B, *shape] computed one example at a time.
    """
    with tf.GradientTape(persistent=True) as tape:
        a, s, z = model_parts(params, x, tape)
        cols = [tf.stop_gradient(c) for c in sqrt_cols(z)]
        us = [tf.reduce_sum(z * c) for c in cols]
    gs = [tape.gradient(u, s) for u in us]
    del tape
    b = z.shape[0]
    pex = []
    for c in range(len(gs)):
        per_var = [[] for _ in params]
        for i in range(b):
            xi = tf.nest.map_structure(lambda t: t[i : i + 1], x)
            with tf.GradientTape() as t2:
                _, _, zi = model_parts(params, xi, t2)
                ui = tf.reduce_sum(zi * tf.stop_gradient(sqrt_cols(zi)[c]))
            for slot, gr in zip(per_var, t2.gradient(ui, params)):
                slot.append(gr)
        pex.append([tf.stack(v) for v in per_var])
    return a, gs, pex


def same_pads(size, k, s, d):
    eff = (k - 1) * d + 1
    out = -(-size // s)
    total = max((out - 1) * s + eff - size, 0)
    return total // 2, total - total // 2


def np_patches(x, kh, kw, strides=(1, 1), dilations=(1, 1), padding="VALID", pads=None):
    """Patches [B, T, kh*kw*C] of an NHWC array, by explicit loops."""
    b, h, w, c = x.shape
    sh, sw = strides
    dh, dw = dilations
    if padding == "SAME":
        pads = (same_pads(h, kh, sh, dh), same_pads(w, kw, sw, dw))
    elif padding == "VALID":
        pads = ((0, 0), (0, 0))
    xp = np.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
    hp, wp = xp.shape[1:3]
    eh, ew = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    out = []
    for i in range(0, hp - eh + 1, sh):
        for j in range(0, wp - ew + 1, sw):
            patch = xp[:, i : i + eh : dh, j : j + ew : dw, :]
            out.append(patch.reshape(b, -1))
    return np.stack(out, axis=1)


def pi_damped_kron(a, g, lam, replicas):
    """The damped Kronecker block R (A + pi r I) (x) (G + r/pi I), r = sqrt(l/R)."""
    r = np.sqrt(lam / replicas)
    pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
    return replicas * np.kron(a + pi * r * np.eye(len(a)), g + r / pi * np.eye(len(g)))


def flat(vs):
    return np.concatenate([np.ravel(np.asarray(v)) for v in vs])


def random_like(shapes, rng):
    return [tf.constant(rng.normal(size=s), F64) for s in shapes]


def out_size(size, k, s, d, padding, pads=(0, 0)):
    eff = (k - 1) * d + 1
    if padding == "SAME":
        return -(-size // s)
    return (size + pads[0] + pads[1] - eff) // s + 1


def unflat(vec, shapes):
    out, pos = [], 0
    for s in shapes:
        n = int(np.prod(s))
        out.append(tf.constant(np.reshape(vec[pos : pos + n], s), F64))
        pos += n
    return out


def operator_matrix(method, shapes):
    """Dense matrix of a linear map on variable lists, column by column."""
    n = int(sum(np.prod(s) for s in shapes))
    cols = [flat([t.numpy() for t in method(unflat(np.eye(n)[k], shapes))]) for k in range(n)]
    return np.stack(cols, axis=1)


def cov(rows):
    """``E[r r^T]`` over every row of ``rows`` (``[..., d]``)."""
    rows = rows.reshape(-1, rows.shape[-1])
    return rows.T @ rows / len(rows)


def homog(x):
    """``x`` with a 1 appended on its last axis (the bias's homogeneous coordinate)."""
    return np.concatenate([x, np.ones(x.shape[:-1] + (1,))], -1)


def softmax_fisher(z):
    """``[B, K, K]``: the categorical Fisher at logits ``z``, diag(p) - p p^T."""
    p = tf.nn.softmax(z)
    return tf.linalg.diag(p) - p[:, :, None] * p[:, None, :]
