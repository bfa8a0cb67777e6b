"""Nothing a run starts outlives it: measuring workers die with their driver, and the next run ends any that did not.

* :func:`worker_command` (and :func:`die_with_parent` again in the worker): ``prctl(PR_SET_PDEATHSIG, SIGKILL)``
  through ctypes, before anything is imported, so the kernel kills the worker when its driver dies, however it dies
  (``SIGKILL`` included); a driver already gone by then ends the worker at once. Linux only; elsewhere the worker
  still ends at the end of its input. The kernel ties the signal to the thread that started the worker: a worker
  started from a thread (a run inside ``threading.Thread``) ends with that thread, and a pool that kept it starts
  another.
* Each worker is the leader of its own process group (``start_new_session``): the driver kills the group, so
  whatever the worker started (compile workers) goes too (:func:`kill_group`).
* Workers inherit the driver's machine-lock descriptors (:meth:`attnbench.measure.machine_lock.Held.fds`): a worker
  that survived its driver still holds the lock, so no other measurement times next to it.
* :func:`end_orphans` (when a run makes its workers): a worker whose driver is gone (its parent is no longer the
  driver named on its command line) is killed, and named in one line.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

WORKER_MODULE = "attnbench.runner.executors.worker"
PR_SET_PDEATHSIG = 1


_BOOT = f"""import ctypes, os, sys
try:
    ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG}, {int(signal.SIGKILL)}, 0, 0, 0)
except Exception:
    pass
if os.getppid() != int(sys.argv[3]):
    os._exit(1)
import runpy
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""
"""Armed before anything is imported (importing attnbench imports torch: seconds in which a killed driver's worker
would otherwise live on), then the worker module runs as ``python -m`` would run it."""


def worker_command(label: str, driver_pid: int) -> list[str]:
    """The command line of a measuring worker for the driver ``driver_pid``: it dies with the driver from its first
    instruction, and its arguments name the module, its label and the driver (what :func:`find_orphans` reads)."""
    return [sys.executable, "-c", _BOOT, WORKER_MODULE, label, str(driver_pid)]


def die_with_parent(driver_pid: int | None) -> bool:
    """Ask the kernel to ``SIGKILL`` this process when its parent dies; exit now if the driver is gone already.
    True when the kernel agreed (Linux)."""
    armed = False
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    if driver_pid and os.getppid() != driver_pid:  # died before the signal was armed
        os._exit(1)
    return armed


def kill_group(pid: int) -> None:
    """``SIGKILL`` the process group led by ``pid`` (a worker and what it started), or the process alone."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])  # the command may contain spaces and parentheses


def find_orphans() -> list[tuple[int, int]]:
    """``(pid, driver_pid)`` of this user's measuring workers whose driver is gone (Linux ``/proc``; else none)."""
    found = []
    uid = os.getuid()
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if WORKER_MODULE not in args:
            continue
        rest = args[args.index(WORKER_MODULE) + 1:]
        driver = int(rest[1]) if len(rest) > 1 and rest[1].isdigit() else None
        ppid = _ppid(int(entry.name))
        if driver is not None and ppid is not None and ppid != driver:
            found.append((int(entry.name), driver))
    return found


def end_orphans(say: Callable[[str], None]) -> list[int]:
    """Kill every orphaned measuring worker of this user (:func:`find_orphans`), saying so; their pids."""
    ended = []
    for pid, driver in find_orphans():
        kill_group(pid)
        ended.append(pid)
        say(f"note: ended an orphaned attnbench measuring worker (pid {pid}); its driver (pid {driver}) is gone, "
            "and it would have measured beside this run")
    return ended
