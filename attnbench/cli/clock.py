"""When the command began: the first thing the ``attnbench`` entry point imports (:mod:`attnbench.cli`) sets it."""

import time

STARTED = time.perf_counter()
"""When the command began (its entry point's first import): its start-up is counted from here, not from the process's
creation, which a shell line (``pip install ... && attnbench run``) made before its earlier commands ran."""
