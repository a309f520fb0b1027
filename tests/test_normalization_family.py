"""The normalisation family as scale-and-shift layers, on any rank and axis set.

Each form (Keras batch, layer, group, RMS and unit normalisation with their
axes and scale/center flags, and hand-written ``x * gamma + beta`` with gamma
over any set of axes) sits in a small float64 Keras model: Dense, Conv1D or
Conv2D (6 channels), the norm, Flatten, Dense. Shown for each:

- the norm registers as ``scale_and_shift`` with its variables (nothing is
  generic; UnitNormalization, which has none, registers nothing);
- its per-example gradients equal a loop of one-example gradients at rtol
  1e-6 (inference mode for batch norm; the other norms do not couple
  examples, so training mode too);
- ``kg.verify`` passes, with the exact-Fisher check of each full block
  wherever no layer couples the examples, and the diagonal block is the full
  block's diagonal;
- two ``kg.KFAC`` steps (from damping 1) lower the loss with no skipped step.

The fast set runs the forms chained in three models (one with the Fisher
check, one with the K-FAC steps) and two drawn forms; ``-m slow`` runs every
form alone at every rank in both modes, and 40 drawn forms.
"""
import itertools
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import kfac_graph as kg
from per_example_reference import assert_close, one_example_loop

pytestmark = pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")

L = keras.layers
F64 = "float64"
CHANNELS = 6  # the norm's input: [B, 6], [B, 3, 6] or [B, 3, 3, 6]


class Affine(L.Layer):
    """Hand-written ``x * gamma + beta``; gamma and beta vary along ``axis``
    (numpy broadcasting: shaped from the first of those axes to the last
    axis, 1 elsewhere)."""

    def __init__(self, axis, scale=True, center=True, **kwargs):
        super().__init__(**kwargs)
        self.axis, self.scale, self.center = tuple(axis), scale, center

    def build(self, input_shape):
        rank = len(input_shape)
        axes = sorted(a % rank for a in self.axis)
        shape = [input_shape[a] if a in axes else 1 for a in range(axes[0], rank)]
        if self.scale:
            self.gamma = self.add_weight(shape=shape, initializer="ones")
        if self.center:
            self.beta = self.add_weight(shape=shape, initializer="zeros")

    def call(self, x):
        y = x * self.gamma if self.scale else x
        return y + self.beta if self.center else y


