"""Packaging for kfac_graph: K-FAC and per-example gradients found by a graph pass."""
from setuptools import find_packages, setup

setup(
    name="kfac_graph",
    version="0.1.0",
    description=("K-FAC and per-example gradients for TensorFlow 2, registered "
                 "automatically by a compiler pass over the traced graph."),
    packages=find_packages(include=["kfac_graph", "kfac_graph.*", "passes", "passes.*", "tools"]),
    python_requires=">=3.10",
    install_requires=["tensorflow>=2.16", "tensorboard", "networkx>=3.0", "numpy", "absl-py", "dp-accounting"],
    extras_require={"test": ["pytest", "pytest-xdist", "hypothesis", "scikit-learn",
                             "keras-hub", "tf_keras"],
                    "bench": ["scikit-learn", "matplotlib"]},
    entry_points={"console_scripts": ["kfac-graph=tools.kfac_register:run",
                                        "kfac-rewrite=tools.kfac_rewrite:run"]},
)
