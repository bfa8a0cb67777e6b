"""The ``attnbench`` command line: a thin layer over the Python API.

Errors a user can cause (:class:`~attnbench.errors.AttnbenchError`) print as one line
``error: ...`` and exit with status 2, never with a traceback.
"""

from __future__ import annotations

import sys

import click
from rich.console import Console

from attnbench.errors import AttnbenchError
from attnbench.runner import interrupts

# Wide when piped (logs, CI): rich would otherwise wrap every table at 80 columns.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def _split(values: tuple[str, ...]) -> list[str]:
    """Flatten ``--impl a,b --impl c`` into ``[a, b, c]``."""
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="attnbench")
def cli() -> None:
    """Correctness, speed and memory of multi-head attention implementations in PyTorch.

    \b
    attnbench list                 implementations and where they run
    attnbench check [--impl NAME]  the correctness matrix against a float64 reference
    attnbench run                  a benchmark sweep (default: a small CPU grid)
    attnbench report RESULTS       plots and an HTML page for a run
    attnbench compare A B          two runs, cell by cell, with significance
    attnbench profile --impl NAME  torch.profiler traces for TensorBoard / Perfetto
    """


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: user errors become one line and exit status 2; SIGTERM and SIGHUP are handled
    like Ctrl-C (:mod:`attnbench.runner.interrupts`: one line, exit 143 / 129)."""
    interrupts.install()
    try:
        cli.main(args=argv, prog_name="attnbench", standalone_mode=False)
    except click.exceptions.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except AttnbenchError as exc:
        err_console.print(f"error: {exc}", markup=False)
        sys.exit(2)
    except interrupts.Terminated as exc:
        err_console.print(f"terminated by {interrupts.name(exc.signum)}", markup=False)
        sys.exit(interrupts.exit_code(exc.signum))
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
