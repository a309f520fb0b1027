"""``python -m kfac_graph``: launches the ``kfac-graph`` tool (``tools/kfac_register.py``).

The one module of kfac_graph allowed to import ``tools``: nothing imports
``__main__``, so the package itself never depends on its command-line front ends.
"""
from tools.kfac_register import run

if __name__ == "__main__":
    run()
