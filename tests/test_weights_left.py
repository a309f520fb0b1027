"""Dense layers written with the weights on the left, or with a kernel
reshaped from another shape, register as the dense layers they are.

- ``tf.linalg.matvec(W, x)`` (``W [d_out, d_in]``, ``x [B, d_in]`` or
  ``[B, T, d_in]``): ``x W^T``, a batched matmul of ``W`` and
  ``expand_dims(x, -1)`` squeezed (``passes/weights_left.py``);
- ``tf.matmul(W, x)`` (``x [B, d_in, n]`` -> ``[B, d_out, n]``, ``n``
  positions), ``transpose_a=True`` (``W [d_in, d_out]``) and the Einsum
  ``"oi,bin->bon"``, with a channels bias ``b[:, None]``;
- ``tf.matmul(x, tf.reshape(w, [d_in, d_out]))`` with ``w`` flat
  (``passes/patterns_reshaped.py``).

Each registers as dense (kernel, then its bias), its per-example gradients
equal one-example tapes (float64), its exact-mode Kronecker block equals the
brute-force Fisher where K-FAC is exact (one example, one position) and the
block of the same model written ``x @ W^T`` (``x @ K`` for the reshaped
kernel) on a batch with positions, and default ``kg.KFAC`` steps give that
twin's losses. A model of all three traced with its sizes unknown registers
and equals the loop, and ``kfac-rewrite``'s model of it trains in a process
without the library. (A bias along the positions of ``"oi,bin->bon"``, of
the outputs' width, was taken for the layer's bias: wrong gradients.)
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from fisher_reference import brute_fisher, softmax_fisher
from fresh_process import NO_LIBRARY
from per_example_reference import one_example_loop

B, DI, DO, N, K = 3, 4, 3, 2, 3
T = lambda x: tf.transpose(x, [0, 2, 1])  # noqa: E731
# how each form pools its output, and reads x [B, N, DI]
POOL = {"2d": lambda h: h, "positions": lambda h: tf.reduce_mean(h, 1),
        "channels": lambda h: tf.reduce_mean(h, 2)}
READ = {"2d": lambda x: x[:, 0], "positions": lambda x: x, "channels": T}
# name: (kernel layout: "oi" [DO, DI], "io" [DI, DO] or "flat" [DI * DO]; the form's
#        output layout; the form; its twin, whose output has positions first)
FORMS = {
    "matvec": ("oi", "2d", lambda w, b, x: tf.linalg.matvec(w, x) + b,
               lambda w, b, x: tf.matmul(x, w, transpose_b=True) + b),
    "matvec_positions": ("oi", "positions", lambda w, b, x: tf.linalg.matvec(w, x) + b,
                         lambda w, b, x: tf.matmul(x, w, transpose_b=True) + b),
    "matmul_left": ("oi", "channels", lambda w, b, x: tf.matmul(w, x) + b[:, None],
                    lambda w, b, x: tf.matmul(T(x), w, transpose_b=True) + b),
    "matmul_left_transpose_a": (
        "io", "channels", lambda w, b, x: tf.matmul(w, x, transpose_a=True) + b[:, None],
        lambda w, b, x: tf.matmul(T(x), w) + b),
    "einsum_left": ("oi", "channels",
                    lambda w, b, x: tf.einsum("oi,bin->bon", w, x) + b[:, None],
                    lambda w, b, x: tf.matmul(T(x), w, transpose_b=True) + b),
    "reshaped": ("flat", "2d", lambda w, b, x: tf.matmul(x, tf.reshape(w, [DI, DO])) + b,
                 lambda w, b, x: tf.matmul(x, w) + b),
    "reshaped_positions": ("flat", "positions",
                           lambda w, b, x: tf.matmul(x, tf.reshape(w, [DI, DO])) + b,
                           lambda w, b, x: tf.matmul(x, w) + b),
}
SHAPES = {"oi": (DO, DI), "io": (DI, DO), "flat": (DI * DO,)}


def branches(names, twin=False, seed=0):
    """``(loss, logits, params)``: the sum of one branch per form,
    ``tanh(pool(form(w, b, x))) @ head``, each reading x [B, N, DI] its way;
    ``params[name] = [w, b]``. The twin applies each kernel as ``x @ W^T``
    (``x @ K``, ``K`` the flat kernel reshaped to ``[DI, DO]``), same values."""
    rng = np.random.default_rng(seed)
    params, heads = {}, {}
    for name in names:
        layout = FORMS[name][0]
        kernel = rng.normal(size=SHAPES[layout]) / 2
        if twin and layout == "flat":
            kernel = kernel.reshape(DI, DO)
        params[name] = [tf.Variable(kernel, name=f"{name}_w"),
                        tf.Variable(rng.normal(size=DO) / 2, name=f"{name}_b")]
        heads[name] = tf.Variable(rng.normal(size=(DO, K)), name=f"{name}_head")

    def logits(x):
        out = []
        for name in names:
            _, layout, form, other = FORMS[name]
            w, b = params[name]
            h = (other if twin else form)(w, b, READ[layout](x))
            pool = POOL["positions" if twin and layout == "channels" else layout]
            out.append(tf.tanh(pool(h)) @ heads[name])
        return tf.add_n(out)

    def loss(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits(x)))

    return loss, logits, params


def data(batch=B, positions=N, seed=1):
    rng = np.random.default_rng(seed)
    return (tf.constant(rng.normal(size=(batch, positions, DI))),
            tf.constant(rng.integers(0, K, batch), tf.int32))


@pytest.mark.parametrize("name", sorted(FORMS))
def test_registers_as_dense_and_equals_the_loop(name):
    loss, _, _ = branches([name])
    fn = kg.auto_register(loss)
    args = data()
    reg = fn.registration(*args)
    assert [layer.kind for layer in reg.layers] == ["dense", "dense"], reg.summary()
    assert [v.name for v in reg.layers[0].variables] == [f"{name}_w:0", f"{name}_b:0"]
    want = one_example_loop(loss, args, reg.variables)
    for v, got, w in zip(reg.variables, kg.per_example_gradients(fn, *args), want):
        np.testing.assert_allclose(got, w, rtol=1e-9, atol=1e-12, err_msg=v.name)


def _blocks(loss, params, args):
    """Each form's layer's block of an exact-mode estimator updated once on ``args``."""
    est = kg.FisherEstimator(kg.auto_register(loss), estimation_mode="exact",
                             cov_ema_decay=0.0, damping=1e-2)
    est.update(*args)
    est.update_inverses()
    first = [layer.variables[0].name for layer in est.layers]
    return {name: est.blocks[first.index(w.name)] for name, (w, _) in params.items()}


def test_exact_blocks_equal_brute_force_and_the_twins():
    """On one example at one position K-FAC is exact (each layer's block is
    the brute-force Fisher's diagonal block); on a batch with positions each
    block equals its twin's (the vectors laid out as the variables)."""
    loss, logits, params = branches(sorted(FORMS))
    one = data(batch=1, positions=1)
    for name, block in _blocks(loss, params, one).items():
        want = brute_fisher(lambda p, x: logits(x), params[name], one[0], softmax_fisher)
        np.testing.assert_allclose(block.full_matrix(), want, rtol=1e-9, atol=1e-12,
                                   err_msg=name)
    got = _blocks(loss, params, data())
    twin_loss, _, twin_params = branches(sorted(FORMS), twin=True)
    twins = _blocks(twin_loss, twin_params, data())
    rng = np.random.default_rng(2)
    for name, block in got.items():
        np.testing.assert_allclose(block.full_matrix(), twins[name].full_matrix(), rtol=1e-9,
                                   atol=1e-12, err_msg=name)
        vs = [tf.constant(rng.normal(size=p.shape)) for p in params[name]]
        twin_vs = [tf.reshape(vs[0], twins[name].var_shapes[0]), vs[1]]
        for a, b in zip(block.multiply_inverse(vs), twins[name].multiply_inverse(twin_vs)):
            np.testing.assert_allclose(np.ravel(a), np.ravel(b), rtol=1e-9, err_msg=name)


@pytest.mark.parametrize("name", ["matvec", "matmul_left_transpose_a", "reshaped_positions"])
def test_default_kfac_steps_equal_the_twins(name):
    """One form of each family, alone (the blocks refresh their inverses in
    turns, by layer order, which a model of several forms and its twin need
    not share); the others' blocks equal their twins' above."""
    args = data()
    losses = []
    for twin in (False, True):
        opt = kg.KFAC(kg.auto_register(branches([name], twin=twin)[0]))
        losses.append([float(opt.step(*args)) for _ in range(3)])
        assert int(opt.skipped_steps.numpy()) == 0
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-9)
    assert losses[0][-1] < losses[0][0], losses


