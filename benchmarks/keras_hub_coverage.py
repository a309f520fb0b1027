"""Which keras-hub backbones register with no generic variable.

Text backbones (``BACKBONES``) and image backbones (``VISION``, images
32 x 32, a classifier on the output averaged over its positions).

Builds each backbone from a tiny config with random weights (never a
preset: nothing is downloaded), puts a loss on it and runs the pass. The
loss: a decoder whose token embedding can run in reverse (a
``ReversibleEmbedding``: GPT-2, Llama, Gemma, ...) predicts the next token
from the last position with that LM head (tied to the token table where
the backbone ties it); any other backbone (the encoders, which return a
dict) classifies its mean-pooled
sequence output with a Dense layer. Prints, per backbone: its trainable
variables, how many of them the loss reads and how many register in a
non-generic layer, the layer kinds found, the pass time, and with
``--check`` the largest relative difference between an example's
``kg.per_example_gradients`` and its one-example tape (float32; per
variable, ``loop_error``);
the generic variables follow with their reasons. ``coupling``: the ops where
one example's loss reads other examples (``reg.coupling``, ``passes/coupling.py``;
none in these models).

    python benchmarks/keras_hub_coverage.py [--models bert,gpt2,...] [--check]
        [--signature static|batch|length]
"""
from __future__ import annotations

import collections
import time

import bench_env  # noqa: E402,F401  (first: quiet logs, the repository importable)

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags, logging  # noqa: E402

import kfac_graph as kg  # noqa: E402

V, T, B = 40, 5, 3
_M = keras_hub.models
_DEC = dict(vocabulary_size=V, num_layers=2, hidden_dim=16, intermediate_dim=32)
_ENC = dict(_DEC, num_heads=2, max_sequence_length=8)
_SMOL = dict(vocabulary_size=V, hidden_dim=16, intermediate_dim=32, num_layers=2,
             num_attention_heads=4, num_key_value_heads=2, attention_bias=False,
             attention_dropout=0.0, layer_types=["attention"] * 2, mlp_bias=False,
             layer_norm_epsilon=1e-5, max_position_embeddings=32, rope_theta=10000.0,
             partial_rotary_factor=1.0)
_T5GEMMA = dict(hidden_dim=16, intermediate_dim=32, num_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8,
                layer_types=["sliding_attention", "full_attention"])
