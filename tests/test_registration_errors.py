"""Bad input gives the documented error: the right ``KfacGraphError``
subclass, with a one-line message that names the thing at fault."""
import keras
import pytest
import tensorflow as tf

import kfac_graph as kg
import zoo


def one_line(error) -> str:
    text = str(error.value)
    assert text and "\n" not in text.strip(), text
    return text


def test_error_family():
    for cls in (kg.TraceError, kg.LoadError, kg.LossNotFoundError):
        assert issubclass(cls, kg.KfacGraphError)


def test_no_trainable_variables():
    frozen = tf.Variable(tf.ones([4, 3]), trainable=False, name="frozen")

    @kg.auto_register
    def no_weights(x, y):
        return tf.reduce_mean(zoo.sparse_ce(y, tf.matmul(x, frozen)))

    x, y = zoo.xy_sparse(4, 3)(4)
    with pytest.raises(kg.TraceError) as error:
        no_weights.registration(x, y)
    assert "no_weights" in one_line(error)
    assert "trainable" in str(error.value)


def test_non_scalar_result():
    w = tf.Variable(tf.ones([4, 3]), name="w")

    @kg.auto_register
    def per_example(x, y):
        return zoo.sparse_ce(y, tf.matmul(x, w))

    with pytest.raises(kg.TraceError) as error:
        per_example.registration(*zoo.xy_sparse(4, 3)(4))
    text = one_line(error)
    assert "per_example" in text and "scalar" in text


def test_two_results():
    w = tf.Variable(tf.ones([4, 3]), name="w")

    @kg.auto_register
    def two(x, y):
        logits = tf.matmul(x, w)
        return tf.reduce_mean(zoo.sparse_ce(y, logits)), tf.reduce_sum(logits)

    with pytest.raises(kg.TraceError) as error:
        two.registration(*zoo.xy_sparse(4, 3)(4))
    assert "two" in one_line(error)


def test_untraceable_function():
    w = tf.Variable(tf.ones([4, 3]), name="w")

    @kg.auto_register
    def wrong_shapes(x, y):
        return tf.reduce_mean(zoo.sparse_ce(y, tf.matmul(x, tf.transpose(w))))  # [4,4] x [3,4]

    with pytest.raises(kg.TraceError) as error:
        wrong_shapes.registration(*zoo.xy_sparse(4, 3)(4))
    text = one_line(error)
    assert "wrong_shapes" in text
    # The line says what went wrong, not just TensorFlow's "in user code:".
    assert "in user code" not in text, text


def test_untraceable_keras_layer():
    """A Keras layer's error ends with the arguments it received; the line
    is the error itself (Keras bolds it), not the last argument."""
    keras = pytest.importorskip("keras")

    class Mismatched(keras.layers.Layer):
        def call(self, x, training=None):
            return x * tf.ones([2], tf.float64)  # x is float32

    layer, w = Mismatched(), tf.Variable(tf.ones([4, 3]), name="w")

    @kg.auto_register
    def mixed(x, y):
        return tf.reduce_mean(zoo.sparse_ce(y, layer(tf.matmul(x, w))))

    with pytest.raises(kg.TraceError) as error:
        mixed.registration(*zoo.xy_sparse(4, 3)(4))
    text = one_line(error)
    assert "mixed" in text and "float" in text and "training" not in text, text
    assert "\x1b" not in text, text


def _saved_module(tmp_path):
    built = zoo.raw_mlp_sum_over_batch()
    module = tf.Module()
    module.tracked = built.track
    module.loss = tf.function(built.loss_fn,
                              input_signature=[tf.TensorSpec.from_tensor(a) for a in built.args])
    path = str(tmp_path / "saved")
    tf.saved_model.save(module, path)
    return path


def test_saved_model_without_the_function(tmp_path):
    path = _saved_module(tmp_path)
    with pytest.raises(kg.LoadError) as error:
        kg.register_saved_model(path, "train_step")
    text = one_line(error)
    assert "train_step" in text and "loss" in text  # names what is missing and what there is


def test_no_saved_model_directory(tmp_path):
    with pytest.raises(kg.LoadError) as error:
        kg.register_saved_model(str(tmp_path / "nowhere"), "loss")
    assert "nowhere" in one_line(error)


def test_graph_def_that_does_not_parse(tmp_path):
    path = tmp_path / "garbage.pb"
    path.write_bytes(b"\x00\xffthis is not a GraphDef\n{{{\x01\x02")
    with pytest.raises(kg.LoadError) as error:
        kg.register_graph_def(str(path), "loss:0")
    assert "garbage.pb" in one_line(error)


def test_graph_def_text_that_does_not_parse(tmp_path):
    path = tmp_path / "garbage.pbtxt"
    path.write_text('node { name: "x" op: \n')
    with pytest.raises(kg.LoadError) as error:
        kg.register_graph_def(str(path), "loss:0")
    assert "garbage.pbtxt" in one_line(error)


def test_graph_def_without_the_output(tmp_path):
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.placeholder(tf.float32, [2], name="x")
    with pytest.raises(kg.LoadError) as error:
        kg.register_graph_def(graph.as_graph_def(), "loss:0", ("x",))
    assert "loss:0" in one_line(error)


def _abs_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])

    def abs_loss(x):
        return tf.reduce_mean(tf.abs(model(x)))

    return model, abs_loss, (zoo.normal([4, 4], 1),)


def test_unreadable_loss_says_how_to_name_it():
    """A loss the pass reads down to per-example terms but no further is
    opaque; asking for its Fisher says, in one line, where the reading
    stopped and how to name the loss."""
    _, abs_loss, args = _abs_model()
    assert kg.auto_register(abs_loss).registration(*args).loss.kind == "opaque"
    with pytest.raises(kg.KfacGraphError) as error:
        kg.FisherEstimator(kg.auto_register(abs_loss)).update(*args)
    text = one_line(error)
    assert "Abs" in text  # the op it stopped at
    assert 'loss="' in text and "normal" in text  # how to name the loss


def test_unreadable_loss_named_explicitly():
    model, abs_loss, args = _abs_model()
    reg = kg.auto_register(loss="normal")(abs_loss).registration(*args)
    assert reg.loss.kind == "normal"
    assert [layer.kind for layer in reg.layers] == ["dense"]
    assert zoo.same_variable(reg.layers[0].variables[0], model.layers[0].kernel)


def test_unknown_loss_kind():
    _, abs_loss, args = _abs_model()
    with pytest.raises(kg.KfacGraphError) as error:
        kg.auto_register(loss="poisson")(abs_loss).registration(*args)
    text = one_line(error)
    assert "poisson" in text and "categorical" in text


def test_negated_loss():
    """A gain (a negated loss) has per-example terms but no Fisher."""
    w = tf.Variable(tf.ones([4, 3]), name="w")

    def gain(x, y):
        return -tf.reduce_mean(zoo.sparse_ce(y, tf.matmul(x, w)))

    fn, args = kg.auto_register(gain), zoo.xy_sparse(4, 3)(4)
    assert fn.registration(*args).loss.kind == "opaque"
    with pytest.raises(kg.KfacGraphError) as error:
        kg.FisherEstimator(fn).update(*args)
    assert "scaled by -1" in one_line(error) and 'loss="' in one_line(error)