"""The BERT-small encoder the scale benchmarks measure: token embeddings and a
learned position table, 4 layers of 4-head self-attention and a 1024-wide GELU
feed-forward, d 256, post-layer-norm, logits ``[B, classes]`` of the first
token. Random weights; ``batch(rng, size)`` draws random ids and labels.
"""
from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

VOCAB, LENGTH, CLASSES = 1000, 128, 2


class PositionTable(keras.layers.Layer):
    """Adds a learned ``[length, d]`` table to ``[B, length, d]`` inputs."""

    def build(self, shape):
        self.table = self.add_weight(shape=tuple(shape[1:]), initializer="random_normal",
                                     name="table")

    def call(self, x):
        return x + self.table[None]


def bert_small(vocab=VOCAB, length=LENGTH, d=256, heads=4, layers=4, ffn=1024,
               classes=CLASSES):
    """The encoder of the module docstring."""
    ids = keras.Input((length,), dtype="int32")
    tokens = keras.layers.Embedding(vocab, d, name="tokens")(ids)
    h = keras.layers.LayerNormalization(name="embedding_norm")(PositionTable(name="positions")(
        tokens))
    for i in range(layers):
        attention = keras.layers.MultiHeadAttention(heads, d // heads, name=f"attention_{i}")
        h = keras.layers.LayerNormalization(name=f"attention_norm_{i}")(h + attention(h, h))
        up = keras.layers.Dense(ffn, activation="gelu", name=f"ffn_up_{i}")(h)
        h = keras.layers.LayerNormalization(name=f"ffn_norm_{i}")(
            h + keras.layers.Dense(d, name=f"ffn_down_{i}")(up))
    logits = keras.layers.Dense(classes, name="classifier")(h[:, 0])
    return keras.Model(ids, logits, name="bert_small")


def batch(rng: np.random.Generator, size: int = 16):
    """``(ids [size, LENGTH] int32, labels [size] int32)``."""
    return (tf.constant(rng.integers(0, VOCAB, (size, LENGTH)), tf.int32),
            tf.constant(rng.integers(0, CLASSES, size), tf.int32))
