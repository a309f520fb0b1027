"""The SavedModel and GraphDef front ends register the zoo as the trace front
end does: the same kinds, uses, variable names and shapes, and loss.

Each case is saved as a tf.Module holding the model's variables and the loss
as a tf.function with an input signature (the example arguments' shapes).
``test_saved_model_fast_subset`` (the cases marked ``fast_saved``) runs in
the fast set; the rest of the zoo (about 20 s on 2 CPU cores) with ``-m slow``:
the same cases run through the trace front end in the fast set
(``test_registration_zoo.py``)."""
import math

import pytest
import tensorflow as tf

import kfac_graph as kg
import zoo

FAST = [c.name for c in zoo.CASES if c.fast_saved]
SLOW = [c.name for c in zoo.CASES if not c.fast_saved]


def save(built, path) -> str:
    module = tf.Module()
    module.tracked = built.track
    signature = [tf.TensorSpec.from_tensor(a) for a in built.args]
    module.loss = tf.function(built.loss_fn, input_signature=signature)
    tf.saved_model.save(module, str(path))
    return str(path)


def expected_rows(built):
    return [(e.kind, tuple((zoo.variable_name(v), tuple(zoo.tf_variable(v).shape.as_list()))
                           for v in e.resolved()), e.uses) for e in built.layers]


def rows(reg):
    out = []
    for layer in reg.layers:
        variables = tuple((v.name.split(":")[0], tuple(v.shape.as_list() if hasattr(v.shape, "as_list")
                                                       else v.shape)) for v in layer.variables)
        out.append((layer.kind, variables, layer.uses))
    return out


def check_saved(name, tmp_path):
    built = next(c for c in zoo.CASES if c.name == name).build()
    path = save(built, tmp_path / name)
    reg = kg.register_saved_model(path, "loss", *built.args)
    got, want = rows(reg), expected_rows(built)
    message = f"\n got      {got}\n expected {want}"
    assert [r[:2] for r in got] == [r[:2] for r in want], message
    assert all(e.accepts_uses(r[2]) for r, e in zip(got, built.layers)), message
    assert (reg.loss.kind, reg.loss.reduction) == (built.loss, built.reduction)
    assert math.isclose(reg.loss.scale, built.scale, rel_tol=1e-5)
    # Without example arguments: the function has one trace.
    again = kg.register_saved_model(path, "loss")
    assert rows(again) == rows(reg)
    assert "digraph" in reg.to_dot()
    return reg


@pytest.mark.parametrize("name", FAST)
def test_saved_model_fast_subset(name, tmp_path):
    check_saved(name, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_saved_model_zoo(name, tmp_path):
    check_saved(name, tmp_path)


def test_saved_model_variables_are_the_loaded_ones(tmp_path):
    built = zoo.raw_mlp_sum_over_batch()
    path = save(built, tmp_path / "m")
    reg = kg.register_saved_model(path, "loss")
    assert all(isinstance(v, tf.Variable) for v in reg.variables)
    assert not any(zoo.same_variable(v, w) for v in reg.variables for w in built.track)
    assert [v.name for v in reg.variables] == [v.name for v in built.track]


def _graph_mode_graph_def(batch=4):
    """A TF1-style graph (VarHandleOp variables) computing a sparse CE loss of
    a two-layer MLP; returns (graph_def, loss tensor name, argument names)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [batch, 4], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [batch], name="y")
        w1 = tf.Variable(tf.zeros([4, 5]), name="w1")
        b1 = tf.Variable(tf.zeros([5]), name="b1")
        w2 = tf.Variable(tf.zeros([5, 3]), name="w2")
        h = tf.nn.relu(tf.matmul(x, w1) + b1)
        loss = tf.reduce_mean(zoo.sparse_ce(y, tf.matmul(h, w2)))
    return graph.as_graph_def(), loss.name, ("x", "y")


EXPECTED_GRAPH_DEF = [("dense", (("w1", (4, 5)), ("b1", (5,))), 1), ("dense", (("w2", (5, 3)),), 1)]


@pytest.mark.parametrize("binary", [True, False])
def test_graph_def_file(tmp_path, binary):
    graph_def, loss, arguments = _graph_mode_graph_def()
    path = tmp_path / ("g.pb" if binary else "g.pbtxt")
    tf.io.write_graph(graph_def, str(tmp_path), path.name, as_text=not binary)
    reg = kg.register_graph_def(str(path), loss, arguments)
    assert rows(reg) == EXPECTED_GRAPH_DEF
    assert all(isinstance(v, kg.GraphVariable) for v in reg.variables)
    assert (reg.loss.kind, reg.loss.reduction) == ("categorical", "mean")
    # The proto itself works too.
    assert rows(kg.register_graph_def(graph_def, loss, arguments)) == EXPECTED_GRAPH_DEF


def test_graph_def_arguments_default_to_placeholders(tmp_path):
    """Called as ``register_graph_def(path, output)``: the graph's
    placeholders are its arguments."""
    graph_def, loss, _ = _graph_mode_graph_def()
    path = tmp_path / "g.pb"
    tf.io.write_graph(graph_def, str(tmp_path), path.name, as_text=False)
    reg = kg.register_graph_def(str(path), loss)
    assert rows(reg) == EXPECTED_GRAPH_DEF
    assert (reg.loss.kind, reg.loss.reduction) == ("categorical", "mean")


def test_graph_def_of_a_concrete_function(tmp_path):
    """The GraphDef of a traced tf.function (variables are captured resource
    placeholders) written to a file."""
    built = zoo.raw_mlp_sum_over_batch()
    concrete = tf.function(built.loss_fn).get_concrete_function(*built.args)
    path = tmp_path / "fn.pb"
    tf.io.write_graph(concrete.graph.as_graph_def(add_shapes=True), str(tmp_path), path.name,
                      as_text=False)
    arguments = tuple(t.op.name for t in concrete.inputs[:len(built.args)])
    reg = kg.register_graph_def(str(path), concrete.outputs[0].name, arguments)
    assert [(layer.kind, layer.uses) for layer in reg.layers] == [("dense", 1), ("dense", 1)]
    assert [tuple(v.shape) for v in reg.variables] == [(4, 5), (5,), (5, 3), (3,)]
    assert (reg.loss.kind, reg.loss.reduction) == ("categorical", "mean")
