"""The curvature at a registration's model output, by its loss's kind: a
likelihood's Fisher (``distributions``) or a loss head's Gauss-Newton
Hessian (``ggn``; joined outputs block by block, ``ggn_blocks``)."""
from kfac_graph.fisher.distributions import make_distribution
from kfac_graph.fisher.ggn import GGN, output_hessian
from kfac_graph.fisher.ggn_blocks import block_curvature, block_sizes
from passes.errors import KfacGraphError


def output_curvature(loss, z, taps):
    """The curvature at the model output ``z`` (``at_least_float32``, held
    fixed) of the registration's ``loss`` (a ``LossSpec``): the likelihood's
    distribution, or for ``"ggn"`` the loss head's Hessian taken from the
    forward pass ``taps``, whole or by its blocks (``ggn_blocks``)."""
    if loss.kind != "ggn":
        return make_distribution(loss.kind, z)
    if taps.per_example_loss is None:
        raise KfacGraphError(f"a Gauss-Newton curvature needs each example's own loss: "
                             f"{taps.per_example_problem}")
    if "ggn" not in taps.derived:  # once per forward pass: the estimator's and the forms'
        if loss.blocks:
            out = taps.model_output
            taps.derived["ggn"] = block_curvature(
                taps.per_example_loss, out, block_sizes(loss.blocks, out), taps.block_weights)
        else:
            taps.derived["ggn"] = GGN(output_hessian(taps.per_example_loss, taps.model_output))
    return taps.derived["ggn"]
