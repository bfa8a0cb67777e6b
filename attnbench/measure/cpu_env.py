"""The CPU measuring environment: the memory allocator and OpenMP thread binding of a measuring process.

Part of the measurement, not of the machine: glibc's malloc moves its mmap threshold after every free
of a large block, so attention's big temporaries come from fresh (page-faulted, zeroed) mappings on
some calls and from the heap on others, and a cell's speed depends on what ran before it. OpenMP
threads that migrate between cores, or sleep between the kernels of one call, add run-to-run drift.

A measuring process is therefore started with a fixed environment (:func:`process_env`), which must be
in place before the process starts (``LD_PRELOAD``, glibc's ``MALLOC_*`` variables) or before torch
loads OpenMP (``OMP_*``). Inside it, :func:`pin_glibc_malloc` fixes the thresholds with ``mallopt``
as well (also where the process was not started by attnbench), and :func:`describe` reports what
actually holds, checked rather than assumed: a large ``malloc`` that bypasses the heap, the allocator
library mapped into the process, the CPUs each thread may run on.

Allocators (``--cpu-allocator``): ``pinned`` (default) glibc with both thresholds fixed at
:data:`PINNED_THRESHOLD_BYTES`; ``system`` glibc as configured (realistic, and bimodal);
``jemalloc`` / ``tcmalloc`` preloaded from the installed shared library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import platform
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from attnbench.errors import AttnbenchError

ALLOCATORS = ("pinned", "system", "jemalloc", "tcmalloc")
PINNED_THRESHOLD_BYTES = 1 << 30
"""glibc's mmap and trim thresholds under ``pinned``: allocations up to 1 GiB always come from the heap,
and freed memory is never returned to the OS in between (fits ``mallopt``'s int on every glibc)."""
OMP_BINDING = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores", "OMP_WAIT_POLICY": "active"}
"""Each OpenMP thread stays on its own core and spins, rather than sleeps, between parallel regions."""
UNPINNED = "unpinned"
"""Recorded where a setting could not be applied (not glibc, not Linux, or torch already loaded)."""

LIBRARIES = {
    "jemalloc": (("libjemalloc.so.2", "libjemalloc.so"), "libjemalloc2"),
    "tcmalloc": (("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so"),
                 "libtcmalloc-minimal4"),
}
"""Allocator -> (shared-library file names, in order of preference; the Debian/Ubuntu package)."""
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/lib/x86_64-linux-gnu",
             "/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


class CpuEnvError(AttnbenchError):
    """A measuring environment that cannot be set up (unknown allocator, library not installed)."""


@dataclass(frozen=True)
class CpuEnv:
    """What a measuring process is asked to run under."""

    allocator: str = "pinned"
    bind: bool = True  # OpenMP binding and wait policy (OMP_BINDING)
    threads: int | None = None  # OMP_NUM_THREADS and torch.set_num_threads; None: torch's default

    def __post_init__(self) -> None:
        check_allocator(self.allocator)


def check_allocator(name: str) -> str:
    """``name`` if it is a known allocator, else a :class:`CpuEnvError` listing them."""
    if name not in ALLOCATORS:
        raise CpuEnvError(f"unknown --cpu-allocator {name!r}; use one of {', '.join(ALLOCATORS)}")
    return name


def is_glibc_linux() -> bool:
    """True on Linux with glibc, where the ``MALLOC_*`` variables, ``mallopt`` and ``LD_PRELOAD`` apply."""
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@functools.cache
def find_library(allocator: str) -> str:
    """The path of ``jemalloc``'s or ``tcmalloc``'s shared library (ldconfig's cache, then the usual folders).

    A :class:`CpuEnvError` naming the Debian package when it is not installed.
    """
    names, package = LIBRARIES[allocator]
    if not sys.platform.startswith("linux"):
        raise CpuEnvError(f"--cpu-allocator {allocator} preloads a shared library, which needs Linux")
    for name in names:
        for folder in _LIB_DIRS:
            if (Path(folder) / name).is_file():
                return str(Path(folder) / name)
    found = ctypes.util.find_library(names[0].split(".so")[0].removeprefix("lib"))  # ldconfig's cache
    if found:
        return found  # a soname: the dynamic loader finds it on its own path
    raise CpuEnvError(f"--cpu-allocator {allocator}: {names[0]} is not installed; install it "
                      f"(Debian/Ubuntu: apt-get install {package}) or use --cpu-allocator pinned")


def process_env(env: CpuEnv, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables of a measuring process started with ``env`` (``base``: default os.environ).

    Variables the caller set explicitly (``OMP_*``, ``MALLOC_*``) are left as they are under ``system``;
    the controlled allocators overwrite them.
    """
    out = dict(os.environ if base is None else base)
    for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        if env.allocator != "system":
            out.pop(key, None)
    if env.allocator == "pinned":
        out["MALLOC_MMAP_THRESHOLD_"] = out["MALLOC_TRIM_THRESHOLD_"] = str(PINNED_THRESHOLD_BYTES)
    elif env.allocator in LIBRARIES:
        library = find_library(env.allocator)
        out["LD_PRELOAD"] = " ".join([library, *(p for p in out.get("LD_PRELOAD", "").split() if p != library)])
    if env.bind:
        out.update(OMP_BINDING)
    if env.threads:
        out["OMP_NUM_THREADS"] = str(env.threads)
    out[ALLOCATOR_VAR] = env.allocator  # read back by requested_allocator()
    return out


@functools.cache
def _libc():
    libc = ctypes.CDLL(None)
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def pin_glibc_malloc(threshold: int = PINNED_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap and trim thresholds in this process with ``mallopt`` (True when glibc accepted both).

    Fixing either one also stops glibc from moving the mmap threshold after frees (its "dynamic
    threshold"), which is what makes a cell's speed depend on its history.
    """
    if not is_glibc_linux():
        return False
    libc = _libc()
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, threshold))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def large_malloc_is_mmapped(size: int = 64 << 20) -> bool | None:
    """Does glibc serve a ``size``-byte ``malloc`` from a fresh mmap right now? (None where it cannot be told.)

    ``False`` under ``pinned`` (the block comes from the heap); ``True`` in a fresh process under
    ``system``, where glibc's threshold starts at 128 KiB. The block is never touched, so it costs no memory.
    """
    if not is_glibc_linux():
        return None
    libc = _libc()
    try:
        mallinfo2 = libc.mallinfo2
    except AttributeError:  # glibc < 2.33
        return None
    mallinfo2.restype = _MallInfo2
    before = mallinfo2().hblkhd
    block = libc.malloc(size)
    try:
        return mallinfo2().hblkhd > before
    finally:
        libc.free(block)


