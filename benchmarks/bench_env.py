"""Imported first by every benchmark script: quiets TensorFlow's logs and puts
the repository on the import path (the scripts run as ``python benchmarks/x.py``,
which puts only ``benchmarks/`` there)."""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("ABSL_MIN_LOG_LEVEL", "3")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