BACKBONES = {
    "bert": lambda: _M.BertBackbone(**_ENC),
    "distil_bert": lambda: _M.DistilBertBackbone(**_ENC),
    "roberta": lambda: _M.RobertaBackbone(**_ENC),
    "albert": lambda: _M.AlbertBackbone(**_ENC, embedding_dim=8, num_groups=1,
                                        num_inner_repetition=1),
    "electra": lambda: _M.ElectraBackbone(
        vocab_size=V, num_layers=2, num_heads=2, hidden_dim=16, embedding_dim=8,
        intermediate_dim=32, max_sequence_length=8),
    "deberta_v3": lambda: _M.DebertaV3Backbone(**_ENC, bucket_size=4),
    "f_net": lambda: _M.FNetBackbone(
        vocabulary_size=V, num_layers=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=8),
    "xlnet": lambda: _M.XLNetBackbone(**{**_DEC, "num_heads": 2}),
    "gpt2": lambda: _M.GPT2Backbone(**_ENC),
    "gpt_neo_x": lambda: _M.GPTNeoXBackbone(**_ENC),
    "opt": lambda: _M.OPTBackbone(**_ENC),
    "bloom": lambda: _M.BloomBackbone(**{**_DEC, "num_heads": 2}),
    "falcon": lambda: _M.FalconBackbone(**{**_DEC, "num_attention_heads": 2}),
    "llama": lambda: _M.LlamaBackbone(**_DEC, num_query_heads=4, num_key_value_heads=2),
    "llama_tied": lambda: _M.LlamaBackbone(**_DEC, num_query_heads=4, num_key_value_heads=2,
                                           tie_word_embeddings=True),
    "mistral": lambda: _M.MistralBackbone(**_DEC, num_query_heads=4, num_key_value_heads=2),
    "qwen": lambda: _M.QwenBackbone(**_DEC, num_query_heads=4, num_key_value_heads=2),
    "phi3": lambda: _M.Phi3Backbone(**_DEC, num_query_heads=4, num_key_value_heads=2),
    "gemma": lambda: _M.GemmaBackbone(**_DEC, num_query_heads=2, num_key_value_heads=1,
                                      head_dim=8),
    "mixtral": lambda: _M.MixtralBackbone(**_DEC, num_query_heads=4, num_key_value_heads=2,
                                          num_experts=3, top_k=2),
    "qwen_moe": lambda: _M.QwenMoeBackbone(
        **_DEC, num_query_heads=4, num_key_value_heads=2, moe_intermediate_dim=8,
        shared_expert_intermediate_dim=8, num_experts=3, top_k=2),
    "gemma3": lambda: _M.Gemma3Backbone(
        **_DEC, image_size=16, num_query_heads=2, num_key_value_heads=1, head_dim=8,
        use_post_ffw_norm=True, use_post_attention_norm=True),
    "gpt_oss": lambda: _M.GptOssBackbone(**_DEC, num_query_heads=4, num_key_value_heads=2,
                                         num_experts=3, top_k=2, head_dim=4),
    "qwen3_moe": lambda: _M.Qwen3MoeBackbone(
        **_DEC, num_query_heads=4, num_key_value_heads=2, head_dim=4, moe_intermediate_dim=8,
        num_experts=4),
    "esm2": lambda: _M.ESM2Backbone(**_ENC),
    "roformer_v2": lambda: _M.RoformerV2Backbone(**_ENC, head_size=8),
    "xlm_roberta": lambda: _M.XLMRobertaBackbone(**_ENC),
    "qwen2": lambda: _M.Qwen2Backbone(**_DEC, num_query_heads=4, num_key_value_heads=2),
    "qwen3": lambda: _M.Qwen3Backbone(**_DEC, num_query_heads=4, num_key_value_heads=2,
                                      head_dim=4),
    "llama3": lambda: _M.Llama3Backbone(**_DEC, num_query_heads=4, num_key_value_heads=2),
    "qwen3_5": lambda: _M.Qwen3_5Backbone(
        **_DEC, num_query_heads=4, num_key_value_heads=2, head_dim=4, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=4, linear_value_head_dim=4),
    "qwen3_5_moe": lambda: _M.Qwen3_5MoeBackbone(  # gated delta net, then experts
        vocabulary_size=V, num_layers=2, hidden_dim=16, num_query_heads=2, num_key_value_heads=1,
        head_dim=8, moe_intermediate_dim=8, shared_expert_intermediate_size=8, num_experts=3,
        top_k=2, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=4,
        linear_conv_kernel_dim=2),
    "gemma3n": lambda: _M.Gemma3nBackbone(  # AltUp, LAuReL, per-layer embeddings
        text_vocab_size=V, text_hidden_size=16, num_hidden_layers=2, pad_token_id=0,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=[32, 32],
        hidden_activation="gelu_approximate",
        layer_types=["sliding_attention", "full_attention"], sliding_window=4,
        rope_theta=10000.0, max_position_embeddings=32, vocab_size_per_layer_input=V,
        hidden_size_per_layer_input=4, altup_num_inputs=2, laurel_rank=4),
    "rwkv7": lambda: _M.RWKV7Backbone(hidden_size=16, head_size=8, num_layers=2,
                                      vocabulary_size=V, intermediate_dim=32),
    "t5": lambda: _M.T5Backbone(**{**_DEC, "num_heads": 2}),
    "bart": lambda: _M.BartBackbone(**_ENC),
    "smollm": lambda: _M.SmolLMBackbone(**_SMOL, rope_layer_enabled_list=[True, True]),
    "smollm3": lambda: _M.SmolLM3Backbone(**_SMOL, rope_layer_enabled_list=[True, False]),
    "esm": lambda: _M.ESMBackbone(**_ENC),
    "t5gemma": lambda: _M.T5GemmaBackbone(
        vocabulary_size=V, sliding_window=4, **{f"{part}_{k}": v for part in ("encoder", "decoder")
                                                for k, v in _T5GEMMA.items()}),
}
S = 32  # images S x S x 3
_IMG = dict(image_shape=(S, S, 3))
_DINO = dict(patch_size=8, num_layers=2, hidden_dim=16, num_heads=2, intermediate_dim=32,
             position_embedding_shape=(S, S, 3), **_IMG)
