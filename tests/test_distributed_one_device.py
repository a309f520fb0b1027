"""Per-example gradients and DP-SGD on a model a ``tf.distribute`` strategy
mirrors: they run on one device, also inside ``strategy.scope()`` (where a
mirrored variable has no handle: before, they stopped there with
TensorFlow's "DistributedVariable.handle is not available"), and an update
assigns every copy; ``kg.DPModel`` made outside the model's scope refuses
it in one line. A Keras loss object, which divides
itself by the replicas when traced under a strategy, is traced as one
device sees it (``passes.frontends.one_device``): its per-example gradients
inside the scope, and ``kg.KFAC``'s steps on 2 replicas (a Huber loss, kind
ggn; a mean of weighted tokens over batches of new lengths and sizes in
the relaxed step, whose ``1/T`` each replica reads at run time), equal one
device's traced per shape. In a fresh process with 2 logical
CPUs."""
import script_json

SCRIPT = r"""
import json, numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
import kfac_graph as kg
rng = np.random.default_rng(0)
x = tf.constant(rng.normal(size=(8, 5))); y = tf.constant(rng.integers(0, 3, 8))
def make():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((5,), dtype="float64"),
                             keras.layers.Dense(4, activation="tanh", dtype="float64"),
                             keras.layers.Dense(3, dtype="float64")])
def loss_of(model):
    return kg.auto_register(lambda a, b: tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(b, model(a))))
plain = make()
want = [g.numpy() for g in kg.per_example_gradients(loss_of(plain), x, y)]
kg.DPSGD(loss_of(plain), learning_rate=0.5, l2_norm_clip=1e6, noise_multiplier=0.0).step(x, y)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    mirrored = make()
    fn = loss_of(mirrored)
    got = [g.numpy() for g in kg.per_example_gradients(fn, x, y)]
    kg.DPSGD(fn, learning_rate=0.5, l2_norm_clip=1e6, noise_multiplier=0.0).step(x, y)
try:  # (kg.DPModel made under the same scope trains on the replicas: test_distributed_keras)
    kg.DPModel(mirrored, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True)).compile(optimizer="sgd")
    refusal = ""
except ValueError as e:
    refusal = str(e)
# a Keras loss object divides itself by the replicas when traced under a strategy
keras_loss = lambda model: kg.auto_register(lambda a, b: keras.losses.SparseCategoricalCrossentropy(
    from_logits=True)(b, model(a)))
want_keras = [g.numpy() for g in kg.per_example_gradients(keras_loss(plain), x, y)]
with strategy.scope():
    got_keras = [g.numpy() for g in kg.per_example_gradients(keras_loss(mirrored), x, y)]
t = tf.constant(rng.normal(size=(8, 3)))
config = dict(estimation_mode="exact", momentum_type="regular", damping=1e-2)
def kfac_huber(model):
    opt = kg.KFAC(kg.auto_register(lambda a, b: keras.losses.Huber()(b, model(a))), **config)
    for _ in range(3):
        opt.step(x, t)
    return [v.numpy() for v in model.trainable_variables]
single = kfac_huber(make())
with strategy.scope():
    replicated_model = make()
replicated = kfac_huber(replicated_model)
# a mean of weighted tokens over batches of new lengths and sizes, in the relaxed
# replicated step (one more trace, with the sizes that changed unknown): 1/T read at
# run time as a factor of the curvature's scale (LossSpec.size_scaled), each replica's
# alike, the tokens keeping their data's weights; against one device traced per shape
batches = [tf.constant(rng.integers(0, 7, s), tf.int32) for s in [(8, 5), (8, 7), (6, 5)]]
def tokens():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((None,), dtype="int32"),
                             keras.layers.Embedding(7, 4, dtype="float64"),
                             keras.layers.Dense(7, dtype="float64")])
def kfac_tokens(model, relax=True):
    fn = kg.auto_register(lambda a, b: tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(b, model(a))
        * tf.cast(b > 1, tf.float64)))
    opt = kg.KFAC(fn, relax_shapes=relax, **config)
    for ids in batches:
        opt.step(ids, ids)
    return [v.numpy() for v in model.trainable_variables], opt
single_tokens = kfac_tokens(tokens(), relax=False)[0]
with strategy.scope():
    relaxed_tokens, relaxed_opt = kfac_tokens(tokens())
relaxed_traces = relaxed_opt._compiled.step.experimental_get_tracing_count()
print(json.dumps({
    "kfac_tokens": max(float(np.abs(a - b).max())
                       for a, b in zip(single_tokens, relaxed_tokens)),
    "relaxed_traces": relaxed_traces,
    "keras_per_example": max(float(np.abs(g - w).max()) for g, w in zip(got_keras, want_keras)),
    "kfac_keras_loss": max(float(np.abs(a - b).max()) for a, b in zip(single, replicated)),
    "per_example": max(float(np.abs(g - w).max()) for g, w in zip(got, want)),
    "copies": [max(float(np.abs(c.numpy() - p.numpy()).max()) for c in m.value.values)
               for m, p in zip(mirrored.trainable_variables, plain.trainable_variables)],
    "refusal": refusal}))
"""


def test_mirrored_model_on_one_device():
    out = script_json.run(SCRIPT, timeout=240)
    assert out["per_example"] < 1e-12
    # a Keras loss traced as one device: before, half the per-example gradients under
    # 2 replicas, and K-FAC's steps on half the loss
    assert out["keras_per_example"] < 1e-12
    assert out["kfac_keras_loss"] < 1e-10
    # (before, a replicated step at a new length kept the first length's 1/T)
    assert out["kfac_tokens"] < 1e-10
    assert out["relaxed_traces"] == 3  # (8, 5); (8, None); (None, None)
    assert len(out["copies"]) == 4 and max(out["copies"]) < 1e-12
    assert out["refusal"].startswith("kg.DPModel: its model is under a tf.distribute strategy")
    assert "\n" not in out["refusal"]
