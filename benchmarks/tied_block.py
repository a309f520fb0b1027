"""The tied embedding's Fisher block: the default (``"diagonal"``, fed
per-example gradients of the whole table) against ``"kron"``
(``TiedEmbeddingKroneckerBlock``), on the character transformer of
``transformer_lm.py`` (``char_transformer.py``: d 128, 2 blocks, 4 heads,
the LM head tied to the token embedding; the vocabulary of ``char_text.py``;
batch 32 x 64, float32), ``kg.KFAC`` with its defaults otherwise.

Both optimizers are built and warmed up (``--warmup`` steps each, the
compilation included), then timed side by side in one process, interleaved:
each of ``--steps`` rounds runs one step of each, on the same batch. Printed:
per block the median and mean step time (the mean includes the steps that
refresh inverses), their ratio to the default's, the loss after the run,
and the tied table's statistics and cached-inverse bytes (``opt.memory()``).

``--vocab`` widens the table (the text still reads its first rows only)
to see how each block scales with the vocabulary; above ``max_factor_size``
(4096) the Kronecker block keeps ``Q``'s diagonal.

    python benchmarks/tied_block.py [--steps 30] [--warmup 5] [--vocab 8192]
"""
import statistics
import time

import bench_env  # noqa: F401  (first: quiet logs, the repository importable)

import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import kfac_graph as kg  # noqa: E402
import char_transformer  # noqa: E402
from char_text import CharText  # noqa: E402
from kfac_graph.fisher.report import human_bytes  # noqa: E402

tf.get_logger().setLevel("ERROR")

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 30, "timed rounds (one step of each block per round)")
flags.DEFINE_integer("warmup", 5, "untimed steps of each before the rounds")
flags.DEFINE_integer("seq_len", 64, "context: characters per window")
flags.DEFINE_integer("batch", 32, "windows per batch")
flags.DEFINE_integer("width", 128, "model width d")
flags.DEFINE_integer("vocab", 0, "table rows (0: the text's characters; more: rows no batch "
                     "reads, as a large vocabulary's rare tokens)")

BLOCKS = (("diagonal (default)", None), ("kron", {"tied_embedding": "kron"}))


def make_optimizer(vocab, approximations):
    model = char_transformer.build(vocab, FLAGS.seq_len, FLAGS.width)

    def loss_fn(x, y):
        logits = model(x, training=True)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    return kg.KFAC(kg.auto_register(loss_fn), approximations=approximations)


def main(_):
    text = CharText(FLAGS.seq_len)
    batches = [tuple(tf.constant(t) for t in b)
               for b in text.batches(FLAGS.warmup + FLAGS.steps, FLAGS.batch, seed=0)]
    vocab = FLAGS.vocab or text.vocab_size
    opts = [make_optimizer(vocab, approx) for _, approx in BLOCKS]
    for opt in opts:
        for x, y in batches[:FLAGS.warmup]:
            float(opt.step(x, y))
    times, losses = [[] for _ in opts], [None for _ in opts]
    for x, y in batches[FLAGS.warmup:]:
        for k, opt in enumerate(opts):
            start = time.perf_counter()
            losses[k] = float(opt.step(x, y))
            times[k].append(time.perf_counter() - start)
    base_median, base_mean = statistics.median(times[0]), statistics.mean(times[0])
    print(f"vocab {vocab}, d {FLAGS.width}, batch {FLAGS.batch} x {FLAGS.seq_len}; "
          f"{FLAGS.steps} interleaved rounds after {FLAGS.warmup} warm-up steps each")
    print("| tied block | median step / default's | mean step / default's | loss at the end "
          "| table statistics | table inverses | skipped |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for (label, _), opt, ts, loss in zip(BLOCKS, opts, times, losses):
        table = next(row for row in opt.memory()["layers"] if row["kind"] == "tied_embedding")
        print(f"| {label} | {statistics.median(ts) / base_median:.2f} | "
              f"{statistics.mean(ts) / base_mean:.2f} | {loss:.3f} | "
              f"{human_bytes(table['factors_bytes'])} | {human_bytes(table['inverses_bytes'])} "
              f"| {int(opt.skipped_steps)} |")


if __name__ == "__main__":
    app.run(main)
