"""The ``attnbench`` command line: a thin layer over the Python API.

Errors a user can cause (:class:`~attnbench.errors.AttnbenchError`) print as one line ``error: ...`` (a long one
as that headline and a few short indented lines: :func:`~attnbench.errors.refusal_lines`) and exit with status 2,
never with a traceback. Warnings raised on the way are shown after what the command printed.
"""

from __future__ import annotations

import os
import sys
import warnings

import click
from rich.console import Console

from attnbench.errors import AttnbenchError, refusal_lines
from attnbench.runner import interrupts

PIPED_WIDTH = 200
"""Columns of the console when stdout is not a terminal and ``COLUMNS`` is not set (logs, CI): rich would otherwise
wrap every table at 80 columns."""


def console_width(stream=None, environ=None) -> int | None:
    """The console's width: ``None`` (rich asks the terminal, or reads ``COLUMNS``) on a terminal or when ``COLUMNS``
    is set to a number, else :data:`PIPED_WIDTH`. ``COLUMNS`` is how a user sizes output to a file or a pipe."""
    stream = sys.stdout if stream is None else stream
    environ = os.environ if environ is None else environ
    if stream.isatty() or str(environ.get("COLUMNS", "")).strip().isdigit():
        return None
    return PIPED_WIDTH


console = Console(highlight=False, width=console_width())
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
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            cli.main(args=argv, prog_name="attnbench", standalone_mode=False)
    except click.exceptions.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except AttnbenchError as exc:
        for line in refusal_lines(exc):  # a headline naming the first cause, then a few short indented lines
            err_console.print(line, markup=False)
        sys.exit(2)
    except interrupts.Terminated as exc:
        err_console.print(f"terminated by {interrupts.name(exc.signum)}", markup=False)
        sys.exit(interrupts.exit_code(exc.signum))
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    finally:
        _shown_after(caught)


def _shown_after(caught: list) -> None:
    """Show the warnings a command raised (a user's module warning at import, torch's at construction) after what it
    printed: a refusal's first line is its cause, never a warning on the way to it."""
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
