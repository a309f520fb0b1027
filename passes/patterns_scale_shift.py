"""Scale-and-shift layer patterns (normalisation layers, a variable Mul
and/or Add, a variable tiled over the batch), declared as data like
``passes.patterns``.
"""
from __future__ import annotations

from passes import ir
from passes.batch_flow import run_time_batch_axes, static_batch
from passes.loss_constants import evaluate
from passes.patterns import ADD, ANY, VAR, VAR_PART, Op, Pattern, ops, var_shape

# --- scale and shift ---------------------------------------------------------
# Normalisers: how the layer's normalised input xhat is recovered from the
# graph. "identity": xhat = inputs[0]. "center_scale": xhat = (inputs[0] -
# inputs[1]) * inputs[2]. "fused_inference": xhat = (x - mean) * rsqrt(var +
# epsilon). "fused_training": as "center_scale" with the batch mean and the
# batch variance that FusedBatchNorm outputs (Bessel-corrected: undo it).
# Each tensor is read in the shape its op reads it, and the scale laid out as
# its op broadcasts it (passes.scale_shift_use): any rank and axis set, group
# normalisation's [.., G, C/G] included (a Keras GroupNormalization matches
# KERAS_LAYER_NORM on its grouped input).

MUL = ops("Mul")


def _shared_by_examples(param, op):
    """The variable ``param``, as ``op`` broadcasts it against its output,
    does not vary along the batch axis (else it is no scale of examples)."""
    def check(g, m):
        shape = ir.read_shape(g, m[op], ir.tensor_name(m[param]))
        out = g.nodes[m[op]]["shapes"][0]
        return shape is None or out is None or len(shape) < len(out) or shape[0] == 1
    return check


def _same_layout(g, m, gamma_op, beta_op) -> bool:
    """Scale and shift broadcast against the output the same way (the runtime
    lays both out as one)."""
    out = g.nodes[m["add"]]["shapes"][0]
    shapes = [ir.read_shape(g, m[op], ir.tensor_name(m[v]))
              for v, op in (("gamma", gamma_op), ("beta", beta_op))]
    if out is None or None in shapes:
        return False
    pad = [(1,) * (len(out) - len(s)) + tuple(s) for s in shapes]
    return pad[0] == pad[1]


# Keras BatchNormalization (training and inference):
#   m1 = rsqrt * gamma; y = x * m1 + (beta - mean * m1)
KERAS_BATCH_NORM = Pattern(
    "keras_batch_norm", "scale_and_shift",
    {"x": ANY, "mean": ANY, "rsqrt": ops("Rsqrt"), "gamma": VAR, "beta": VAR,
     "m1": MUL, "xm": MUL, "mm": MUL, "sub": ops("Sub"), "add": ops("AddV2", "Add")},
    (("rsqrt", "m1", None), ("gamma", "m1", None), ("x", "xm", None), ("m1", "xm", None),
     ("mean", "mm", None), ("m1", "mm", None), ("beta", "sub", 0), ("mm", "sub", 1),
     ("xm", "add", None), ("sub", "add", None)),
    anchor="m1", output="add", params=("gamma", "beta"),
    inputs=(("x", "out", 0), ("mean", "out", 0), ("rsqrt", "out", 0)), normalizer="center_scale",
    check=lambda g, m: len({m["x"], m["mean"], m["m1"]}) == 3 and _same_layout(g, m, "m1", "sub"))
KERAS_BATCH_NORM_NO_SCALE = Pattern(
    "keras_batch_norm_no_scale", "scale_and_shift",
    {"x": ANY, "mean": ANY, "rsqrt": ops("Rsqrt"), "beta": VAR,
     "xm": MUL, "mm": MUL, "sub": ops("Sub"), "add": ops("AddV2", "Add")},
    (("x", "xm", None), ("rsqrt", "xm", None), ("mean", "mm", None), ("rsqrt", "mm", None),
     ("beta", "sub", 0), ("mm", "sub", 1), ("xm", "add", None), ("sub", "add", None)),
    anchor="rsqrt", output="add", params=("beta",),
    inputs=(("x", "out", 0), ("mean", "out", 0), ("rsqrt", "out", 0)), normalizer="center_scale",
    check=lambda g, m: m["x"] != m["mean"])
