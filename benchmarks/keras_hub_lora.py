"""keras-hub backbones fine-tuned with low-rank adapters.

The companion of ``keras_hub_coverage.py`` (same tiny configs, random
weights, losses, batch 3, float32) after ``backbone.enable_lora(rank)``,
keras-hub's own fine-tuning switch: it freezes every weight and adds an
adapter ``W0 + (alpha / r) A B`` to the attention's query and value
projections (Keras's ``Dense`` and ``EinsumDense.enable_lora``). keras-hub
starts ``B`` at zero, where ``A``'s gradient vanishes; here ``B`` is drawn at
random so that every adapter's gradient is checked. The pass registers each
adapter as two dense layers (``passes/lora.py``). Prints the same table;
``variables`` counts the adapters and what else stays trainable (the
adapted layers' biases), and with ``--kfac N`` the loss before and after N
``kg.KFAC`` steps with its defaults, and how many it skipped.

    python benchmarks/keras_hub_lora.py [--models bert,gpt2,...] [--check] [--rank 2]
        [--kfac 10]
"""
from __future__ import annotations

import bench_env  # noqa: E402,F401  (first: quiet logs, the repository importable)

import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402

import kfac_graph as kg  # noqa: E402
from keras_hub_coverage import BACKBONES, VISION, build, report  # noqa: E402

flags.DEFINE_integer("rank", 2, "The adapters' rank.")
flags.DEFINE_integer("kfac", 0, "K-FAC steps to take on each model after the table (0: none).")
FLAGS = flags.FLAGS  # --models and --check, keras_hub_coverage's
# the backbones enable_lora adapts (its default targets are the attention's
# query and value projections, by layer name; the others have no such layer)
ADAPTED = ("bert", "distil_bert", "roberta", "albert", "electra", "deberta_v3", "xlnet", "gpt2",
           "opt", "bloom", "falcon", "llama", "llama_tied", "mistral", "qwen", "phi3", "gemma",
           "mixtral", "qwen_moe", "gemma3", "gpt_oss", "qwen3_moe", "xlm_roberta", "qwen2",
           "qwen3", "llama3", "rwkv7", "bart", "t5gemma", "vit", "deit", "video_prism")
FLAGS.set_default("models", [m for m in ADAPTED if m in BACKBONES or m in VISION])


def build_adapted(name):
    """``keras_hub_coverage.build``, then ``enable_lora`` with ``B`` random."""
    backbone, loss_fn, args, head = build(name)
    backbone.enable_lora(FLAGS.rank)
    rng = np.random.default_rng(0)
    for v in backbone.trainable_variables:
        if "lora_kernel_b" in v.path:
            v.assign(rng.normal(size=v.shape).astype(v.dtype) * 0.1)
    return backbone, loss_fn, args, head


def main(argv):
    del argv
    logging.set_verbosity(logging.ERROR)
    report(build_adapted, FLAGS.models, FLAGS.check)
    if FLAGS.kfac:
        print(f"\n| backbone | loss | after {FLAGS.kfac} K-FAC steps | skipped |")
        print("|---|---:|---:|---:|")
        for name in FLAGS.models:
            _, loss_fn, args, _ = build_adapted(name)
            opt = kg.KFAC(loss_fn)
            losses = [float(opt.step(*args)) for _ in range(FLAGS.kfac)]
            print(f"| {name} | {losses[0]:.3f} | {losses[-1]:.3f} | {int(opt.skipped_steps)} |",
                  flush=True)


if __name__ == "__main__":
    app.run(main)
