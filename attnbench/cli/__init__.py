"""The ``attnbench`` command line: a thin layer over the Python API, one module per command.

``app`` holds the click group and the entry point; each command module registers itself on the group
when imported here. Errors a user can cause (:class:`~attnbench.errors.AttnbenchError`) print as one line
``error: ...`` and exit with status 2, never with a traceback.

Before the commands are imported (torch, pandas, SciPy: seconds), ``attnbench run`` with the default measuring
environment starts its first measuring worker (:mod:`attnbench.runner.executors.ahead`), which then imports torch
while this process does.
"""

import sys

from attnbench.cli.clock import STARTED  # noqa: F401  (first: the command's start; see attnbench.cli.clock)
from attnbench.runner.executors import ahead  # noqa: E402

ahead.start_for(sys.argv)

from attnbench.cli import adapt, asv, check, ci, listing, profile, report, run  # noqa: E402, F401  (each registers its command)
from attnbench.cli.app import _split, cli, console, err_console, main  # noqa: E402

__all__ = ["_split", "cli", "console", "err_console", "main"]
