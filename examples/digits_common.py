"""What both examples share: scikit-learn's digits and a small CNN for them."""
import keras
import numpy as np
from sklearn.datasets import load_digits


def digits(seed):
    """Train/test splits of the 8x8 digits, pixels scaled to [0, 1]."""
    data = load_digits()
    x = (data.images / 16.0).astype("float32")[..., None]
    y = data.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = len(x) // 5
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def cnn():
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ], name="digits_cnn")