# image backbones: a classifier on the output averaged over its positions
VISION = {
    "resnet_v2": lambda: _M.ResNetBackbone(
        input_conv_filters=[8], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 16],
        stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2], use_pre_activation=True,
        block_type="bottleneck_block", **_IMG),
    "cspnet": lambda: _M.CSPNetBackbone(
        stem_filters=8, stem_kernel_size=3, stem_strides=1, stackwise_depth=[1, 1],
        stackwise_strides=[1, 2], stackwise_num_filters=[8, 16], block_type="bottleneck_block",
        stage_type="cs3", bottle_ratio=[0.5], block_ratio=[1.0], expand_ratio=[2.0], **_IMG),
    "hgnetv2": lambda: _M.HGNetV2Backbone(
        depths=[1, 1], embedding_size=8, hidden_sizes=[16, 32], stem_channels=[3, 8, 8],
        hidden_act="relu", use_learnable_affine_block=True,
        stackwise_stage_filters=[(8, 8, 16, 1, 1, 3), (16, 8, 32, 1, 1, 3)],
        apply_downsample=[False, True], use_lightweight_conv_block=[False, True], **_IMG),
    "efficientnet": lambda: _M.EfficientNetBackbone(
        stackwise_kernel_sizes=[3, 3], stackwise_num_repeats=[1, 1],
        stackwise_input_filters=[8, 8], stackwise_output_filters=[8, 16],
        stackwise_expansion_ratios=[1, 4], stackwise_squeeze_and_excite_ratios=[0.0, 0.25],
        stackwise_strides=[1, 2], stackwise_block_types=["fused", "unfused"],
        width_coefficient=1.0, depth_coefficient=1.0),
    "mobilenet": lambda: _M.MobileNetBackbone(
        stackwise_expansion=[[16], [24, 24]], stackwise_num_blocks=[1, 2],
        stackwise_num_filters=[[8], [16, 16]], stackwise_kernel_size=[[3], [5, 5]],
        stackwise_num_strides=[[2], [2, 1]], stackwise_se_ratio=[[None], [0.25, 0.25]],
        stackwise_activation=[["relu"], ["hard_swish", "hard_swish"]],
        stackwise_padding=[[1], [2, 2]], output_num_filters=32, depthwise_filters=8,
        depthwise_stride=1, depthwise_residual=False, last_layer_filter=32,
        input_num_filters=8, **_IMG),
    "mit": lambda: _M.MiTBackbone(
        layerwise_depths=[1, 1], num_layers=2, layerwise_num_heads=[1, 2],
        layerwise_sr_ratios=[2, 1], max_drop_path_rate=0.0, layerwise_patch_sizes=[7, 3],
        layerwise_strides=[4, 2], hidden_dims=[8, 16], **_IMG),
    "vit": lambda: _M.ViTBackbone(image_shape=(S, S, 3), patch_size=8, num_layers=2,
                                  num_heads=2, hidden_dim=16, mlp_dim=32),
    "vit_det": lambda: _M.ViTDetBackbone(
        hidden_size=8, num_layers=2, intermediate_dim=16, num_heads=2,
        global_attention_layer_indices=[1], image_shape=(16, 16, 3), patch_size=4,
        num_output_channels=4, window_size=2),
    "swin": lambda: _M.SwinTransformerBackbone(
        image_shape=(16, 16, 3), embed_dim=8, depths=[2], num_heads=[2], window_size=2,
        patch_size=2),
    "dinov3": lambda: _M.DINOV3Backbone(patch_size=8, num_layers=2, hidden_dim=16,
                                        num_heads=2, intermediate_dim=32, **_IMG),
    "dinov2": lambda: _M.DINOV2Backbone(  # register tokens, layer scale, SwiGLU
        **_DINO, num_register_tokens=2, use_swiglu_ffn=True),
    "segformer": lambda: _M.SegFormerBackbone(  # MiT, then its all-MLP decoder
        image_encoder=VISION["mit"](), projection_filters=8),
    "depth_anything": lambda: _M.DepthAnythingBackbone(  # DINOv2, then a DPT head
        image_encoder=_M.DINOV2Backbone(**_DINO),
        reassemble_factors=[2, 1], neck_hidden_dims=[8, 16], fusion_hidden_dim=16,
        head_hidden_dim=8, head_in_index=-1, feature_keys=["stage1", "stage2"]),
    "deit": lambda: _M.DeiTBackbone(patch_size=8, num_layers=2, num_heads=2, hidden_dim=16,
                                    intermediate_dim=32, **_IMG),
    "densenet": lambda: _M.DenseNetBackbone(stackwise_num_repeats=[1, 1], growth_rate=8, **_IMG),
    "vgg": lambda: _M.VGGBackbone(stackwise_num_repeats=[1, 2], stackwise_num_filters=[8, 16],
                                  **_IMG),
    "xception": lambda: _M.XceptionBackbone(
        stackwise_conv_filters=[[8, 8], [16, 16], [16, 16], [16]],
        stackwise_pooling=[False, True, False, False], **_IMG),
    "mobilenet_v5": lambda: _M.MobileNetV5Backbone(  # attention, multi-scale fusion
        stackwise_block_types=[["er"], ["uir", "mqa"]], stackwise_num_blocks=[1, 2],
        stackwise_num_filters=[[8], [16, 16]], stackwise_strides=[[2], [2, 1]],
        stackwise_act_layers=[["relu"], ["gelu", "gelu"]],
        stackwise_exp_ratios=[[2.0], [2.0, 2.0]], stackwise_se_ratios=[[0.0], [0.0, 0.0]],
        stackwise_dw_kernel_sizes=[[0], [0, 0]], stackwise_dw_start_kernel_sizes=[[0], [3, 0]],
        stackwise_dw_end_kernel_sizes=[[0], [3, 0]], stackwise_exp_kernel_sizes=[[3], [0, 0]],
        stackwise_pw_kernel_sizes=[[1], [0, 0]], stackwise_num_heads=[[0], [0, 2]],
        stackwise_key_dims=[[0], [0, 8]], stackwise_value_dims=[[0], [0, 8]],
        stackwise_kv_strides=[[0], [0, 2]], stackwise_use_cpe=[[False], [False, False]],
        stem_size=8, num_features=16, use_msfa=True, msfa_indices=(-2, -1),
        msfa_output_resolution=4, layer_scale_init_value=1e-5, **_IMG),
    "video_prism": lambda: _M.VideoPrismBackbone(  # video: 2 frames of 16 x 16
        num_frames=2, patch_size=8, hidden_dim=16, intermediate_dim=32, num_heads=2,
        num_spatial_layers=1, num_temporal_layers=1, num_auxiliary_layers=0,
        image_shape=(16, 16, 3)),
}
flags.DEFINE_list("models", list(BACKBONES) + list(VISION), "Which backbones.")
flags.DEFINE_bool("check", False, "Also compare per-example gradients with a loop.")
flags.DEFINE_enum("signature", "static", ["static", "batch", "length"],
                  "Trace on the batch (static), or under an input signature whose batch "
                  "(batch), or batch and sequence length (length), are known at run time only, "
                  "as a SavedModel's functions are.")
