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
