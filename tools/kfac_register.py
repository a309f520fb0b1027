"""``python -m tools.kfac_register``: the registration report as a tool.

The same front end as ``python -m kfac_graph``: with no flags it registers
the built-in Keras CNN; ``--saved_model DIR --function NAME`` registers a
saved function; ``--dot PATH`` writes a Graphviz picture.
"""
from kfac_graph.__main__ import run

if __name__ == "__main__":
    run()
