"""Shared test set-up: quiet TensorFlow logs and deterministic seeds."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# TensorFlow turns its oneDNN kernels on by itself only on some CPUs; the
# reference ops of the tests (NCHW float32 convolutions, batch-grouped filter
# gradients) exist only there, so every machine runs the tests with them.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    tf.random.set_seed(0)
    np.random.seed(0)
    yield
