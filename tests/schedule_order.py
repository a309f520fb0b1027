"""The order the test files are handed to the workers in: the longest
first, so that the run does not end with one worker on a long file while
the other waits (``pytest -n 2 --dist loadfile --no-loadscope-reorder``;
xdist's own order puts the files with the most tests first, and a file of
a few tests behind a long fixture, such as the distributed ones, came
last). The order changes no test's result.

``LONGEST``: the longest files of the fast set, longest first, by their
summed call and setup times (``pytest --durations=0``); every other file
follows in collection order."""

LONGEST = (
    "test_distributed_mirrored.py",
    "test_keras_hub.py",
    "test_ggn_loss.py",
    "test_dp_model.py",
    "test_per_token_training.py",
    "test_rewrite.py",
    "test_optimizer.py",
    "test_normalization_family.py",
    "test_unit_axes.py",
    "test_conv_any_size.py",
    "test_shape_probe.py",
    "test_lora.py",
    "test_grouped_conv3d.py",
    "test_raw_ops_models.py",
    "test_loss_terms.py",
    "test_distributed_keras.py",
    "test_training_recipes.py",
    "test_cap_watch.py",
    "test_fisher_compile.py",
    "test_transformer_layers.py",
    "test_privacy_clipping.py",
    "test_distributed_multiworker.py",
    "test_joined_outputs.py",
    "test_stacked_dense.py",
    "test_applications_register.py",
    "test_verify.py",
    "test_grouped_dense.py",
    "test_weights_left.py",
    "test_keras_layers_sweep.py",
)


def longest_first(items) -> list:
    """``items`` (pytest's collected tests) with the ``LONGEST`` files'
    first, in that order; within a file, and among the other files, the
    collected order is kept."""
    rank = {name: k for k, name in enumerate(LONGEST)}

    def key(indexed):
        k, item = indexed
        return rank.get(item.nodeid.split("::")[0].rsplit("/", 1)[-1], len(LONGEST)), k

    return [item for _, item in sorted(enumerate(items), key=key)]
