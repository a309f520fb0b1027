"""The check that the whole K-FAC step under XLA trains as the step without it."""
import numpy as np


def assert_xla_matches_plain(train, plain, rtol, atol):
    """``train(jit_compile)`` returns the trained parameters; run with
    ``jit_compile=True`` and with ``plain``, they agree to ``rtol``/``atol``."""
    for a, b in zip(train(True), train(plain)):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
