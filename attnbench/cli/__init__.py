"""The ``attnbench`` command line: a thin layer over the Python API, one module per command.

``app`` holds the click group and the entry point; each command module registers itself on the group
when imported here. Errors a user can cause (:class:`~attnbench.errors.AttnbenchError`) print as one line
``error: ...`` and exit with status 2, never with a traceback.
"""

from attnbench.cli import asv, check, ci, listing, profile, report, run  # noqa: F401  (each registers its command)
from attnbench.cli.app import _split, cli, console, err_console, main

__all__ = ["_split", "cli", "console", "err_console", "main"]
