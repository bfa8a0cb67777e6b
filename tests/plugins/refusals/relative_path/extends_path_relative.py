"""Reproduces kimiyoung/transformer-xl ``pytorch/mem_transformer.py``: a script that extends ``sys.path`` with a folder
relative to the working directory (``sys.path.append('utils')``) and imports a module of its repository from there,
which works only when run from the folder it expects. Our own code, written for attnbench's tests."""
import sys

sys.path.append("helpers")
from attnbench_relative_helper import SCALE  # noqa: E402,F401
