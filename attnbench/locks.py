"""Lock files: ``flock`` on a small file that also *records* its holder (pid, host, start time, command).

The one primitive both locks are built on: the run folder's writer lock (:mod:`attnbench.results.lock`) and the
machine-wide measurement lock (:mod:`attnbench.measure.machine_lock`).

The kernel releases an ``flock`` when its process dies, however it dies, so a lock is never held by a
dead process; the record is what tells the next process who held it, and whether that holder ended
cleanly (it empties the record on release) or died (the record is still there). Three cases follow:

* **live**: ``flock`` fails: someone holds it now; the caller names the holder from the record.
* **stale, this host**: ``flock`` succeeds but the record names a process of this host: it died
  without releasing (SIGKILL, power loss); the lock is taken over and the caller says so.
* **stale, another host**: ``flock`` succeeds but the record names another host. On a network file
  system ``flock`` may not reach across hosts, so the holder may well be alive there: never taken over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import socket
import sys
import time
from datetime import UTC, datetime
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds (or held) a lock: what its file records."""

    pid: int
    host: str
    started_at: str  # UTC, ISO 8601
    command: str = ""
    purpose: str = ""

    @classmethod
    def me(cls, purpose: str = "") -> Holder:
        """This process, now."""
        return cls(pid=os.getpid(), host=socket.gethostname(), started_at=datetime.now(UTC).isoformat(timespec="seconds"),
                   command=" ".join(_command()), purpose=purpose)

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The holder recorded in a lock file's text; None when empty or unreadable (released cleanly)."""
        try:
            data = json.loads(text)
            return cls(pid=int(data["pid"]), host=str(data["host"]), started_at=str(data.get("started_at", "")),
                       command=str(data.get("command", "")), purpose=str(data.get("purpose", "")))
        except (ValueError, KeyError, TypeError):
            return None

    def as_json(self) -> str:
        """The record written into the lock file."""
        return json.dumps(dataclasses.asdict(self))

    def on_this_host(self) -> bool:
        """Recorded by a process of this machine (so its pid means something here)."""
        return self.host == socket.gethostname()

    def alive(self) -> bool | None:
        """Whether the process still exists: None when it is on another host (unknowable from here)."""
        if not self.on_this_host():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # exists, another user's
            return True
        return True

    def describe(self, ago: bool = True) -> str:
        """``pid 123 on host h since 2026-12-01T15:10:03+00:00 (12 s ago): attnbench run ...`` (``ago``: with the
        "(12 s ago)", which changes as time passes)."""
        since = ""
        with contextlib.suppress(ValueError):
            if ago:
                since = f" ({time.time() - datetime.fromisoformat(self.started_at).timestamp():.0f} s ago)"
        what = self.purpose or self.command
        return f"pid {self.pid} on host {self.host} since {self.started_at}{since}" + (f": {what}" if what else "")


def _command() -> list[str]:
    argv = list(sys.argv) or ["python"]
    if argv and argv[0].endswith(("/attnbench", "attnbench/__main__.py")):
        argv[0] = "attnbench"
    return argv


class LockFile:
    """``flock`` on ``path`` with the holder recorded inside; exclusive, or ``shared`` (many holders, none recorded).

    :meth:`try_acquire` never blocks (callers that wait poll it, so they can say what they wait for and
    stay interruptible). After a successful exclusive acquire, :attr:`previous` is the record the file held
    before (None: it was released cleanly).
    """

    def __init__(self, path: str | Path, shared: bool = False):
        self.path = Path(path)
        self.shared = shared
        self._fd: int | None = None
        self.previous: Holder | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._fd is not None

    def fileno(self) -> int | None:
        """The descriptor holding the lock (None when not held)."""
        return self._fd

    def try_acquire(self, holder: Holder | None = None, record: bool = True) -> bool:
        """Take the lock if it is free; False when someone holds it. An exclusive holder reads the old record
        into :attr:`previous`, then writes ``holder`` (this process) over it unless ``record`` is False."""
        if self._fd is not None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            except BaseException:
                os.close(fd)
                raise
            if self._same_file(fd):
                break
            os.close(fd)  # its holder removed the file as it let go (release(remove=True)): lock the path's file anew
        self._fd = fd
        if not self.shared:
            self.previous = Holder.parse(os.pread(fd, 1 << 16, 0).decode(errors="replace"))
            if record:
                self.record(holder or Holder.me())
        return True

    def record(self, holder: Holder) -> None:
        """(Re)write the holder record (exclusive holders only)."""
        if self._fd is None or self.shared:
            return
        data = holder.as_json().encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def holder(self) -> Holder | None:
        """The holder the file records now (None: free, shared holders only, or released cleanly)."""
        try:
            return Holder.parse(self.path.read_text(errors="replace"))
        except OSError:
            return None

    def _same_file(self, fd: int) -> bool:
        """Whether ``fd`` is still the file at :attr:`path` (not one a holder removed while this process waited)."""
        try:
            here, there = os.fstat(fd), os.stat(self.path)
        except FileNotFoundError:
            return False
        return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)

    def release(self, keep_record: bool = False, remove: bool = False) -> None:
        """Let go: the record is emptied first (a clean release), unless ``keep_record`` (not ours to clear);
        ``remove``: the file is deleted while still held (an exclusive holder only), so that no empty lock file stays
        behind; a process that opened it meanwhile sees it gone and locks the path's new file instead."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if not self.shared and not keep_record:
                os.ftruncate(fd, 0)
                if remove:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.path)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __del__(self) -> None:  # an abandoned lock object (an exception before release) lets go, cleanly: its
        with contextlib.suppress(Exception):  # process is alive and done with it, so the next holder takes over nothing
            self.release()
