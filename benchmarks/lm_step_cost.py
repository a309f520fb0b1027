"""The step cost of K-FAC settings on the language models, side by side.

For the LSTM (``recurrent_lm.py``'s model) or the transformer
(``transformer_lm.py``'s), every ``--kfac_row`` spec (``kfac_spec.py``) and an
Adam (LSTM) or AdamW (transformer) step compiled with XLA run on the same
batches, one step of each in turn, so that the machine's load falls on all
alike. Prints each one's median and mean step (the first ``--warm`` steps,
trace and compile, left out) and both over the first-order step's median.
The mean counts the periodic work (inverse refreshes, damping adaptation)
that a median skips. A row whose spec holds ``pullback=own`` traces its step
with the forms' backward pass of their own (``own_pullback.py``).

    python benchmarks/lm_step_cost.py --model transformer \\
        --kfac_row "label=defaults" --kfac_row "label=quarter qmodel_batch_fraction=0.25"
"""
import importlib
import time

import bench_env  # noqa: F401  (first: quiet logs, the repository importable)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import kfac_graph as kg  # noqa: E402
import kfac_spec  # noqa: E402
import lm_race  # noqa: E402
import own_pullback  # noqa: E402
from char_text import CharText  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "transformer", ["lstm", "transformer"], "which language model")
flags.DEFINE_integer("steps", 40, "timed steps of each run")
flags.DEFINE_integer("warm", 6, "untimed first steps of each run")
flags.DEFINE_multi_string("kfac_row", ["label=defaults"], "a K-FAC row (kfac_spec.py)")


def first_order_step(module, vocab):
    model = module.make_model(vocab)
    optimizer = (keras.optimizers.Adam(3e-3) if FLAGS.model == "lstm"
                 else keras.optimizers.AdamW(3e-3, weight_decay=0.01))
    return lm_race.keras_step(model, module.make_loss(model), optimizer, jit_compile=True)


def main(argv):
    del argv
    # imported here: the two define the same flags (their defaults: batch 32 x 64)
    module = importlib.import_module("recurrent_lm" if FLAGS.model == "lstm"
                                     else "transformer_lm")
    data = CharText(FLAGS.seq_len)
    batches = [tuple(tf.constant(t) for t in b)
               for b in data.batches(FLAGS.warm + FLAGS.steps, FLAGS.batch, FLAGS.seed)]
    name = "Adam" if FLAGS.model == "lstm" else "AdamW"
    steps = {f"{name} (XLA)": first_order_step(module, data.vocab_size)}
    for spec in FLAGS.kfac_row:
        spec, own = own_pullback.split_spec(spec)
        label, options = kfac_spec.parse(spec)
        model = module.make_model(data.vocab_size)
        opt = kg.KFAC(kg.auto_register(module.make_loss(model)), **options)
        steps[f"K-FAC {label}"] = own_pullback.step_with(opt.step, own)
    times = {k: [] for k in steps}
    for i, batch in enumerate(batches):
        for k, step in steps.items():
            start = time.perf_counter()
            tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t,
                                  step(*batch))
            if i >= FLAGS.warm:
                times[k].append(time.perf_counter() - start)
    base = float(np.median(times[f"{name} (XLA)"]))
    print(f"\n{FLAGS.model} LM, batch {FLAGS.batch} x {FLAGS.seq_len}, {FLAGS.steps} steps each")
    print(f"| run | median ms | mean ms | median / {name}'s | mean / {name}'s |")
    print("|---|---:|---:|---:|---:|")
    for k, t in times.items():
        med, mean = float(np.median(t)), float(np.mean(t))
        print(f"| {k} | {med * 1e3:.1f} | {mean * 1e3:.1f} | {med / base:.2f} | {mean / base:.2f} |")


if __name__ == "__main__":
    app.run(main)