def make_norm(kind, axis=-1, scale=True, center=True, groups=1):
    """The norm layer ``kind`` with the given options, in float64."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # rms_scaling's deprecation
        if kind == "batch":
            return L.BatchNormalization(axis=axis, scale=scale, center=center, dtype=F64)
        if kind in ("layer", "layer_rms"):
            return L.LayerNormalization(axis=axis, scale=scale, center=center,
                                        rms_scaling=kind == "layer_rms", dtype=F64)
        if kind == "group":
            return L.GroupNormalization(groups=groups, axis=axis, scale=scale, center=center,
                                        dtype=F64)
        if kind == "rms":
            return L.RMSNormalization(axis=axis, dtype=F64)
        if kind == "unit":
            return L.UnitNormalization(axis=axis, dtype=F64)
        return Affine(axis if isinstance(axis, (list, tuple)) else [axis], scale, center,
                      dtype=F64)


# name -> (make_norm options, ranks)
FORMS = {
    "batch": (dict(kind="batch"), (2, 3, 4)),
    "batch_no_scale": (dict(kind="batch", scale=False), (2, 3, 4)),
    "batch_no_center": (dict(kind="batch", center=False), (2, 3, 4)),
    "batch_axis1": (dict(kind="batch", axis=1), (2, 3, 4)),
    "layer": (dict(kind="layer"), (2, 3, 4)),
    "layer_last_two": (dict(kind="layer", axis=[-2, -1]), (3, 4)),
    "layer_axis1": (dict(kind="layer", axis=1), (2, 3, 4)),
    "layer_axes_1_3": (dict(kind="layer", axis=[1, 3]), (4,)),
    "layer_no_center": (dict(kind="layer", center=False), (2, 3, 4)),
    "layer_no_scale": (dict(kind="layer", scale=False), (2, 3, 4)),
    "layer_rms": (dict(kind="layer_rms"), (2, 3, 4)),
    "rms": (dict(kind="rms"), (2, 3, 4)),
    "rms_last_two": (dict(kind="rms", axis=[-2, -1]), (3, 4)),
    "group": (dict(kind="group", groups=2), (2, 3, 4)),
    "group_one": (dict(kind="group", groups=1), (2, 3, 4)),
    "group_per_channel": (dict(kind="group", groups=CHANNELS), (2, 3, 4)),
    "group_axis1": (dict(kind="group", groups=3, axis=1), (3, 4)),
    "unit": (dict(kind="unit"), (2, 3, 4)),
    "affine_last_two": (dict(kind="affine", axis=[-2, -1]), (3, 4)),
    "affine_axis1": (dict(kind="affine", axis=[1]), (2, 3, 4)),
    "affine_axes_1_3": (dict(kind="affine", axis=[1, 3]), (4,)),
    "affine_all": (dict(kind="affine", axis=[1, 2, 3]), (4,)),
    "affine_scale_only": (dict(kind="affine", axis=[-1], center=False), (2, 3, 4)),
}


def _body(rank):
    if rank == 2:
        return keras.Input((5,), dtype=F64), L.Dense(CHANNELS, dtype=F64)
    if rank == 3:
        return keras.Input((4, 3), dtype=F64), L.Conv1D(CHANNELS, 2, dtype=F64)
    return keras.Input((4, 4, 2), dtype=F64), L.Conv2D(CHANNELS, 2, dtype=F64)


def _case(chain, rank, training, seed=0):
    """``chain``: make_norm options of the norms applied one after another."""
    keras.utils.set_random_seed(seed)
    inputs, body = _body(rank)
    norms = [make_norm(**options) for options in chain]
    hidden = body(inputs)
    for norm in norms:
        hidden = norm(hidden)
    model = keras.Model(inputs, L.Dense(3, dtype=F64)(L.Flatten(dtype=F64)(hidden)))
    rng = np.random.default_rng(seed)
    for v in [v for norm in norms for v in norm.weights]:  # away from 0 and 1
        v.assign(rng.uniform(0.5 if "variance" in v.path else -1.0, 1.5, v.shape))

    @kg.auto_register
    def loss_fn(x, y):
        logits = model(x, training=training)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    x = tf.random.stateless_normal([5, *inputs.shape[1:]], [seed, 1], dtype=tf.float64)
    return loss_fn, (x, tf.constant([0, 1, 2, 0, 1])), norms


def check_forms(chain, rank, training, fisher=True, diagonal=True, steps=2):
    """Everything the module docstring lists, for the norms of ``chain``:
    ``fisher``: kg.verify's exact-Fisher check; ``diagonal``: the diagonal
    blocks against it; ``steps``: how many K-FAC steps."""
    loss_fn, args, norms = _case(chain, rank, training)
    couples = training and any(options["kind"] == "batch" for options in chain)
    reg = loss_fn.registration(*args)
    kinds = [layer.kind for layer in reg.layers]
    weighted = [len(norm.trainable_weights) for norm in norms if norm.trainable_weights]
    assert kinds == ["dense" if rank == 2 else "conv2d", *["scale_and_shift"] * len(weighted),
                     "dense"], reg.summary()
    assert [len(layer.variables) for layer in reg.layers[1:-1]] == weighted, reg.summary()
    if not couples:
        got = kg.per_example_gradients(loss_fn, *args)
        want = one_example_loop(loss_fn, args, reg.variables)
        for v, a, b in zip(reg.variables, got, want):
            assert_close(a.numpy(), b.numpy(), 1e-6, f"{chain} rank {rank}: {v.name}")
    report = kg.verify(loss_fn, *args, estimation_mode="exact" if fisher else None)
    assert report.passed, report.table()
    if fisher and diagonal and weighted and not couples:
        _check_diagonal_blocks(loss_fn, args, len(weighted))
    if steps:
        _check_kfac(loss_fn, args, steps)


def _check_diagonal_blocks(loss_fn, args, n):
    """Each norm's diagonal block is the diagonal of its full block (which
    kg.verify checked against the brute-force Fisher)."""
    mats = []
    for alias in ("full", "diagonal"):
        est = kg.FisherEstimator(loss_fn, estimation_mode="exact",
                                 approximations={"scale_and_shift": alias})
        est.update(*args)
        mats.append([block.full_matrix().numpy() for block in est.blocks[1:1 + n]])
    for full, diagonal in zip(*mats):
        assert_close(np.diag(diagonal), np.diag(full), 1e-6)
        assert_close(diagonal, np.diag(np.diag(diagonal)), 1e-12)


def _check_kfac(loss_fn, args, steps):
    """A few steps from damping 1: from the default 0.1, before the damping
    adapts (every 5 steps), the second quadratic-model step overshoots on
    one form here (BatchNormalization(scale=False), rank 4: loss 4.08, 1.83,
    then 15.3; the same before these forms were supported)."""
    before = float(loss_fn(*args))
    opt = kg.KFAC(loss_fn, damping=1.0, jit_compile=False)
    for _ in range(steps):
        assert np.isfinite(float(opt.step(*args)))
    assert int(opt.skipped_steps) == 0
    assert float(loss_fn(*args)) < before


# -- the fast set: the forms chained in three models; each alone under -m slow ------

CHAINS = {  # name: (rank, training, forms, Fisher check, K-FAC steps)
    "r4-infer": (4, False, ["batch_axis1", "group", "layer_axes_1_3", "batch_no_center", "rms",
                            "affine_axis1"], True, 0),
    "r3-train": (3, True, ["group_axis1", "layer_last_two", "layer_rms", "unit",
                           "affine_last_two"], False, 0),
    "r2-train": (2, True, ["group_per_channel", "layer_no_scale", "affine_scale_only"], False, 2),
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_chained_forms(name):
    rank, training, forms, fisher, steps = CHAINS[name]
    check_forms([FORMS[f][0] for f in forms], rank, training, fisher=fisher, diagonal=False,
                steps=steps)


ALL = [(f, r, t) for f, (_, ranks) in FORMS.items() for r in ranks for t in (False, True)]


@pytest.mark.slow
@pytest.mark.parametrize("form,rank,training", ALL,
                         ids=[f"{f}-r{r}-{'train' if t else 'infer'}" for f, r, t in ALL])
def test_form(form, rank, training):
    check_forms([FORMS[form][0]], rank, training)


# -- drawn: (norm kind, rank, axis, scale/center flags, mode) ------------------------


def _axis_sets(rank):
    return [list(c) for n in range(1, rank) for c in itertools.combinations(range(1, rank), n)]


@st.composite
def drawn_form(draw):
    kind = draw(st.sampled_from(["batch", "layer", "layer_rms", "group", "rms", "affine"]))
    rank = draw(st.sampled_from([2, 3, 4]))
    sizes = {1: 3, 2: 3, 3: CHANNELS} if rank == 4 else {1: 3, 2: CHANNELS}
    sizes[rank - 1] = CHANNELS
    options = {"kind": kind}
    if kind == "batch":
        options["axis"] = draw(st.sampled_from(range(1, rank)))
    elif kind == "group":
        options["axis"] = draw(st.sampled_from(sorted({1, rank - 1})))
        size = sizes[options["axis"]]
        options["groups"] = draw(st.sampled_from([d for d in range(1, size + 1) if size % d == 0]))
    elif kind == "rms":  # Keras's scale broadcasts right-aligned: trailing axes only
        options["axis"] = draw(st.sampled_from([[-1]] + ([[-2, -1]] if rank > 2 else [])))
    else:
        options["axis"] = draw(st.sampled_from(_axis_sets(rank)))
    if kind not in ("rms", "layer_rms"):
        options["scale"], options["center"] = draw(st.sampled_from(
            [(True, True), (True, False), (False, True)]))
    return options, rank, draw(st.booleans())


_BOUNDED = dict(deadline=None, derandomize=True, database=None,
                phases=[Phase.explicit, Phase.generate],  # no shrinking: bounded time
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@settings(max_examples=2, **_BOUNDED)
@given(drawn_form())
def test_drawn_forms(case):
    """Registration, per-example gradients against the loop and kg.verify
    (no Fisher check, no K-FAC steps: the per-form tests do those)."""
    options, rank, training = case
    check_forms([options], rank, training, fisher=False, steps=0)


@pytest.mark.slow
@settings(max_examples=40, **_BOUNDED)
@given(drawn_form())
def test_drawn_forms_slow(case):
    options, rank, training = case
    check_forms([options], rank, training)


# -- what the pass records, and what it refuses --------------------------------------


@pytest.mark.parametrize("options,rank,layout", [
    (dict(kind="group", groups=2), 4, (1, 1, 1, 2, 3)),
    (dict(kind="group", groups=3, axis=1), 3, (1, 3, 1, 1)),
    (dict(kind="batch", axis=1), 4, (1, 3, 1, 1)),
    (dict(kind="layer", axis=[-2, -1]), 3, (3, CHANNELS)),
    (dict(kind="affine", axis=[1]), 3, (3, 1)),
], ids=["group-2", "group-axis1", "batch-axis1", "layer-last-two", "affine-axis1"])
def test_scale_layout_is_recorded(options, rank, layout):
    """The scale's layout where it meets xhat (a group norm's [C] scale read
    [.., G, C/G]), and the operands' shapes as the ops read them."""
    loss_fn, args, _ = _case([options], rank, training=False)
    layer = loss_fn.registration(*args).layers[1]
    attrs = layer.use_attrs[0]
    assert layer.kind == "scale_and_shift"
    assert tuple(attrs["scale_broadcast"])[-len(layout):] == layout
    assert len(attrs["operand_shapes"]) == len(layer.inputs[0])


