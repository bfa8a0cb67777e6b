"""Reproduces GeeeekExplorer/nano-vllm's layout: a package whose ``__init__`` imports its engine (which needs a
dependency that is missing here) and a ``layers/`` folder without ``__init__.py`` under it. Our own code, for tests."""
from nspkg.engine import ENGINE  # noqa: F401
