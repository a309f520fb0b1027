"""The start of a script run by a fresh interpreter in which kfac_graph (and
``passes``, ``tools``) can be neither found nor imported: what a user of a
rewritten model has. It imports ``os`` and ``sys``."""

import textwrap

NO_LIBRARY = textwrap.dedent("""
    import importlib.abc, os, sys
    sys.path[:] = [p for p in sys.path if p and not os.path.isdir(os.path.join(p, "kfac_graph"))]
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("kfac_graph", "passes", "tools"):
                raise ImportError(f"{name} must not be imported")
            return None

    sys.meta_path.insert(0, Block())
""")
