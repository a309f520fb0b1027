"""Character-level text that ships with Python: the help topics of
``pydoc_data.topics`` (about 0.7 MB of English and code), for the language
model benchmarks.

``CharText(seq_len, held_out=0.1)``: the text's characters as ids
(vocabulary: every character that occurs, sorted), the last ``held_out``
share kept apart. ``batches(n, batch, seed)`` draws random windows of the
training part: inputs ``[batch, seq_len]`` and next-character targets of the
same shape. ``held_out_windows(count)``: fixed, evenly spaced windows of the
held-out part (the evaluation set).
"""
import numpy as np
import pydoc_data.topics


class CharText:
    def __init__(self, seq_len: int, held_out: float = 0.1):
        text = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
        self.chars = sorted(set(text))
        lookup = {c: i for i, c in enumerate(self.chars)}
        ids = np.array([lookup[c] for c in text], np.int32)
        split = int(len(ids) * (1 - held_out))
        self.train, self.test = ids[:split], ids[split:]
        self.seq_len = seq_len

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def _windows(self, ids, starts):
        rows = np.stack([ids[s:s + self.seq_len + 1] for s in starts])
        return rows[:, :-1], rows[:, 1:]

    def batches(self, n: int, batch: int, seed: int):
        """``n`` batches ``(x, y)`` of random training windows."""
        rng = np.random.default_rng(seed)
        high = len(self.train) - self.seq_len - 1
        return [self._windows(self.train, rng.integers(0, high, batch)) for _ in range(n)]

    def held_out_windows(self, count: int):
        """``(x, y)``: ``count`` evenly spaced held-out windows."""
        starts = np.linspace(0, len(self.test) - self.seq_len - 1, count).astype(int)
        return self._windows(self.test, starts)