@pytest.mark.parametrize("equation,x_first", [("oi,bin->bon", False), ("abc,bd->adc", True)])
def test_a_bias_along_the_positions_is_not_the_layers(equation, x_first):
    """A bias added along the positions' axis of a permuted 2-D Einsum, as
    wide as the outputs (before: taken for the layer's bias, its per-example
    gradient summed over the wrong axis), is a shift of its own."""
    rng = np.random.default_rng(4)
    w = tf.Variable(rng.normal(size=(DI, DO) if x_first else (DO, DI)) / 2, name="w")
    b = tf.Variable(rng.normal(size=DO), name="b")
    head = tf.Variable(rng.normal(size=(DO, K)), name="head")

    def loss(x, y):
        h = tf.einsum(equation, x, w) if x_first else tf.einsum(equation, w, x)
        logits = tf.reduce_mean(tf.tanh(h + b), 2) @ head
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    fn = kg.auto_register(loss)
    args = (tf.constant(rng.normal(size=(B, DI, DO))), data()[1])
    reg = fn.registration(*args)
    assert [(layer.kind, len(layer.variables)) for layer in reg.layers] == [
        ("dense", 1), ("scale_and_shift", 1), ("dense", 1)], reg.summary()
    want = one_example_loop(loss, args, reg.variables)
    for v, got, w in zip(reg.variables, kg.per_example_gradients(fn, *args), want):
        np.testing.assert_allclose(got, w, rtol=1e-9, atol=1e-12, err_msg=v.name)


