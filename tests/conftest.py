"""Shared test set-up: quiet TensorFlow logs and deterministic seeds."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# TensorFlow turns its oneDNN kernels on by itself only on some CPUs; the
# reference ops of the tests (NCHW float32 convolutions, batch-grouped filter
# gradients) exist only there, so every machine runs the tests with them.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
# The suite runs in two worker processes on two cores (README): one thread
# per op in each keeps them from oversubscribing the cores (about 9% less
# wall time); the fresh interpreters some tests start inherit it.
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras.src.backend.common import global_state  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    tf.random.set_seed(0)
    np.random.seed(0)
    yield


@pytest.fixture(autouse=True)
def _keras_dtypes():
    """Every test ends with the Keras floatx and global dtype policy it
    started with. Keras caches its global policy from floatx the first time
    a layer asks, so a test that sets floatx would otherwise leak float64
    layers into the next; the cache is read raw (asking for the policy
    would fill it)."""
    floatx = keras.config.floatx()
    policy = global_state.get_global_attribute("dtype_policy", None)
    yield
    keras.config.set_floatx(floatx)
    global_state.set_global_attribute("dtype_policy", policy)


@pytest.fixture
def keras_float64():
    """Keras layers and losses in float64 (floatx and the global policy, which
    Keras may have cached from floatx; ``_keras_dtypes`` puts both back)."""
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
