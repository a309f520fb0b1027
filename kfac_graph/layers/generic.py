"""Variables no layer pattern matches: kind ``"generic"``.

No rule reads them from layer inputs: their per-example gradients are the
vectorised Jacobian of the per-example loss terms with respect to the
variables' own reads (``LayerTaps.build(read_variables=...)``), and their
Fisher blocks are fed those per-example gradients.
"""
from kfac_graph.layers.kind import LayerKind

KIND = LayerKind(
    name="generic",
    blocks={"diagonal": "NaiveDiagonalBlock", "full": "NaiveFullBlock"},
    default_block="diagonal",
    colour="lightgrey",
)