# Keras BatchNormalization without a center (beta), in inference:
#   m1 = rsqrt * gamma; y = x * m1 + (-mean) * m1
KERAS_BATCH_NORM_NO_CENTER = Pattern(
    "keras_batch_norm_no_center", "scale_and_shift",
    {"x": ANY, "mean": ANY, "rsqrt": ops("Rsqrt"), "gamma": VAR, "m1": MUL, "xm": MUL,
     "neg": ops("Neg"), "mm": MUL, "add": ops("AddV2", "Add")},
    (("rsqrt", "m1", None), ("gamma", "m1", None), ("x", "xm", None), ("m1", "xm", None),
     ("mean", "neg", 0), ("neg", "mm", None), ("m1", "mm", None), ("xm", "add", None),
     ("mm", "add", None)),
    anchor="m1", output="add", params=("gamma",),
    inputs=(("x", "out", 0), ("mean", "out", 0), ("rsqrt", "out", 0)), normalizer="center_scale",
    check=lambda g, m: len({m["x"], m["mean"], m["m1"]}) == 3)
# Keras LayerNormalization:
#   m = rsqrt * gamma; y = x * m + (-mean * m + beta)
KERAS_LAYER_NORM = Pattern(
    "keras_layer_norm", "scale_and_shift",
    {"x": ANY, "mean": ANY, "rsqrt": ops("Rsqrt"), "gamma": VAR, "beta": VAR,
     "m": MUL, "neg": ops("Neg"), "m1": MUL, "a1": ops("AddV2", "Add"), "m2": MUL,
     "add": ops("AddV2", "Add")},
    (("rsqrt", "m", None), ("gamma", "m", None), ("mean", "neg", 0), ("neg", "m1", None),
     ("m", "m1", None), ("m1", "a1", None), ("beta", "a1", None), ("x", "m2", None),
     ("m", "m2", None), ("m2", "add", None), ("a1", "add", None)),
    anchor="m", output="add", params=("gamma", "beta"),
    inputs=(("x", "out", 0), ("mean", "out", 0), ("rsqrt", "out", 0)), normalizer="center_scale",
    check=lambda g, m: _same_layout(g, m, "m", "a1"))
FUSED_BATCH_NORM = Pattern(
    "fused_batch_norm", "scale_and_shift",
    {"x": ANY, "op": ops("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"),
     "gamma": VAR, "beta": VAR},
    (("x", "op", 0), ("gamma", "op", 1), ("beta", "op", 2)),
    anchor="op", output="op", params=("gamma", "beta"), inputs=(("op", "in", 0),),
    normalizer="fused")
# A variable scale, then a variable shift; or either alone.
SCALE_SHIFT = Pattern(
    "scale_shift", "scale_and_shift",
    {"x": ANY, "mul": MUL, "gamma": VAR, "add": ops("AddV2", "Add"), "beta": VAR},
    (("x", "mul", None), ("gamma", "mul", None), ("mul", "add", None), ("beta", "add", None)),
    anchor="mul", output="add", params=("gamma", "beta"), inputs=(("x", "out", 0),),
    normalizer="identity",
    check=lambda g, m: (m["x"] != m["gamma"]
                        and var_shape(g, m["gamma"]) == var_shape(g, m["beta"])
                        and _same_layout(g, m, "mul", "add")
                        and _shared_by_examples("gamma", "mul")(g, m)))