FLAGS = flags.FLAGS


def _features(backbone, x):
    """The backbone's inputs from token ids ``x``: by name where it takes a
    dict or a list of named inputs (Gemma3n's), masks all ones, segments 0."""
    def feature(name):
        return tf.ones_like(x) if "mask" in name else tf.zeros_like(x) if "segment" in name else x

    if isinstance(backbone.input, dict):
        return {k: feature(k) for k in backbone.input}
    if isinstance(backbone.input, list):
        return [feature(t.name) for t in backbone.input]
    return x


def _build_vision(name):
    """An image backbone's ``build``: a Dense classifier on its output (the
    last, where it returns several) averaged over every position."""
    backbone, dense = VISION[name](), keras.layers.Dense(3)
    rng = np.random.RandomState(1)
    shape = [S if d is None else d for d in backbone.inputs[0].shape[1:]]
    x = tf.constant(rng.normal(size=(B, *shape)).astype("float32"))

    def loss_fn(x, y):
        out = backbone(x)
        if isinstance(out, dict):
            out = out.get("sequence_output", list(out.values())[-1])
        pooled = tf.reduce_mean(out, axis=list(range(1, len(out.shape) - 1)))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, dense(pooled)))
    args = (x, tf.constant(rng.randint(0, 3, (B,))))
    return backbone, _registered(loss_fn, args), args, "classifier"


def _registered(loss_fn, args):
    """``loss_fn`` registered as ``--signature`` says: traced on ``args``
    (``static``), or as a ``tf.function`` whose input signature leaves the
    batch (``batch``), or the batch and the sequence length (``length``:
    a text backbone's tokens, ``[None, None]``), unknown until run time."""
    if FLAGS.signature == "static":
        return kg.auto_register(loss_fn)
    unknown = 2 if FLAGS.signature == "length" and args[0].shape.rank == 2 else 1
    signature = [tf.TensorSpec([None] * min(unknown, a.shape.rank) + a.shape.as_list()[unknown:],
                               a.dtype)
                 for a in args]
    return kg.auto_register(tf.function(loss_fn, input_signature=signature))