def test_scale_varying_along_the_batch_is_no_scale_and_shift():
    """A weight with a batch axis scales each example differently: generic,
    with its per-example gradients still right."""
    w = tf.Variable(tf.random.stateless_normal([4, 3], [0, 1], dtype=tf.float64))
    v = tf.Variable(tf.random.stateless_normal([3, 2], [0, 2], dtype=tf.float64))

    @kg.auto_register
    def loss_fn(x, y):
        logits = tf.matmul(x * w, v)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    args = (tf.random.stateless_normal([4, 3], [0, 3], dtype=tf.float64),
            tf.constant([0, 1, 1, 0]))
    reg = loss_fn.registration(*args)
    assert [layer.kind for layer in reg.layers] == ["generic", "dense"], reg.summary()
    report = kg.verify(loss_fn, *args)
    assert report.passed, report.table()


@pytest.mark.parametrize("half", [0, 1])
def test_norm_of_one_output_of_a_split_reads_that_output(half):
    """The Keras gMLP example's spatial gating unit normalises the second
    half of a split (``u, v = split(x, 2)``; ``u * proj(norm(v))``). The
    norm's input is ``split:1``: it was recorded as ``split:0``, so its
    per-example gradients were silently those of the other half (verify's
    mean check failed by 0.9)."""
    keras.utils.set_random_seed(0)
    norm, head = L.LayerNormalization(dtype=F64), L.Dense(3, dtype=F64)

    @kg.auto_register
    def loss_fn(x, y):
        parts = tf.split(x, 2, axis=2)
        gated = parts[1 - half] * norm(parts[half])
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, head(tf.reduce_mean(gated, 1))))

    rng = np.random.default_rng(0)
    args = (tf.constant(rng.normal(size=(4, 5, 8))), tf.constant(rng.integers(0, 3, 4)))
    reg = loss_fn.registration(*args)
    assert reg.layers[0].inputs[0][0] == f"split:{half}"
    report = kg.verify(loss_fn, *args, estimation_mode="exact")
    assert report.passed, report.table()