def _offset_ok(g, m) -> bool:
    """``x * (c + gamma)``: ``c`` a constant that does not widen ``gamma``, and
    the Mul reads the sum in ``gamma``'s own layout (the layout is read there)."""
    gamma = ir.read_shape(g, m["plus"], ir.tensor_name(m["gamma"]))
    total = ir.read_shape(g, m["mul"], ir.tensor_name(m["plus"]))
    return (m["x"] != m["plus"] and gamma is not None and total is not None
            and tuple(gamma) == tuple(total) == tuple(g.nodes[m["plus"]]["shapes"][0] or ())
            and ir.const_value(g, ir.tensor_name(m["c"])) is not None
            and _shared_by_examples("plus", "mul")(g, m))


# A scale offset by a constant, ``x * (1 + gamma)`` (Gemma's RMSNorm): the
# gradient of gamma is the scale's, ``xhat * g``, whatever the constant.
SCALE_OFFSET = Pattern(
    "scale_offset", "scale_and_shift",
    {"x": ANY, "mul": MUL, "plus": ops("AddV2", "Add"),
     "c": Op(frozenset({"Const"}), exclusive=False), "gamma": VAR_PART},
    (("c", "plus", None), ("gamma", "plus", None), ("plus", "mul", None), ("x", "mul", None)),
    anchor="mul", output="mul", params=("gamma",), inputs=(("x", "out", 0),),
    normalizer="identity", check=_offset_ok)
SCALE = Pattern(
    "scale", "scale_and_shift", {"x": ANY, "mul": MUL, "gamma": VAR_PART},
    (("x", "mul", None), ("gamma", "mul", None)),
    anchor="mul", output="mul", params=("gamma",), inputs=(("x", "out", 0),),
    normalizer="identity",
    check=lambda g, m: m["x"] != m["gamma"] and _shared_by_examples("gamma", "mul")(g, m))
# A log-parametrised scale, x * exp(v) or x * -exp(v) (Qwen3.5's gate A_log, a
# learned temperature): d/dv is x times that factor s, which per example plays x's
# part (kfac_graph/layers/scale_shift.py, normalizer "exp").
def _exp_scale(name, factor):
    nodes = {"x": ANY, "mul": MUL, "exp": ops("Exp"), "gamma": VAR_PART}
    edges = (("gamma", "exp", 0), ("x", "mul", None))
    if factor == "neg":
        nodes["neg"] = ops("Neg")
        edges += (("exp", "neg", 0), ("neg", "mul", None))
    else:
        edges += (("exp", "mul", None),)
    return Pattern(name, "scale_and_shift", nodes, edges, anchor="mul", output="mul",
                   params=("gamma",), inputs=(("x", "out", 0), (factor, "out", 0)),
                   normalizer="exp",
                   check=lambda g, m: m["x"] != m[factor] and _shared_by_examples(
                       factor, "mul")(g, m))


EXP_SCALE, NEG_EXP_SCALE = _exp_scale("exp_scale", "exp"), _exp_scale("neg_exp_scale", "neg")
# A negated scale, x * -v (Keras's PReLU: relu(x) - alpha * relu(-x)): xhat = -x.
NEG_SCALE = Pattern(
    "neg_scale", "scale_and_shift", {"x": ANY, "mul": MUL, "neg": ops("Neg"), "gamma": VAR_PART},
    (("gamma", "neg", 0), ("neg", "mul", None), ("x", "mul", None)),
    anchor="mul", output="mul", params=("gamma",), inputs=(("x", "out", 0),),
    normalizer="negated",
    check=lambda g, m: m["x"] != m["neg"] and _shared_by_examples("neg", "mul")(g, m))
SHIFT = Pattern(
    "shift", "scale_and_shift", {"x": ANY, "add": ADD, "beta": VAR_PART},
    (("x", "add", None), ("beta", "add", None)),
    anchor="add", output="add", params=("beta",), inputs=(("x", "out", 0),),
    normalizer="identity",
    check=lambda g, m: m["x"] != m["beta"] and _shared_by_examples("beta", "add")(g, m))



