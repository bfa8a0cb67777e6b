"""A reproducible, bounded contention generator: the load a shared machine really has, on the spare core.

``attnbench run`` measures on every usable core but one (:func:`attnbench.measure.cpu_env.default_threads`);
this puts a known load on that spare core, so that reproducibility can be checked under it as well as on a
quiet machine (``python -m attnbench.tools.reproducibility --load memory``):

* ``memory``: copies a buffer larger than the last-level cache back and forth, 3 s on and 2 s off, so it
  competes for memory bandwidth and evicts the cache in phases (the pattern of a neighbour's batch job);
* ``cpu``: a busy loop, all the time (the core is taken; the memory system is left alone).

The generator is its own process and never outlives its bound or its parent: it stops after ``seconds``, when
its parent dies (Linux: ``PR_SET_PDEATHSIG``; everywhere: it checks its parent between bursts), and when
:meth:`Load.stop` or the ``with`` block ends. Run it by hand with
``python -m attnbench.tools.load memory --seconds 60``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

# Imports nothing from attnbench (numpy only inside the memory load): the generator starts as a script in a
# fresh interpreter within a fraction of a second.

KINDS = ("memory", "cpu")
ON_S, OFF_S = 3.0, 2.0  # the memory load's duty cycle
DEFAULT_BUFFER_BYTES = 256 << 20  # larger than any desktop or server LLC per socket we expect to meet
CHECK_S = 0.05  # how often the loop looks at the clock and its parent


def spare_core() -> int | None:
    """The CPU the measuring threads leave free: the highest one this process may use (OpenMP binds the
    measuring threads to the first places); None where affinity is unknown."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    return cpus[-1] if len(cpus) > 1 else None


def llc_bytes() -> int | None:
    """The last-level cache size from sysfs (Linux), or None."""
    best = None
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in os.listdir(base):
            try:
                with open(f"{base}/{entry}/size") as f:
                    text = f.read().strip()
            except OSError:
                continue
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            size = int(text.rstrip("KMG")) * scale
            best = max(best or 0, size)
    except (OSError, ValueError):
        return None
    return best


def buffer_bytes() -> int:
    """The memory load's buffer: four times the last-level cache, at least :data:`DEFAULT_BUFFER_BYTES`."""
    return max(DEFAULT_BUFFER_BYTES, 4 * (llc_bytes() or 0))


def _die_with_parent() -> None:
    """Linux: ask the kernel to send SIGTERM when the parent exits (the loop checks too, for other systems)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def generate(kind: str, seconds: float, parent: int | None = None, cpu: int | None = None,
             buffer: int | None = None) -> float:
    """Run the ``kind`` load in this process for at most ``seconds`` (less if ``parent`` dies); seconds it ran.

    ``buffer``: bytes the memory load copies (default :func:`buffer_bytes`)."""
    if kind not in KINDS:
        raise ValueError(f"unknown load {kind!r}; use one of {', '.join(KINDS)}")
    if cpu is not None:
        try:
            os.sched_setaffinity(0, {cpu})
        except (AttributeError, OSError):
            pass
    start = time.monotonic()
    deadline = start + seconds
    alive = (lambda: os.getppid() == parent) if parent else (lambda: True)
    if kind == "cpu":
        x = 0
        while time.monotonic() < deadline and alive():
            for i in range(20_000):  # about a millisecond of pure-Python work between checks
                x += i * i
        return time.monotonic() - start
    import numpy as np

    n = max(1, (buffer or buffer_bytes()) // 8)
    src, dst = np.ones(n), np.empty(n)
    while time.monotonic() < deadline and alive():
        phase_end = min(deadline, time.monotonic() + ON_S)
        while time.monotonic() < phase_end and alive():
            np.copyto(dst, src)  # streams the whole buffer: bandwidth taken, caches evicted
            src, dst = dst, src
        rest = min(deadline, time.monotonic() + OFF_S)
        while time.monotonic() < rest and alive():
            time.sleep(CHECK_S)
    return time.monotonic() - start


@dataclass
class Load:
    """A running contention generator (a child process); stop it with :meth:`stop` or use it as a context."""

    kind: str
    seconds: float
    cpu: int | None = None
    buffer_mib: int | None = None  # the memory load's buffer (default: buffer_bytes())
    process: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> Load:
        """Start the generator process (on :attr:`cpu`, the spare core when None)."""
        if self.kind not in KINDS:
            raise ValueError(f"unknown load {self.kind!r}; use one of {', '.join(KINDS)}")
        cpu = spare_core() if self.cpu is None else self.cpu
        self.cpu = cpu
        # run as a script by path: `-m attnbench...` would import the package (and torch) for nothing
        cmd = [sys.executable, os.path.abspath(__file__), self.kind, "--seconds", str(self.seconds),
               "--parent", str(os.getpid())] + (["--cpu", str(cpu)] if cpu is not None else [])
        cmd += ["--buffer-mib", str(self.buffer_mib)] if self.buffer_mib else []
        self.process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        return self

    @property
    def running(self) -> bool:
        """Whether the generator process is still alive."""
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the generator (SIGTERM, then SIGKILL after ``timeout``) and reap it."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def describe(self) -> str:
        """One line for the output: what load, where, for how long at most."""
        what = (f"memory copy loop over {self.buffer_mib or buffer_bytes() >> 20} MiB, {ON_S:g} s on / {OFF_S:g} s off"
                if self.kind == "memory" else "busy loop")
        return f"--load {self.kind}: {what}, on CPU {self.cpu if self.cpu is not None else '(any)'}, at most {self.seconds:g} s"

    def __enter__(self) -> Load:
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--seconds", type=float, default=60.0, help="stop after this long (default 60)")
    parser.add_argument("--parent", type=int, help="stop when this process is no longer the parent")
    parser.add_argument("--cpu", type=int, help="pin to this CPU (default: the spare core)")
    parser.add_argument("--buffer-mib", type=int, help="the memory load's buffer (default: 4x the LLC, >= 256 MiB)")
    args = parser.parse_args(argv)
    if args.parent:
        _die_with_parent()
        if os.getppid() != args.parent:  # the parent died before the request took effect
            return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    generate(args.kind, args.seconds, args.parent, spare_core() if args.cpu is None else args.cpu,
             args.buffer_mib << 20 if args.buffer_mib else None)


if __name__ == "__main__":
    main()