# -- all three in one model, its sizes unknown -----------------------------------------

SIGNATURE = [tf.TensorSpec([None, None, DI], tf.float64), tf.TensorSpec([None], tf.int32)]


class Composite(tf.Module):
    """``matvec`` at every position, ``tf.matmul(W, h^T)`` with a channels
    bias, and a flat kernel reshaped for the head."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(5)
        self.w1 = tf.Variable(rng.normal(size=(DO, DI)) / 2, name="w1")
        self.b1 = tf.Variable(rng.normal(size=DO) / 2, name="b1")
        self.w2 = tf.Variable(rng.normal(size=(DO, DO)) / 2, name="w2")
        self.b2 = tf.Variable(rng.normal(size=DO) / 2, name="b2")
        self.w3 = tf.Variable(rng.normal(size=DO * K) / 2, name="w3")

    @tf.function(input_signature=SIGNATURE)
    def loss(self, x, y):
        h = tf.tanh(tf.linalg.matvec(self.w1, x) + self.b1)  # [B, T, DO]
        h = tf.tanh(tf.matmul(self.w2, T(h)) + self.b2[:, None])  # [B, DO, T]
        logits = tf.matmul(tf.reduce_mean(h, 2), tf.reshape(self.w3, [DO, K]))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))


def _composite_args(batch, positions, seed):
    rng = np.random.default_rng(seed)
    return (tf.constant(rng.normal(size=(batch, positions, DI))),
            tf.constant(rng.integers(0, K, batch), tf.int32))


def test_unknown_sizes_register_and_equal_the_loop():
    module = Composite()
    fn = kg.auto_register(module.loss)
    per_example = tf.function(lambda *a: kg.per_example_gradients(fn, *a),
                              input_signature=SIGNATURE)
    for seed, (batch, positions) in enumerate(((3, 2), (2, 5))):
        args = _composite_args(batch, positions, seed)
        reg = fn.registration(*args)
        assert [(layer.kind, [v.name for v in layer.variables]) for layer in reg.layers] == [
            ("dense", ["w1:0", "b1:0"]), ("dense", ["w2:0", "b2:0"]), ("dense", ["w3:0"])]
        want = one_example_loop(module.loss, args, reg.variables)
        for v, got, w in zip(reg.variables, per_example(*args), want):
            np.testing.assert_allclose(got, w, rtol=1e-9, atol=1e-12, err_msg=v.name)


RUNNER = NO_LIBRARY + textwrap.dedent("""
    import numpy as np
    import tensorflow as tf
    here = sys.argv[1]
    data = np.load(os.path.join(here, "data.npz"))
    model = tf.saved_model.load(os.path.join(here, "out"))
    out = {f"pxg{i}": g.numpy() for i, g in enumerate(
        model.per_example_gradients(data["x"], data["y"]))}
    out["losses"] = np.array([model.kfac_step(data["x"], data["y"]).numpy() for _ in range(3)])
    assert not any(m.split(".")[0] == "kfac_graph" for m in sys.modules)
    np.savez(os.path.join(here, "result.npz"), **out)
""")


@pytest.mark.slow  # (a fresh interpreter: its fast sibling is the in-process run above)
def test_kfac_rewrite_trains_it_without_the_library(tmp_path):
    """``kfac-rewrite``'s model (traced with the sizes unknown) in a process
    that cannot import the library: per-example gradients equal one-example
    tapes, and its K-FAC steps train."""
    from tools import kfac_rewrite
    tf.saved_model.save(Composite(), str(tmp_path / "input"))
    assert kfac_rewrite.main(["kfac-rewrite", "--input", str(tmp_path / "input"),
                              "--function", "loss", "--output", str(tmp_path / "out")]) == 0
    x, y = _composite_args(3, 4, 7)
    np.savez(tmp_path / "data.npz", x=x.numpy(), y=y.numpy())
    (tmp_path / "runner.py").write_text(RUNNER)
    done = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.load(tmp_path / "result.npz")
    module = Composite()
    want = one_example_loop(module.loss, (x, y),
                            kg.auto_register(module.loss).registration(x, y).variables)
    for i, w in enumerate(want):
        np.testing.assert_allclose(got[f"pxg{i}"], w, rtol=1e-9, atol=1e-12)
    assert np.all(np.isfinite(got["losses"])) and got["losses"][-1] < got["losses"][0], got[
        "losses"]
