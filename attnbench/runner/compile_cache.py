"""torch.compile's on-disk caches kept per machine, so a sweep's second run does not compile again.

Inductor caches what it compiled (the FX graph cache: generated code and its C++/Triton build; the autotune cache;
AOTAutograd's cache of the joint graph) in one folder, by default ``/tmp/torchinductor_<user>``: wiped on reboot and
shared by every torch version. The measuring processes get ``<user cache>/attnbench/inductor/<torch version>``
instead (``$XDG_CACHE_HOME``, else ``~/.cache``), with the caches switched on; a ``TORCHINDUCTOR_CACHE_DIR`` the user
set is kept. Dynamo's tracing is not cached by torch: a warm compile still traces the module (a fraction of a cold
compile's time).

Each compiled cell's first call is classified from Inductor's own counters (``torch._dynamo.utils.counters``, not
public API): ``warm`` when every graph came from the cache, ``cold`` when any was compiled, ``''`` when nothing was
counted. The row's ``compile_cache`` column holds it, next to ``compile_s``.

A measuring process is bound to one core (:mod:`attnbench.measure.cpu_env`), and the compile workers Inductor starts
inherit that binding: a cold compile then uses one core of the machine. :func:`all_cores` lets the first call of a
compiled cell (where it compiles) use the cores the run itself may use, as a user's ``torch.compile`` would; the
binding is restored before anything is timed. Measured on the 2-vCPU VM (2026-12-02, busy): a cold compile of
``compiled:weight_split`` forward+backward at T=256 took 68 s on one core and 42 s on both.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

ENV_DIR = "TORCHINDUCTOR_CACHE_DIR"
SWITCHES = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
"""Inductor's FX graph cache and AOTAutograd's cache, on (the defaults of recent torch, set so a user's global
setting does not turn them off for measuring processes silently; a value the user set is kept)."""
_HITS = (("inductor", "fxgraph_cache_hit"), ("aot_autograd", "autograd_cache_hit"))
_MISSES = (("inductor", "fxgraph_cache_miss"), ("aot_autograd", "autograd_cache_miss"))


def cache_dir(torch_version: str | None = None) -> Path:
    """``<user cache>/attnbench/inductor/<torch version>`` (the version with ``+`` kept: ``2.13.0+cpu``)."""
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "attnbench" / "inductor" / str(torch_version)


def worker_env(env: dict[str, str], torch_version: str | None = None) -> dict[str, str]:
    """``env`` (a measuring process's environment) with Inductor's caches in :func:`cache_dir` and switched on;
    what the user set is kept."""
    out = dict(env)
    out.setdefault(ENV_DIR, str(cache_dir(torch_version)))
    for key, value in SWITCHES.items():
        out.setdefault(key, value)
    return out


def use_here() -> str:
    """Point this process's Inductor caches at :func:`cache_dir` (before its first compile; a folder already set is
    kept) and return the folder in use."""
    env = worker_env(dict(os.environ))
    for key in (ENV_DIR, *SWITCHES):
        os.environ[key] = env[key]
    return os.environ[ENV_DIR]


def counts() -> tuple[int, int] | None:
    """``(hits, misses)`` of Inductor's and AOTAutograd's caches so far in this process, or None without counters."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    try:
        hits = sum(int(counters[group][key]) for group, key in _HITS)
        misses = sum(int(counters[group][key]) for group, key in _MISSES)
    except (KeyError, TypeError, AttributeError):
        return None
    return hits, misses


def state(before: tuple[int, int] | None, after: tuple[int, int] | None) -> str:
    """``cold`` when the calls between the two :func:`counts` compiled anything, ``warm`` when they only hit the
    cache, ``''`` when unknown (no counters, or nothing counted)."""
    if before is None or after is None:
        return ""
    hits, misses = after[0] - before[0], after[1] - before[1]
    if misses > 0:
        return "cold"
    return "warm" if hits > 0 else ""


@contextlib.contextmanager
def all_cores() -> Iterator[set[int] | None]:
    """This thread (and the compile workers it starts) on every core the driver may use (the parent process's
    affinity: the user's ``taskset`` is kept), with Inductor's ``compile_threads`` as many, until the block ends; then
    the binding and the setting as they were. Yields the cores used, or None where affinity cannot be read or set."""
    try:
        before = os.sched_getaffinity(0)
        cores = os.sched_getaffinity(os.getppid()) | before
    except (AttributeError, OSError):
        yield None
        return
    import torch._inductor.config as inductor_config

    threads = inductor_config.compile_threads
    try:
        os.sched_setaffinity(0, cores)
    except OSError:
        yield None
        return
    inductor_config.compile_threads = max(len(cores), 1)
    try:
        yield cores
    finally:
        inductor_config.compile_threads = threads
        os.sched_setaffinity(0, before)
