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
"""

from __future__ import annotations

import os
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
