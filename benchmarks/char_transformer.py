"""A small decoder-only transformer language model (Keras), for the
benchmarks (``transformer_lm.py``, ``dp.py``): token and learned position
embeddings, pre-norm blocks of causal ``MultiHeadAttention`` and a GELU MLP
4d wide, a final LayerNorm, and the LM head tied to the token embedding
(logits = h E^T) or a Dense of its own.
"""
import keras


class TiedHead(keras.layers.Layer):
    """Logits ``h E^T`` from the token embedding's table ``E``."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h):
        return keras.ops.matmul(h, keras.ops.transpose(self.embedding.embeddings))


class AddPositions(keras.layers.Layer):
    """``h + P[arange(T)]``: a learned position embedding (looked up inside
    the call, so that the model's graph reads the table)."""

    def __init__(self, length, width, **kwargs):
        super().__init__(**kwargs)
        self.table = keras.layers.Embedding(length, width)

    def call(self, h):
        return h + self.table(keras.ops.arange(keras.ops.shape(h)[1]))


def build(vocab, seq_len=64, width=128, heads=4, blocks=2, tied=True, seed=0):
    """The model: ids ``[B, seq_len]`` -> logits ``[B, seq_len, vocab]``."""
    keras.utils.set_random_seed(seed)
    L, d, T = keras.layers, width, seq_len
    ids = keras.Input((T,), dtype="int32")
    tokens = L.Embedding(vocab, d)
    h = AddPositions(T, d)(tokens(ids))
    for _ in range(blocks):
        a = L.LayerNormalization()(h)
        h = h + L.MultiHeadAttention(heads, d // heads)(a, a, use_causal_mask=True)
        m = L.LayerNormalization()(h)
        h = h + L.Dense(d)(L.Dense(4 * d, activation="gelu")(m))
    h = L.LayerNormalization()(h)
    logits = TiedHead(tokens)(h) if tied else L.Dense(vocab)(h)
    return keras.Model(ids, logits)
