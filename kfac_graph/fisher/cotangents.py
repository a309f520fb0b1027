"""The cotangents at the model output that feed the Fisher blocks, by
estimation mode (``FisherEstimator``'s module docstring states the modes).

``at_output(reg, taps, mode, seeds, position_columns) -> (cotangents,
sources)``: per cotangent ``c`` (held fixed), the ``[B]`` per-example
scalars ``sum z . c`` (over every axis of ``z`` but the first: a ``[B]``
output's are ``z * c``) whose parameter gradients are the per-example
gradients. A likelihood kind draws targets (sampled) or reads the data's
(empirical) and takes ``d(-log p)/dz`` at them, or takes the columns of its
Fisher square root (exact); each token's cotangent is scaled by the square
root of its weight (``kfac_graph.token_weights``; a masked token
contributes nothing). A ``"ggn"`` loss (``kfac_graph.fisher.ggn``) takes the
columns of its Hessian's square root (exact) or ``S eps`` (sampled), its
weights already in its Hessian. An opaque loss (empirical only), and a
``"ggn"`` one in empirical mode: each example's own loss, cotangent None.
"""
import tensorflow as tf

from kfac_graph import token_weights
from kfac_graph.fisher.distributions import at_least_float32
from kfac_graph.fisher.curvature import output_curvature
from kfac_graph.fisher.ggn_blocks import BlockGGN
from passes.errors import KfacGraphError


def at_output(reg, taps, mode, seeds=(), position_columns="shared"):
    """``(cotangents, sources)`` (module docstring); ``seeds``: one stateless
    seed per sample of the sampled mode."""
    kind, w = reg.loss.kind, taps.token_weights
    if taps.model_output is None or (kind, mode) == ("ggn", "empirical"):
        if taps.per_example_loss is None:  # (before: TensorFlow's "None values not supported")
            raise KfacGraphError(f"the empirical Fisher needs each example's own loss: "
                                 f"{taps.per_example_problem}")
        return [None], [taps.per_example_loss]
    z = at_least_float32(taps.model_output)
    z0 = tf.stop_gradient(z)
    dist0 = output_curvature(reg.loss, z0, taps)
    # S samples, each scaled by 1/sqrt(S): the sums over sources are means
    weight = tf.constant(max(len(seeds), 1) ** -0.5, z.dtype)
    if mode == "exact":
        cotangents = [token_weights.scaled(w, kind, c)
                      for c in exact_columns(dist0, z0, position_columns)]
    elif kind == "ggn":  # no targets to draw: cotangents S eps
        cotangents = [weight * dist0.sample_cotangent(s) for s in seeds]
    else:
        if mode == "empirical":
            y = taps.targets if taps.targets is not None else tf.zeros_like(z0)
            targets = [tf.stop_gradient(y)]
        else:
            targets = [tf.stop_gradient(dist0.sample(seed)) for seed in seeds]
        cotangents = []
        for y in targets:
            c = tf.gradients(-tf.reduce_sum(dist0.log_prob(y)), z0)[0]
            c = token_weights.scaled(w, kind, c)
            cotangents.append(c if len(targets) == 1 else weight * c)
    # every axis but the examples' (a [B] output, one value per example, has none)
    axes = list(range(1, z.shape.rank))
    per_example = lambda t: tf.reduce_sum(t, axis=axes) if axes else t  # noqa: E731
    cotangents = [tf.stop_gradient(c) for c in cotangents]
    return cotangents, [per_example(z * c) for c in cotangents]


def exact_columns(dist, z, position_columns="shared"):
    """The Fisher square root's columns at ``z``: ``K`` of them shared by
    all positions, or with ``position_columns="separate"`` one per
    position and class (``T K``), each zero outside its position."""
    if isinstance(dist, BlockGGN):  # joined outputs: the positions are each block's
        return dist.sqrt_fisher_columns(separate=position_columns == "separate")
    columns = dist.sqrt_fisher_columns()
    if position_columns == "shared" or z.shape.rank <= 2:
        return columns
    positions = z.shape[1:-1]
    if not positions.is_fully_defined():
        raise KfacGraphError(f"exact Fisher with position_columns='separate': the model "
                             f"output's positions {positions} are not known when tracing")
    n = positions.num_elements()
    return [c * tf.reshape(tf.one_hot(p, n, dtype=c.dtype), [1, *positions.as_list(), 1])
            for p in range(n) for c in columns]