def build(name):
    """``(backbone, loss_fn, args, head)``: the backbone, a registered loss on it, a batch."""
    keras.utils.set_random_seed(0)
    if name in VISION:
        return _build_vision(name)
    backbone = BACKBONES[name]()
    rng = np.random.RandomState(1)
    x = tf.constant(rng.randint(1, V, (B, T)))
    token = getattr(backbone, "token_embedding", None)
    decoder = not isinstance(backbone.output, dict)  # encoders return their outputs by name
    if decoder and token is not None and "reverse" in token.call.__code__.co_varnames:
        head = "LM head"

        def logits(x):
            h = backbone(_features(backbone, x))
            return token(h[:, -1], reverse=True)
        y = tf.constant(rng.randint(0, V, (B,)))
    else:
        head, dense = "classifier", keras.layers.Dense(3)

        def logits(x):
            out = backbone(_features(backbone, x))
            if isinstance(out, dict):  # an encoder-decoder's: the decoder's
                out = out.get("sequence_output", out.get("decoder_sequence_output"))
            return dense(tf.reduce_mean(out, axis=1))
        y = tf.constant(rng.randint(0, 3, (B,)))

    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits(x)))
    return backbone, _registered(loss_fn, (x, y)), (x, y), head


def loop_error(loss_fn, reg, args) -> float:
    """The largest over examples and variables of ``|got_iv - loop_iv| /
    max(|loop_iv|, 1e-3 |loop_i|)``: each variable on its own (a layer with
    a small share of the gradient hides in the whole gradient's norm), with
    a floor of a thousandth of the example's whole gradient (an attention
    key bias's gradient is zero up to roundoff)."""
    got = kg.per_example_gradients(loss_fn, *args)
    worst = 0.0
    for i in range(B):
        with tf.GradientTape() as tape:
            loss = loss_fn(*[a[i:i + 1] for a in args])
        want = [np.zeros(v.shape) if w is None else tf.convert_to_tensor(w).numpy()
                for v, w in zip(reg.variables, tape.gradient(loss, reg.variables))]
        floor = 1e-3 * np.sqrt(sum(np.sum(w ** 2) for w in want))
        for g, w in zip(got, want):
            err = np.linalg.norm(g[i].numpy() - w) / max(np.linalg.norm(w), floor)
            worst = max(worst, float(err))
    return worst


def report(build_fn, names, check):
    """Prints the table (module docstring) for the backbones ``names``, each
    from ``build_fn(name) -> (backbone, loss_fn, args, head)``; with
    ``check``, the loop error (none where the loss couples its examples: a
    batch of one is another loss)."""
    header = ("| backbone | head | variables | read by the loss | registered | kinds | coupling "
              "| pass s |")
    print(header + (" per-example rel err |" if check else ""))
    print("|---|---|---:|---:|---:|---|---:|---:|" + ("---:|" if check else ""))
    reasons = []
    for name in names:
        backbone, loss_fn, args, head = build_fn(name)
        try:
            loss_fn(*args)
        except Exception as e:  # noqa: BLE001 - the model's own code cannot run so
            print(f"| {name} | {head} | the model does not run: {type(e).__name__} |", flush=True)
            continue
        start = time.perf_counter()
        reg = loss_fn.registration(*args)
        seconds = time.perf_counter() - start
        own = {id(v) for v in backbone.trainable_variables}
        kinds = collections.Counter(layer.kind for layer in reg.layers)
        generic = [layer for layer in reg.layers if layer.kind == "generic"]
        reasons += [f"{name}: {layer.name}: {layer.reason}" for layer in generic]
        read = len(reg.variables) - (2 if head == "classifier" else 0)
        registered = read - sum(len(layer.variables) for layer in generic)
        row = (f"| {name} | {head} | {len(own)} | {read} | {registered} | "
               f"{', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))} | "
               f"{len(reg.coupling)} | {seconds:.2f} |")
        if check:
            row += " - |" if reg.coupling else f" {loop_error(loss_fn, reg, args):.1e} |"
        print(row, flush=True)
    for line in reasons:
        print("generic:", line)


def main(argv):
    del argv
    logging.set_verbosity(logging.ERROR)
    report(build, FLAGS.models, FLAGS.check)


if __name__ == "__main__":
    app.run(main)
