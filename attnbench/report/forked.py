"""Work of the report done in a forked process, on a core the report would otherwise leave idle.

A report is drawn after the run, when the measuring workers have ended: matplotlib draws on one core and the
machine's others wait. :class:`Forked` starts ``fn()`` in a child made by ``os.fork`` (it inherits the prepared data,
the imports and the render settings, so nothing is pickled on the way in) and :meth:`Forked.result` returns its
value, pickled back through a pipe. The child writes its own figure files. Where there is no ``fork``, one usable
core, or ``ATTNBENCH_REPORT_FORK=0``, ``fn`` runs in this process when its result is asked for.

Nothing is lost and nothing hangs: when the child raises, dies or does not answer within ``timeout_s`` (it is then
killed), ``fn()`` runs again here, so its error (if it has one) is raised in this process as it would have been, and a
note on stderr says what happened to the child.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import sys
import time
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

ENV = "ATTNBENCH_REPORT_FORK"
TIMEOUT_S = 300.0


def can_fork() -> bool:
    """Whether a child can draw alongside: ``os.fork`` exists, two or more cores are usable, and not switched off."""
    if os.environ.get(ENV, "1").strip() in ("0", "no", "false", "off") or not hasattr(os, "fork"):
        return False
    try:
        return len(os.sched_getaffinity(0)) >= 2
    except (AttributeError, OSError):
        return (os.cpu_count() or 1) >= 2


class Forked(Generic[T]):
    """``fn()`` running in a forked child from now on; :meth:`result` waits for its value."""

    def __init__(self, fn: Callable[[], T], timeout_s: float = TIMEOUT_S):
        self.fn, self.timeout_s = fn, timeout_s
        self.pid: int | None = None
        self.fd = -1
        if can_fork():
            self._start()

    def _start(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: answer once, then leave without running the parent's exit handlers
            os.close(read_fd)
            code = 0
            try:
                payload = pickle.dumps((True, self.fn()))
            except BaseException as exc:  # noqa: BLE001  (reported to the parent, which runs fn again)
                payload, code = pickle.dumps((False, f"{type(exc).__name__}: {exc}")), 1
            try:
                with os.fdopen(write_fd, "wb") as out:
                    out.write(payload)
            finally:
                os._exit(code)
        os.close(write_fd)
        self.pid, self.fd = pid, read_fd
        # a result never asked for (the report raised first): the child is ended and reaped when this is collected
        self._abandon = weakref.finalize(self, _end, pid, read_fd)

    def result(self) -> T:
        """The child's value; ``fn()`` run here when there is no child or it failed (a note says why)."""
        if self.pid is None:
            return self.fn()
        data, why = self._collect()
        if why is None:
            try:
                ok, value = pickle.loads(data)
            except Exception as exc:  # noqa: BLE001
                ok, value = False, f"its answer could not be read ({type(exc).__name__}: {exc})"
            if ok:
                return value
            why = value
        print(f"note: report work done again in this process: the forked process failed: {why}", file=sys.stderr)
        return self.fn()

    def _collect(self) -> tuple[bytes, str | None]:
        """Everything the child wrote and, when it did not answer, why (it is killed past ``timeout_s``)."""
        self._abandon.detach()
        chunks, deadline = [], time.monotonic() + self.timeout_s
        try:
            while True:
                left = deadline - time.monotonic()
                ready = select.select([self.fd], [], [], max(left, 0.0))[0] if left > 0 else []
                if not ready:
                    _end(self.pid, self.fd)
                    return b"", f"no answer within {self.timeout_s:g} s (killed)"
                chunk = os.read(self.fd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        except BaseException:
            _end(self.pid, self.fd)  # interrupted while waiting: the child goes too
            raise
        os.close(self.fd)
        _, status = os.waitpid(self.pid, 0)
        data = b"".join(chunks)
        if not data:
            return data, f"it ended with wait status {status} and no answer"
        return data, None


def _end(pid: int, fd: int) -> None:
    """End a child whose answer nobody will read: close the pipe, kill it and reap it."""
    with contextlib.suppress(OSError):
        os.close(fd)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
