"""Was a process killed by the kernel's OOM killer? What the kernel's counters can prove.

A process the OOM killer ends dies of ``SIGKILL`` and says nothing. The evidence is in the kernel's counters: the
cgroup's ``memory.events`` ``oom_kill`` (cgroup v2, this process's cgroup and its parents) and ``/proc/vmstat``
``oom_kill`` (the whole machine). :func:`snapshot` reads them before a cell and :func:`explain` compares after a
death: a ``SIGKILL`` while a counter rose is an OOM kill (a count, not the victim's pid: another process may have been
killed in the same moment); a ``SIGKILL`` with counters unchanged is something else; no counter readable, it says so.
"""

from __future__ import annotations

import signal
from pathlib import Path


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _field(text: str | None, name: str) -> int | None:
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if key == name and value.strip().isdigit():
            return int(value)
    return None


def counter_files(proc_self: Path = Path("/proc/self"), root: Path = Path("/sys/fs/cgroup"),
                  vmstat: Path = Path("/proc/vmstat")) -> list[tuple[Path, str]]:
    """``(file, key)`` of every OOM-kill counter that applies to this process."""
    files = [(vmstat, "oom_kill")]
    text = _read(proc_self / "cgroup") or ""
    rel = next((line.split("::", 1)[1].strip() for line in text.splitlines() if line.startswith("0::")), None)
    if rel is not None:
        path = root / rel.lstrip("/")
        while True:
            files.append((path / "memory.events", "oom_kill"))
            if path == root or path.parent == path:
                break
            path = path.parent
    return files


def snapshot(files: list[tuple[Path, str]] | None = None) -> dict[str, int]:
    """The readable counters now: ``{file: count}``."""
    out = {}
    for path, key in files if files is not None else counter_files():
        value = _field(_read(path), key)
        if value is not None:
            out[str(path)] = value
    return out


def explain(returncode: int | None, before: dict[str, int], after: dict[str, int]) -> str | None:
    """Why a process that ended with ``returncode`` died, when it was a ``SIGKILL``: the OOM killer (a counter rose),
    not it (none rose), or cannot tell (none readable). None for any other end."""
    if returncode != -signal.SIGKILL:
        return None
    rose = [f"{path} oom_kill {before[path]} -> {after[path]}" for path in before
            if path in after and after[path] > before[path]]
    if rose:
        return f"killed by the kernel's OOM killer (SIGKILL while {'; '.join(rose)})"
    if before and after:
        return ("killed with SIGKILL, not by the OOM killer as far as the kernel's counters show (oom_kill unchanged "
                "in " + ", ".join(sorted(after)) + "): another process or a person killed it")
    return "killed with SIGKILL (perhaps the kernel's OOM killer: no OOM counter is readable here)"


def is_oom(text: str | None) -> bool:
    return bool(text) and text.startswith("killed by the kernel's OOM killer")
