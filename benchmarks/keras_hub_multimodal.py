"""keras-hub backbones with several inputs: audio, image and text towers.

The companion of ``keras_hub_coverage.py`` (same tiny configs, random
weights, batch 3, float32, per-variable error against a loop of
one-example tapes) for backbones fed more than token ids or one image:
Whisper and Moonshine (audio features or samples, then a decoder), CLIP
and SigLIP (an image and a text tower), PaliGemma (an image and a prompt),
EdRec (an encoder-decoder on two token streams). The loss: the LM head at
the last position where the backbone has a reversible token embedding,
else a Dense classifier on the mean-pooled output (the two-tower models:
on their image and text embeddings side by side; their own contrastive
logits ``a @ b^T`` pair every example with every other, which the last row,
``clip_contrastive``, shows the pass finding: its ``coupling`` column
counts the ops where examples meet, ``passes/coupling.py``).

    python benchmarks/keras_hub_multimodal.py [--models whisper,clip,...] [--check]
"""
from __future__ import annotations

import bench_env  # noqa: E402,F401  (first: quiet logs, the repository importable)

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags, logging  # noqa: E402

import kfac_graph as kg  # noqa: E402
from keras_hub_coverage import B, T, V, report  # noqa: E402

_M = keras_hub.models
_TOWER = dict(patch_size=8, hidden_dim=16, num_layers=2, num_heads=2, intermediate_dim=32,
              image_shape=(16, 16, 3))
_TEXT = dict(vocabulary_size=V, embedding_dim=16, hidden_dim=16, num_layers=2, num_heads=2,
             intermediate_dim=32, max_sequence_length=T)


def _inputs(rng, **kinds):
    """Arrays ``[B, ..]`` by kind: ``tokens``, ``mask`` (ones), ``image`` (16 x 16 x 3),
    ``frames`` (n, d floats)."""
    make = {"tokens": lambda: rng.randint(1, V, (B, T)).astype("int32"),
            "mask": lambda: np.ones((B, T), "int32"),
            "image": lambda: rng.normal(size=(B, 16, 16, 3)).astype("float32")}
    return {k: make[v]() if isinstance(v, str) else rng.normal(size=(B, *v)).astype("float32")
            for k, v in kinds.items()}


def _towers(backbone, rng):
    def features(inp):
        return tf.concat([backbone.get_vision_embeddings(inp["images"]),
                          backbone.get_text_embeddings(inp["token_ids"])], axis=-1)
    return backbone, _inputs(rng, images="image", token_ids="tokens"), features


def _clip(rng):
    return _towers(_M.CLIPBackbone(_M.CLIPVisionEncoder(**_TOWER), _M.CLIPTextEncoder(**_TEXT),
                                   projection_dim=8), rng)


BUILDERS = {
    "whisper": lambda rng: (_M.WhisperBackbone(
        vocabulary_size=V, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        num_mels=8, max_encoder_sequence_length=16, max_decoder_sequence_length=8),
        _inputs(rng, encoder_features=(16, 8), decoder_token_ids="tokens",
                decoder_padding_mask="mask"), "decoder_sequence_output"),
    "moonshine": lambda rng: (_M.MoonshineBackbone(
        vocabulary_size=V, filter_dim=16, encoder_num_layers=1, decoder_num_layers=1,
        hidden_dim=16, intermediate_dim=32, encoder_num_heads=2, decoder_num_heads=2,
        max_position_embeddings=64),
        {**_inputs(rng, encoder_input_values=(1600, 1), decoder_token_ids="tokens"),
         "encoder_padding_mask": np.ones((B, 1600), bool),
         "decoder_padding_mask": np.ones((B, T), bool)}, "decoder_sequence_output"),
    "clip": _clip,
    "siglip": lambda rng: _towers(_M.SigLIPBackbone(
        _M.SigLIPVisionEncoder(**_TOWER), _M.SigLIPTextEncoder(**_TEXT)), rng),
    "pali_gemma": lambda rng: (_M.PaliGemmaBackbone(
        vocabulary_size=V, image_size=16, num_layers=2, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=16, intermediate_dim=32, head_dim=8,
        vit_patch_size=8, vit_num_heads=2, vit_hidden_dim=16, vit_num_layers=2,
        vit_intermediate_dim=32),
        {**_inputs(rng, images="image", token_ids="tokens", padding_mask="mask"),
         "response_mask": np.array([[0, 0, 0, 1, 1]] * B, "int32")}, None),
    "edrec": lambda rng: (_M.EdRecBackbone(
        vocab_size=V, num_layers_enc=1, num_layers_dec=1, hidden_dim=16, intermediate_dim=32,
        num_heads=2), {**_inputs(rng, encoder_token_ids="tokens", decoder_token_ids="tokens"),
                       "encoder_padding_mask": np.ones((B, T), bool),
                       "decoder_padding_mask": np.ones((B, T), bool)},
        "decoder_sequence_output"),
    "clip_contrastive": lambda rng: (*_clip(rng)[:2], "vision_logits"),
}
FLAGS = flags.FLAGS  # --models and --check, keras_hub_coverage's, default to these models
FLAGS.set_default("models", list(BUILDERS))


def build(name):
    """``(backbone, loss_fn, args, head)``; ``args`` the inputs in order, then the labels."""
    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(1)
    backbone, inputs, out = BUILDERS[name](rng)
    keys = list(inputs)
    if callable(out):
        features = out
    else:
        def features(inp):
            h = backbone(inp)
            return h[out] if out else h

    token = getattr(backbone, "token_embedding", None)
    if out == "vision_logits":  # every image against every text: the i-th text is the label
        head, classes = "contrastive", None
        logits = lambda h: h  # noqa: E731
    elif token is not None and "reverse" in token.call.__code__.co_varnames:
        head, classes = "LM head", V
        logits = lambda h: token(h[:, -1], reverse=True)  # noqa: E731
    else:
        head, classes, dense = "classifier", 3, keras.layers.Dense(3)
        logits = lambda h: dense(tf.reduce_mean(h, axis=list(range(1, h.shape.rank - 1)))  # noqa: E731
                                 if h.shape.rank > 2 else h)

    @kg.auto_register
    def loss_fn(*args):
        *xs, y = args
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, logits(features(dict(zip(keys, xs))))))

    y = np.arange(B) if classes is None else rng.randint(0, classes, (B,))
    return backbone, loss_fn, tuple(tf.constant(inputs[k]) for k in keys) + (tf.constant(y),), head


def main(argv):
    del argv
    logging.set_verbosity(logging.ERROR)
    report(build, FLAGS.models, FLAGS.check)


if __name__ == "__main__":
    app.run(main)
