"""Plug-in code that ends the process (``sys.exit``, ``os._exit``) is reported as such, never as a silent exit.

While plug-in code runs (importing a plug-in file, constructing, a correctness case, a measured cell), the two
exits raise :class:`PluginExit` instead, so the case or the cell becomes an ``error`` with what it called, and
the command goes on to say so and exit non-zero. This is interception in the process that runs the plug-in:
it covers the Python-level calls (``sys.exit``, ``os._exit``, ``raise SystemExit``); a plug-in that ends the
process some other way (``posix._exit``, a C extension calling ``exit()``, a crash) is only seen by a parent
process, which names it with :func:`describe_exit` (as the measuring workers' driver does).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager


class PluginExit(Exception):
    """Plug-in code called ``sys.exit``/``os._exit``; an ``Exception``, so it fails the case or cell it ran in."""


@contextmanager
def plugin_exits(what: str = "the implementation") -> Iterator[None]:
    """Inside: ``os._exit(n)`` and ``sys.exit(n)`` (and a ``SystemExit`` leaving the block) raise
    :class:`PluginExit` naming ``what`` and the call; outside, both are restored."""
    real_exit, real_sys_exit = os._exit, sys.exit

    def fake_os_exit(status=0):
        raise PluginExit(f"{what} called os._exit({status}) (it would have ended the process)")

    def fake_sys_exit(status=None):
        raise PluginExit(f"{what} called sys.exit({status!r}) (it would have ended the process)")

    os._exit, sys.exit = fake_os_exit, fake_sys_exit
    try:
        yield
    except SystemExit as exc:
        raise PluginExit(f"{what} raised SystemExit({exc.code!r}) (it would have ended the process)") from None
    finally:
        os._exit, sys.exit = real_exit, real_sys_exit


def describe_exit(returncode: int | None) -> str:
    """What a process that ran plug-in code died of, from its exit status (``Popen.returncode`` convention):
    a signal by name, or an exit status that nobody asked for (plug-in code ending the process)."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return (f"exited with status {returncode} before it finished (something in the implementation's code ended "
            "the process: os._exit, sys.exit or exit() from a C extension)")
