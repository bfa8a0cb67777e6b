"""One measurement at a time per machine: a lock that every attnbench measurement takes while it times.

Two processes timing on the same cores spoil each other's numbers (and an asv gate next to a test suite
raises false alarms). So ``attnbench run``, the asv suite and the fidelity and reproducibility tools take
this lock while they time, and only then: reports, checks and builds never take it.

* **Where**: lock files in the user's cache folder, ``~/.cache/attnbench/locks/`` (``$XDG_CACHE_HOME`` is
  honoured; ``$ATTNBENCH_LOCK_DIR`` overrides both, read in :func:`lock_dir` only). File names carry the
  host name, so a home folder shared by several machines still gives one lock per machine. Another user's
  measurements on the same machine are not seen (their cache folder is theirs).
* **Per device on GPUs**: ``machine-<host>.lock`` is the host's; a CPU measurement takes it exclusively.
  A CUDA measurement takes it *shared* plus ``machine-<host>-cuda-<id>.lock`` of its GPU exclusively
  (``<id>``: the physical GPU, through ``CUDA_VISIBLE_DEVICES``), so measurements on different GPUs run
  side by side but never next to a CPU measurement, which needs every core (as the Ray executor's slots).
* **Waiting**: a second measurement waits, saying once what it waits for (pid, host, since when, what it
  runs) and, when it gets the lock, how long it waited. ``no-wait`` raises :class:`MachineBusyError`
  (exit 2) instead, ``off`` (``--allow-concurrent``) skips the lock, for people who accept the noise.
* **Nesting**: a holder exports ``$ATTNBENCH_MACHINE_LOCK_HELD`` (its pid): a process it starts (the
  reproducibility tool's runs, the asv gate's benchmarks) finds the lock held by that pid and measures
  under it instead of waiting for its own parent; the holding process itself may ask again, too.

The lock is ``flock`` on a file recording its holder (:mod:`attnbench.locks`), so a holder that dies
releases it: nothing is ever stuck behind a killed measurement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from attnbench.errors import AttnbenchError
from attnbench.locks import Holder, LockFile

ENV_DIR = "ATTNBENCH_LOCK_DIR"
"""Environment variable naming the folder of the lock files (default ``~/.cache/attnbench/locks``)."""
HELD_ENV = "ATTNBENCH_MACHINE_LOCK_HELD"
"""Set (to the holder's pid) while a process holds the lock: its children measure under it."""
POLICIES = ("wait", "no-wait", "off")
"""``wait`` (default), ``no-wait`` (``--no-wait``: fail at once), ``off`` (``--allow-concurrent``)."""
_HELD_HERE: weakref.WeakSet[LockFile] = weakref.WeakSet()
"""The lock files this process holds: asking again in the same process (a run inside a ``with measuring()``)
measures under the lock it has rather than waiting for itself."""
POLL_S = 0.25
"""How often a waiting process tries again (``flock`` is polled so the wait can say who holds it, and Ctrl-C works)."""


class MachineBusyError(AttnbenchError):
    """Another measurement holds this machine and the caller asked not to wait (``--no-wait``)."""


def lock_dir() -> Path:
    """The folder of the machine locks: ``$ATTNBENCH_LOCK_DIR``, else ``<user cache>/attnbench/locks``."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "attnbench" / "locks"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def gpu_id(device: str) -> str:
    """The physical GPU behind ``cuda`` / ``cuda:N`` as this process sees it (``CUDA_VISIBLE_DEVICES`` maps
    indices to GPUs; its entries may be indices or UUIDs), without initialising CUDA."""
    _, _, index = device.partition(":")
    i = int(index) if index.isdigit() else 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return _safe(visible[i]) if i < len(visible) else str(i)


def lock_files(devices: Iterable[str], folder: Path | None = None) -> list[LockFile]:
    """The locks a measurement on ``devices`` takes, in the one order every process takes them (no deadlock):
    the host's (exclusive unless every device is a GPU), then each GPU's (exclusive), sorted."""
    folder = folder or lock_dir()
    host = _safe(socket.gethostname())
    devices = list(devices) or ["cpu"]
    gpus = sorted({gpu_id(d) for d in devices if d.split(":")[0] == "cuda"})
    only_gpus = all(d.split(":")[0] == "cuda" for d in devices)
    files = [LockFile(folder / f"machine-{host}.lock", shared=only_gpus)]
    files += [LockFile(folder / f"machine-{host}-cuda-{g}.lock") for g in gpus]
    return files


@dataclasses.dataclass
class Held:
    """What a measurement holds (and how long it waited for it)."""

    policy: str
    locks: list[LockFile] = dataclasses.field(default_factory=list)
    waited_s: float = 0.0
    waited_for: list[str] = dataclasses.field(default_factory=list)
    under: str = ""  # the holder this process measures under (its parent), when nested
    paths: list[str] = dataclasses.field(default_factory=list)  # every lock file taken (kept after release)
    _saved_env: str | None = None

    def as_meta(self) -> dict:
        """For ``meta.json``: the policy, the lock files, the seconds waited and for whom."""
        return {"policy": self.policy, "locks": list(self.paths), "waited_s": round(self.waited_s, 3),
                "waited_for": self.waited_for, **({"under": self.under} if self.under else {})}

    def child_env(self) -> dict[str, str]:
        """Environment variables for a process started to measure under this lock (also when it resets HOME)."""
        if not self.locks:
            return {}
        return {HELD_ENV: str(os.getpid()), ENV_DIR: str(self.locks[0].path.parent)}

    def fds(self) -> tuple[int, ...]:
        """The open lock files' descriptors: a child given them (``subprocess.Popen(pass_fds=...)``) keeps the
        lock held by the kernel until it exits too, so a measuring worker orphaned by a killed driver is covered."""
        return tuple(lock.fileno() for lock in self.locks if lock.fileno() is not None)

    def annotate(self, row: dict) -> dict:
        """``row`` with a note of the wait, when there was one (Ray workers record it per cell)."""
        if self.waited_s >= 0.5:
            note = f"waited {self.waited_s:.1f} s for this node's measurement lock ({'; '.join(self.waited_for)})"
            row["notes"] = "; ".join(n for n in (row.get("notes") or "", note) if n)
        return row

    def release(self) -> None:
        """Let go of every lock (in reverse order) and of the exported variable."""
        for lock in reversed(self.locks):
            lock.release()
        if self.locks:
            if self._saved_env is None:
                os.environ.pop(HELD_ENV, None)
            else:
                os.environ[HELD_ENV] = self._saved_env
        self.locks = []


def held_fds() -> tuple[int, ...]:
    """The descriptors of every machine lock this process holds now (each holder's :meth:`Held.fds`): what a measuring
    worker inherits, so the kernel keeps the lock held while it lives, even past a killed driver."""
    return tuple(sorted({lock.fileno() for lock in list(_HELD_HERE) if lock.fileno() is not None}))


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _parent_holder(files: list[LockFile]) -> Holder | None:
    """The holder this process runs under: ``$ATTNBENCH_MACHINE_LOCK_HELD`` names a live process (not this one)
    that one of this host's lock files records now."""
    pid = os.environ.get(HELD_ENV, "")
    if not pid.isdigit() or int(pid) == os.getpid():
        return None
    folder = files[0].path.parent
    for path in sorted(folder.glob(f"machine-{_safe(socket.gethostname())}*.lock")):
        holder = LockFile(path).holder()
        if holder is not None and holder.pid == int(pid) and holder.on_this_host() and holder.alive():
            return holder
    return None


def acquire(devices: Iterable[str] = ("cpu",), policy: str = "wait", purpose: str = "",
            say: Callable[[str], None] = _stderr, poll_s: float = POLL_S) -> Held:
    """Take the machine lock for a measurement on ``devices`` (see the module docstring); release the result."""
    if policy not in POLICIES:
        raise AttnbenchError(f"unknown machine-lock policy {policy!r}; use one of {', '.join(POLICIES)}")
    held = Held(policy)
    if policy == "off":
        return held
    files = lock_files(devices)
    if any(lock.held and lock.path == f.path for lock in list(_HELD_HERE) for f in files):
        held.under = "this process"
        return held
    parent = _parent_holder(files)
    if parent is not None:
        held.under = parent.describe()
        return held
    me = Holder.me(purpose)
    try:
        for lock in files:
            _take(lock, me, policy, held, say, poll_s)
    except BaseException:
        held.release()
        raise
    _HELD_HERE.update(held.locks)
    held._saved_env = os.environ.get(HELD_ENV)
    os.environ[HELD_ENV] = str(os.getpid())
    return held


def _busy_text(lock: LockFile, ago: bool = True) -> str:
    """Who holds ``lock`` (``ago``: with how long ago it started, which changes as time passes)."""
    holder = lock.holder()
    if holder is not None and holder.alive() is not False:
        return holder.describe(ago)
    # a shared host lock records nobody: name the GPU measurements holding it
    gpu_holders = [LockFile(p).holder() for p in sorted(lock.path.parent.glob(lock.path.stem + "-cuda-*.lock"))]
    gpu_holders = [h.describe(ago) for h in gpu_holders if h is not None]
    return "; ".join(gpu_holders) or f"another measurement (holding {lock.path})"


def _take(lock: LockFile, me: Holder, policy: str, held: Held, say: Callable[[str], None], poll_s: float) -> None:
    started = time.monotonic()
    announced = None
    while not lock.try_acquire(me):
        who = _busy_text(lock, ago=False)  # said again only when the holder changes
        if policy == "no-wait":
            raise MachineBusyError(f"another measurement is running on this machine: {_busy_text(lock)}; wait for it "
                                   "(drop --no-wait) or measure alongside it with --allow-concurrent")
        if who != announced:
            say(f"waiting for the machine lock: {_busy_text(lock)} is measuring on this machine (one measurement at a "
                "time; --no-wait exits instead, --allow-concurrent measures alongside it)")
            announced = who
            held.waited_for.append(who)
        time.sleep(poll_s)
    held.locks.append(lock)
    held.paths.append(str(lock.path))
    waited = time.monotonic() - started
    if announced is not None:
        held.waited_s += waited
        say(f"waited {waited:.1f} s for the machine lock; measuring now")


@contextlib.contextmanager
def measuring(devices: Iterable[str] = ("cpu",), policy: str = "wait", purpose: str = "",
              say: Callable[[str], None] = _stderr) -> Iterator[Held]:
    """``with measuring(["cpu"]) as held:`` time things; the lock is released when the block ends."""
    held = acquire(devices, policy, purpose, say)
    try:
        yield held
    finally:
        held.release()


def acquire_for_run(devices: Iterable[str], executor: str, policy: str, run_dir: str | Path) -> Held:
    """The lock ``attnbench run`` holds while its cells are timed. A local (or in-process) run takes it for its devices; on Ray
    each worker takes its own node's lock around its cell (:mod:`attnbench.runner.executors.ray`), so the
    driver takes none (a worker on this host would otherwise wait for the driver forever)."""
    if executor == "ray":
        return Held(f"{executor} workers")
    return acquire(devices, policy, purpose=f"attnbench run writing {run_dir}")


def record(meta: dict, held: Held) -> None:
    """Add this session's lock to ``meta`` (``machine_lock``: one entry per session, so a resumed run keeps
    the earlier ones) and the total seconds waited (``machine_lock_waited_s``)."""
    meta["machine_lock"] = [*meta.get("machine_lock", []), held.as_meta()]
    meta["machine_lock_waited_s"] = round(sum(m.get("waited_s", 0.0) for m in meta["machine_lock"]), 3)