def _over_the_batch(g, m) -> bool:
    """A Tile or BroadcastTo of the variable whose output leads with the
    batch, copying unit axes alone, the variable read with a unit first axis
    (a Tile's batch axis may follow unit axes: ``tf.repeat`` tiles
    ``[1, 1, d]`` to ``[1, B, 1, d]``, then drops the first axis)."""
    d = g.nodes[m["tile"]]
    out = (d["shapes"] or [None])[0]
    read = ir.read_shape(g, m["tile"], ir.tensor_name(m["beta"]))
    if read is not None and out and d["op"] == "BroadcastTo":  # numpy: leading axes added
        read = (1,) * (len(out) - len(read)) + tuple(read)
    lead = tiled_axis(g, m["tile"])
    if (not out or lead is None or lead >= len(out) or not _batch_sized(g, m["tile"], out, lead)
            or read is None or len(read) != len(out)
            or any(r != 1 for r in read[:lead + 1]) or any(o != 1 for o in out[:lead])):
        return False
    return all(r in (1, o) for r, o in zip(read, out))  # copies of unit axes alone


def _batch_sized(g, node, out, axis) -> bool:
    """``node``'s output axis ``axis`` has the batch's size: the static batch,
    or, where that is known at run time only, an axis the probes found
    holding it (``passes.shape_probe``)."""
    batch = static_batch(g)
    if batch is not None:
        return None not in out and out[axis] == batch
    return axis in run_time_batch_axes(g, node)


def tiled_axis(g, node) -> int | None:
    """The axis a Tile copies along the batch (its first multiple other than
    1, the first axis where none is, or on a batch of one its unit first
    axis: ``tile(w, [B, 4, 1])`` traced with ``B = 1``), 0 for a
    BroadcastTo, None otherwise."""
    d = g.nodes[node]
    if d["op"] == "BroadcastTo":
        return 0
    times = evaluate(g, d["inputs"][1]) if d["op"] == "Tile" else None
    if times is None and d["op"] == "Tile":  # the batch known at run time only
        return _run_time_tiled_axis(g, node)
    if times is None:
        return None
    tiled = [i for i, k in enumerate(times) if int(k) != 1]
    out = (d["shapes"] or [None])[0]
    if not tiled or (static_batch(g) == 1 and out and out[0] == 1):
        return 0
    return tiled[0]


def _run_time_tiled_axis(g, node) -> int | None:
    """The axis a Tile whose multiples are packed from scalars copies along,
    where one multiple, on an axis that holds the batch
    (``passes.shape_probe``), is known at run time only and the others are 1."""
    multiples = g.nodes[ir.split_tensor(g.nodes[node]["inputs"][1])[0]]
    if multiples["op"] != "Pack":
        return None
    times = [evaluate(g, t) for t in multiples["inputs"]]
    unknown = [i for i, t in enumerate(times) if t is None]
    if (len(unknown) != 1 or any(int(t) != 1 for t in times if t is not None)
            or unknown[0] not in run_time_batch_axes(g, node)):
        return None
    return unknown[0]


# A variable tiled or broadcast over the batch (a ViT's class and register
# tokens, concatenated before the patches; GPT-OSS's attention sinks): a
# shift of zeros, its per-example gradient the output gradient at the copy.
TILED_SHIFT = Pattern(
    "tiled_shift", "scale_and_shift", {"beta": VAR_PART, "tile": ops("Tile", "BroadcastTo")},
    (("beta", "tile", 0),), anchor="tile", output="tile", params=("beta",), inputs=(),
    normalizer="identity", check=_over_the_batch)


SCALE_SHIFT_PATTERNS: tuple[Pattern, ...] = (
    KERAS_BATCH_NORM, KERAS_BATCH_NORM_NO_SCALE, KERAS_BATCH_NORM_NO_CENTER, KERAS_LAYER_NORM,
    FUSED_BATCH_NORM,
    SCALE_SHIFT, SCALE_OFFSET, EXP_SCALE, NEG_EXP_SCALE, NEG_SCALE, SCALE, SHIFT, TILED_SHIFT,
)