def _mapped_allocator() -> str | None:
    """``jemalloc`` or ``tcmalloc`` when its library is mapped into this process."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for name in LIBRARIES:
        if f"lib{name}" in maps:
            return name
    return None


def default_threads() -> int:
    """Measuring threads when ``--threads`` is not given under the controlled environment: every usable core but one.

    The spare core takes the driver, the OS and whatever else runs, so that they do not preempt one of the
    OpenMP threads in the middle of a parallel region (which stalls all of them until it runs again). On the
    2-vCPU VM this project is developed on, 2 threads drifted 1.23x worst / 1.14x mean between runs of one cell,
    1 thread 1.08x / 1.035x (``python -m attnbench.tools.reproducibility``; docs/studies/trustworthiness.md).
    """
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, n - 1)


def _cpu_list(cpus) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    cpus = sorted(cpus)
    parts, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            parts.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(parts)


def affinity() -> str:
    """The CPUs this process's threads may run on (``"0-1"``), or ``unpinned`` where the OS does not say.

    The union over threads: with OpenMP binding each thread is held to one core, the process to all of them.
    """
    cpus: set[int] = set()
    for text in thread_affinities():
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            if lo.strip().isdigit():
                cpus.update(range(int(lo), int(hi or lo) + 1))
    if cpus:
        return _cpu_list(cpus)
    try:
        return _cpu_list(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return UNPINNED


def thread_affinities() -> list[str]:
    """The CPUs each thread of this process may run on (Linux): OpenMP binding shows as one core per thread."""
    out = []
    for status in sorted(Path("/proc/self/task").glob("*/status")):
        try:
            for line in status.read_text().splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    out.append(line.split(":", 1)[1].strip())
        except OSError:
            continue
    return out


ALLOCATOR_VAR = "ATTNBENCH_CPU_ALLOCATOR"
"""Set by :func:`process_env` in every measuring process: the allocator asked for (read back by :func:`requested_allocator`)."""


def requested_allocator() -> str | None:
    """The allocator the measuring environment of this process asked for, or None outside such an environment."""
    return os.environ.get(ALLOCATOR_VAR)


def measuring_threads(threads: int | None, cpu_bind: bool) -> int:
    """The intra-op thread count of a CPU measurement: ``threads`` (``--threads``) when given, else every usable core
    but one under the controlled environment (:func:`default_threads`), else the count torch picks by itself
    (:func:`torch_default_threads`). The one place this default is decided, for local runs and Ray workers alike."""
    if threads:
        return threads
    return default_threads() if cpu_bind else torch_default_threads()


@functools.cache
def torch_default_threads() -> int:
    """The intra-op thread count torch picks by itself (physical cores, else logical CPUs): what a measurement
    outside the controlled environment gets (a Ray worker's ``OMP_NUM_THREADS`` of 1 is not that)."""
    logical = os.cpu_count() or 1
    cores = set()
    for topo in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology"):
        try:
            with open(os.path.join(topo, "physical_package_id")) as f1, open(os.path.join(topo, "core_id")) as f2:
                cores.add((f1.read().strip(), f2.read().strip()))
        except OSError:
            continue
    return len(cores) if 0 < len(cores) < logical else logical


def describe(torch_loaded_before_env: bool = False) -> dict[str, str]:
    """What holds in this process: the ``cpu_allocator``, ``cpu_binding`` and ``cpu_affinity`` row columns.

    ``cpu_allocator`` is ``pinned`` only when a large ``malloc`` really stays on the heap, ``jemalloc`` /
    ``tcmalloc`` only when the library is mapped, ``system`` for glibc left alone, else ``unpinned``.
    ``cpu_binding`` is the OpenMP binding in force (``close/cores/active``), or ``unpinned`` when it was not
    set before torch loaded OpenMP (``torch_loaded_before_env``) or is not set at all.
    """
    requested = requested_allocator() or ""
    mapped = _mapped_allocator()
    if mapped:
        allocator = mapped
    elif requested == "system":
        allocator = "system"
    elif large_malloc_is_mmapped() is False:
        allocator = "pinned"
    else:
        allocator = UNPINNED
    values = [os.environ.get(k) for k in OMP_BINDING]
    bound = all(values) and not torch_loaded_before_env and sys.platform.startswith("linux")
    return {"cpu_allocator": allocator, "cpu_binding": "/".join(values) if bound else UNPINNED,
            "cpu_affinity": affinity()}


def warn_unpinned(wanted: CpuEnv, got: dict[str, str]) -> str | None:
    """The one warning to give when ``got`` (from :func:`describe`) falls short of ``wanted``, or None."""
    missing = []
    if wanted.allocator != "system" and got.get("cpu_allocator") != wanted.allocator:
        missing.append(f"allocator {wanted.allocator}" + ("" if is_glibc_linux() else " (needs Linux with glibc)"))
    if wanted.bind and got.get("cpu_binding") == UNPINNED:
        missing.append("OpenMP binding" + ("" if sys.platform.startswith("linux") else " (needs Linux)"))
    if not missing:
        return None
    message = (f"the CPU measuring environment could not be fully applied ({', '.join(missing)}): timings may "
               "drift between runs; rows record 'unpinned'")
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    return message
