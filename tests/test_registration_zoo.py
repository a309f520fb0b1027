"""Registration of the zoo (tests/zoo.py) through ``kg.auto_register``: every
layer's kind, variables (by identity, in order) and uses, the loss, and the
Registration's own API (variables, summary, caching, to_dot)."""
import functools
import math

import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
import zoo

CASES = list(zoo.CASES)
IDS = [c.name for c in CASES]


@functools.lru_cache(maxsize=None)
def _registered(name):
    """(built, wrapped fn, registration) for one zoo case, built once per module."""
    case = next(c for c in CASES if c.name == name)
    built = case.build()
    fn = kg.auto_register(built.loss_fn)
    return built, fn, fn.registration(*built.args)


def describe(reg) -> str:
    rows = [f"{layer.kind}[{', '.join(zoo.variable_name(v) for v in layer.variables)}]"
            f" x{layer.uses}" for layer in reg.layers]
    return "; ".join(rows) + f" | loss {reg.loss.kind} {reg.loss.reduction} {reg.loss.scale:g}"


def describe_expected(built) -> str:
    rows = [f"{e.kind}[{', '.join(zoo.variable_name(v) for v in e.resolved())}] x{e.uses}"
            for e in built.layers]
    return "; ".join(rows) + f" | loss {built.loss} {built.reduction} {built.scale:g}"


def assert_layers_match(reg, built):
    message = f"\n got      {describe(reg)}\n expected {describe_expected(built)}"
    assert len(reg.layers) == len(built.layers), message
    for layer, expected in zip(reg.layers, built.layers):
        want = expected.resolved()
        assert layer.kind == expected.kind, message
        assert len(layer.variables) == len(want), message
        assert all(zoo.same_variable(a, b) for a, b in zip(layer.variables, want)), message
        assert expected.accepts_uses(layer.uses), message


def assert_loss_matches(reg, built):
    message = f"\n got      {describe(reg)}\n expected {describe_expected(built)}"
    assert reg.loss.kind == built.loss, message
    assert reg.loss.reduction == built.reduction, message
    assert math.isclose(reg.loss.scale, built.scale, rel_tol=1e-5), message
    if built.output_is_last_layer and reg.layers[-1].outputs:  # (a generic layer has none)
        assert reg.loss.output == reg.layers[-1].outputs[-1], (reg.loss.output, reg.layers[-1])
    if built.targets_arg is not None:
        assert reg.loss.targets == f"{reg.arguments[built.targets_arg]}:0", reg.loss.targets


def test_zoo_is_big_enough():
    assert len(CASES) >= 22
    assert len(set(IDS)) == len(IDS)


@pytest.mark.parametrize("name", IDS)
def test_layers(name):
    built, _, reg = _registered(name)
    assert_layers_match(reg, built)


@pytest.mark.parametrize("name", IDS)
def test_loss(name):
    built, _, reg = _registered(name)
    assert_loss_matches(reg, built)
    # no model of the zoo makes an example's loss read other examples, but
    # batch normalisation in training mode (passes/coupling.py)
    assert bool(reg.coupling) == (name == "batchnorm_training"), reg.coupling


@pytest.mark.parametrize("name", IDS)
def test_registration_api(name, tmp_path):
    built, fn, reg = _registered(name)
    # Registration.variables: every layer's variables, in layer order; the
    # same variables as expected (their order is test_layers' business).
    assert reg.variables == tuple(v for layer in reg.layers for v in layer.variables)
    want = [v for e in built.layers for v in e.resolved()]
    assert len(reg.variables) == len(want)
    assert all(any(zoo.same_variable(a, b) for b in want) for a in reg.variables)
    # Layer names are unique, and the summary mentions each.
    names = [layer.name for layer in reg.layers]
    assert len(set(names)) == len(names)
    summary = reg.summary()
    for layer in reg.layers:
        assert layer.name in summary
        assert layer.kind in summary
    assert reg.loss.kind in summary
    for layer in reg.layers:
        assert (layer.kind == "generic") == bool(layer.reason), (layer.name, layer.reason)
    # to_dot writes a Graphviz file.
    path = tmp_path / "graph.dot"
    text = reg.to_dot(str(path))
    assert path.read_text().startswith("digraph") and "digraph" in text
    assert "->" in text


@pytest.mark.parametrize("name", IDS)
def test_call_and_cache(name):
    built, fn, reg = _registered(name)
    args = built.args
    # Calling the wrapped function still returns the loss.
    got = fn(*args)
    want = built.loss_fn(*args)
    assert got.shape == ()
    rtol = 1e-3 if name == "mixed_float16" else 1e-5
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol)
    # Cached per input signature.
    assert fn.registration(*args) is reg
    assert fn.registration(*built.make_args(zoo.B)) is reg
    other = fn.registration(*built.make_args(zoo.B + 1))
    assert other is not reg
    assert [layer.kind for layer in other.layers] == [layer.kind for layer in reg.layers]
    assert fn.registration(*built.make_args(zoo.B + 1)) is other


def test_decorator_forms():
    built = zoo.raw_mlp_sum_over_batch()
    plain = kg.auto_register(built.loss_fn)
    named = kg.auto_register(loss="categorical")(built.loss_fn)
    assert isinstance(plain, kg.RegisteredFunction) and isinstance(named, kg.RegisteredFunction)
    assert plain.__name__ == "loss_fn"
    assert named.registration(*built.args).loss.kind == "categorical"
    forced = kg.auto_register(loss="normal")(built.loss_fn).registration(*built.args)
    assert forced.loss.kind == "normal"
    assert_layers_match(forced, built)


def test_keras_variable_is_the_tf_variable_behind_it():
    built, _, reg = _registered("seq_mlp")
    kernel = built.layers[0].resolved()[0]
    assert reg.layers[0].variables[0] is kernel.value
    assert isinstance(reg.layers[0].variables[0], tf.Variable)


def test_mixed_precision_policy_restored():
    import keras
    _registered("mixed_float16")
    assert keras.mixed_precision.global_policy().name == "float32"
