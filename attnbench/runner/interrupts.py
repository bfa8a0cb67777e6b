"""SIGTERM and SIGHUP handled like Ctrl-C: what ``timeout``, CI cancellation and a closed terminal send.

:func:`install` (the CLI does it first) makes both raise :class:`Terminated`, a ``KeyboardInterrupt``, in the main
thread, so every path that keeps finished rows on Ctrl-C keeps them here too: the run stops its workers, stores what
finished, says so in one line and exits ``128 + signal`` (143 for SIGTERM, 129 for SIGHUP; 130 for Ctrl-C).
:func:`deferred` holds further signals back while a run writes its folder, then delivers the first.
"""

from __future__ import annotations

import contextlib
import signal
import threading

HANDLED = ("SIGTERM", "SIGHUP")
_deferring: list[int] = []  # signals that arrived inside deferred()
_active = {"deferring": False}


class Terminated(KeyboardInterrupt):
    """The process was asked to stop by ``signum`` (SIGTERM or SIGHUP)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _handler(signum, frame):
    if _active["deferring"]:
        _deferring.append(signum)
        return
    raise Terminated(signum)


def install() -> None:
    """SIGTERM and SIGHUP raise :class:`Terminated` (main thread only; signals a parent ignores stay ignored)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for name in HANDLED:
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _handler)


@contextlib.contextmanager
def deferred(deliver: bool = True):
    """Within the block a SIGTERM or SIGHUP is held back (Ctrl-C is not); the first one is raised after it
    (``deliver``), or dropped (the process is stopping for an earlier one already)."""
    outer = _active["deferring"]
    _active["deferring"] = True
    try:
        yield
    finally:
        _active["deferring"] = outer
        if not outer and _deferring and not deliver:
            _deferring.clear()
        if not outer and _deferring:
            signum = _deferring[0]
            _deferring.clear()
            raise Terminated(signum)


def signal_of(exc: BaseException) -> int:
    """The signal behind an interrupt: the :class:`Terminated` one, else SIGINT (Ctrl-C)."""
    return getattr(exc, "signum", int(signal.SIGINT))


def exit_code(signum: int) -> int:
    """The shell's exit status for a process ended by ``signum``: ``128 + signum``."""
    return 128 + int(signum)


def name(signum: int) -> str:
    return signal.Signals(signum).name
