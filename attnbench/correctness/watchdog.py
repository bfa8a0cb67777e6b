"""A timeout for each case of the correctness matrix, so a hanging implementation fails ``attnbench check`` instead of
hanging it.

:func:`case_deadline` arms two clocks around a case, both cheap (no process per case, so the normal check is no
slower):

* ``SIGALRM`` after ``seconds`` raises :class:`CaseTimeout` in the main thread: a hang in Python (a loop, a sleep,
  a wait) becomes a failed case naming the timeout, and the matrix goes on (the implementation's remaining cases
  are not run: it hung once);
* :func:`faulthandler.dump_traceback_later` after ``seconds + GRACE_S``: a hang the alarm cannot interrupt (inside
  native code) ends the process with exit status 1 and a traceback of where each thread was, written by
  faulthandler's own thread, which needs no Python lock.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
import threading

DEFAULT_S = 60.0
"""Each case's default timeout: the cases are tiny; a case still running after a minute is hung."""
COMPILED_DEFAULT_S = 300.0
"""The default for ``compiled:`` implementations: each new shape compiles."""
GRACE_S = 30.0
"""Seconds past the timeout after which the process is ended (the alarm could not interrupt the case)."""


class CaseTimeout(BaseException):
    """A case ran past its timeout (a BaseException, so that the case's own ``except Exception`` cannot keep it)."""


def default_for(impl_name: str) -> float:
    return COMPILED_DEFAULT_S if impl_name.startswith("compiled:") else DEFAULT_S


@contextlib.contextmanager
def case_deadline(seconds: float | None, what: str = "case"):
    """Raise :class:`CaseTimeout` after ``seconds`` and end the process ``GRACE_S`` later (see the module); None: no
    timeout. Outside the main thread only the last resort applies."""
    if not seconds:
        yield
        return
    main = threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGALRM")

    def on_alarm(signum, frame):
        raise CaseTimeout(f"timeout: {what} exceeded its timeout of {seconds:g} s (--case-timeout SECONDS or none "
                          "to change it)")

    previous = signal.signal(signal.SIGALRM, on_alarm) if main else None
    if main:
        signal.setitimer(signal.ITIMER_REAL, seconds)
    with contextlib.suppress(ValueError, RuntimeError, OSError):  # no usable stderr: the alarm still applies
        faulthandler.dump_traceback_later(seconds + GRACE_S, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        if main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
