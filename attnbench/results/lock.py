"""The run lock: one writer per run folder (built on :mod:`attnbench.locks`, the lock-file primitive).

The run lock (:func:`lock_run`) is ``<run folder>/.lock``: the process writing a run holds it from opening
the folder until it has consolidated the results, so a second writer (``--resume`` of a live run, the same
``--run-id``) stops with one line naming the holder (:class:`RunLockedError`, exit 2). A holder that died
(SIGKILL) is taken over, said; one recorded on another host never is.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from attnbench.errors import ResultsError
from attnbench.locks import Holder, LockFile


RUN_LOCK_NAME = ".lock"
"""The lock file inside a run folder."""


class RunLockedError(ResultsError):
    """Another process is writing this run folder (or held it on another host and may still)."""


@dataclasses.dataclass
class RunLock:
    """The lock a process holds on a run folder while it writes it."""

    file: LockFile
    took_over: Holder | None = None  # the dead holder whose lock this one took over

    def takeover_note(self) -> str | None:
        """What happened, for the output and ``meta.json``; None when the lock was free."""
        if self.took_over is None:
            return None
        p = self.took_over
        return (f"took over the run lock of pid {p.pid} on {p.host} (held since {p.started_at}), which ended "
                "without releasing it (killed?); cells it finished are kept, cells it was measuring are measured again")

    def release(self) -> None:
        """Let go of the run folder; the lock file goes too (a finished run keeps no empty ``.lock``)."""
        self.file.release(remove=True)


def lock_run(folder: str | Path, purpose: str = "") -> RunLock:
    """Take the writer's lock of run ``folder`` (created when missing), or raise :class:`RunLockedError`."""
    folder = Path(folder)
    lock = LockFile(folder / RUN_LOCK_NAME)
    if not lock.try_acquire(record=False):
        holder = lock.holder()
        who = holder.describe() if holder else "another process (it has not recorded itself yet)"
        raise RunLockedError(f"{folder} is being written by {who}; wait until it finishes (or stop it), "
                             "then resume it if cells are missing")
    previous = lock.previous
    if previous is None:
        lock.record(Holder.me(purpose))
        return RunLock(lock)
    if not previous.on_this_host():
        lock.release(keep_record=True)  # its record stays: only a person who knows that host can clear it
        raise RunLockedError(f"{folder} is locked by {previous.describe()}, on another host, so whether it still "
                             f"runs cannot be checked from here; if it has ended, delete {lock.path} and try again")
    lock.record(Holder.me(purpose))
    return RunLock(lock, took_over=previous)
