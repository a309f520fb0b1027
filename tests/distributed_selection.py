"""Which distributed runs a session needs: a fixture trains only the
configurations (``distributed_support.CONFIGS``) its selected tests read."""

import pytest
from distributed_support import CONFIGS

# the configs the fast test set trains; the others' tests run under -m slow
FAST = ("regular",)


def params():
    """``CONFIGS`` as test parameters: those ``FAST`` in the fast set, the
    others marked slow."""
    return [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CONFIGS]


def module_items(request):
    """The session's selected test items of the fixture's module."""
    return [item for item in request.session.items if item.module is request.module]


def selected_ids(items):
    """The parameter ids of the test ``items``."""
    return {part for item in items if "[" in item.nodeid
            for part in item.nodeid.split("[", 1)[1].rstrip("]").split("-")}


def selected(items):
    """The configs that the selected test ``items`` read (by their parameter
    ids): a fixture trains those alone."""
    ids = selected_ids(items)
    return [c for c in CONFIGS if c in ids]


# the mirrored runs beside the configs' (distributed_support.OPTIONS, and the
# checkpoint round trip) -> the test that reads them
OPTION_TESTS = {
    "qmodel_fraction": "test_qmodel_batch_fraction_takes_each_replicas_first_examples",
    "spread": "test_spread_covariances_take_each_replicas_own_slice",
    "stride": "test_spread_slices_every_other_step_take_each_replicas_own_slice",
    "checkpoint": "test_checkpoint_resume_matches_uninterrupted",
}


def selected_options(items):
    """``"option:sync:sync,..."``: the runs of ``OPTION_TESTS`` that the
    selected test ``items`` read, with the statistics syncs they read (a
    test without a sync parameter reads the lazy run)."""
    out = []
    for option, test in OPTION_TESTS.items():
        mine = [i for i in items if i.originalname == test]
        if mine:
            ids = selected_ids(mine)
            syncs = [s for s in ("lazy", "eager") if s in ids] or ["lazy"]
            out.append(":".join([option, *syncs]))
    return ",".join(out)
