"""What a result was measured on: versions, hardware, threads, commit, command line."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

from attnbench.devices import cpu_model, cuda_available


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): other work on the machine skews timings."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def cpu_busy_fraction(window_s: float = 0.5) -> float | None:
    """Fraction of all cores' time spent busy over ``window_s`` (Linux ``/proc/stat``; None elsewhere).

    Taken just before a run starts, this is other work competing for the cores; unlike the load
    average it does not lag behind by a minute (so the previous run does not count against this one).
    """
    def snapshot() -> tuple[int, int] | None:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        except (OSError, ValueError, IndexError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    import time

    first, own_first = snapshot(), _own_ticks()
    if first is None:
        return None
    time.sleep(window_s)
    second, own = snapshot(), _own_ticks() - own_first
    total, idle = second[0] - first[0], second[1] - first[1]
    return round(max(1 - idle / total - own / total, 0.0), 3) if total > 0 else None


class BusySample:
    """:func:`cpu_busy_fraction` taken in a thread of its own, so that this process prepares its run during the
    window instead of sleeping through it (its own work and its children's are left out of the fraction either
    way); :meth:`result` waits for the window's end."""

    def __init__(self, window_s: float = 0.5) -> None:
        import threading

        self._value: float | None = None
        self._thread = threading.Thread(target=self._take, args=(window_s,), name="attnbench-busy-sample", daemon=True)
        self._thread.start()

    def _take(self, window_s: float) -> None:
        self._value = cpu_busy_fraction(window_s)

    def result(self) -> float | None:
        """The fraction (None where it cannot be measured), once the window has passed."""
        self._thread.join()
        return self._value


def _own_ticks() -> int:
    """CPU ticks (user + system) of this process and every live descendant (``/proc``; 0 where unreadable), so that
    :func:`cpu_busy_fraction` does not count this run's own work, e.g. a measuring worker started ahead that is
    importing torch, as other load."""
    ticks, todo, seen = 0, [str(os.getpid())], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += (task / "children").read_text().split()
        except (OSError, ValueError, IndexError):
            continue
    return ticks


def installed_version() -> str:
    """attnbench's version as installed (the package metadata; read without importing the package's API)."""
    try:
        return importlib.metadata.version("attnbench")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def git_commit(path: str | Path | None = None) -> str | None:
    """The commit of the git checkout containing ``path`` (default: the working directory), with ``-dirty``."""
    cwd = Path(path) if path else Path.cwd()
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=5)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def collect(argv: list[str] | None = None, busy: BusySample | None = None) -> dict:
    """Run metadata: timestamp, command line, commit, versions, CPU, GPUs and driver, threads, hostname, how busy the
    CPUs were (``busy``: a sample taken alongside, whose value this waits for)."""
    busy = busy or BusySample()  # its window passes while the rest is collected
    meta = {
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(argv if argv is not None else sys.argv),
        "git_commit": git_commit(),
        "attnbench_version": installed_version(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": load_average(),
        "cpu_busy_before_run": None,  # below, in this place
        "cuda_version": torch.version.cuda,
        "gpus": [],
        "cuda_driver": None,
    }
    if cuda_available():
        meta["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            meta["cuda_driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError, IndexError):
            meta["cuda_driver"] = None
    meta["cpu_busy_before_run"] = busy.result()
    return meta
