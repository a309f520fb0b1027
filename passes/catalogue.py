"""The ordered catalogue of layer patterns the matcher tries: larger
patterns first, so a dense layer with a bias is claimed before the bare
MatMul could be, and a normalisation layer before a bare variable Mul;
the multi-axis dense forms (``passes.patterns_multiaxis``: EinsumDense,
position embeddings, and ``passes.patterns_position``'s table sliced to a
run-time length; ``passes.patterns_relative``: relative-position bias
tables) before them all, a kernel reshaped to another matrix
(``passes.patterns_reshaped``), and the grouped dense form
(``passes.patterns_grouped``: a mixture of experts' output projections),
then the sums of MatMuls that are one dense layer (``passes.patterns_stacked``:
a recurrent cell's ``x @ W + h @ R + b``) before the single products they
contain."""
from __future__ import annotations

from passes.patterns import DENSE_AND_CONV_PATTERNS, Pattern
from passes.patterns_grouped import GROUPED_PATTERNS
from passes.patterns_multiaxis import MULTIAXIS_PATTERNS
from passes.patterns_position import POSITION_PATTERNS
from passes.patterns_relative import RELATIVE_PATTERNS
from passes.patterns_reshaped import RESHAPED_PATTERNS
from passes.patterns_scale_shift import SCALE_SHIFT_PATTERNS
from passes.patterns_stacked import STACKED_PATTERNS

LAYER_PATTERNS: tuple[Pattern, ...] = (MULTIAXIS_PATTERNS + POSITION_PATTERNS + RELATIVE_PATTERNS
                                       + RESHAPED_PATTERNS + GROUPED_PATTERNS
                                       + STACKED_PATTERNS
                                       + DENSE_AND_CONV_PATTERNS + SCALE_SHIFT_PATTERNS)
