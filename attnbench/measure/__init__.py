"""Measuring, kept apart from holding and presenting results: time, memory, FLOPs, statistics.

Each function takes a zero-argument callable and a device and returns plain numbers, so a sweep,
the asv suite, a test and a notebook all call the same primitives.

The names below are imported from their modules on first use (PEP 562): importing one light module of the
package (``attnbench.measure.cpu_env`` as a run starts its measuring worker) does not import the statistics'
SciPy, seconds of a command's start-up.
"""

from __future__ import annotations

import importlib

_HOME = {
    "decode_rates": "bandwidth", "peak_gbytes_per_s": "bandwidth",
    "analytic_flops": "flops", "attention_pairs": "flops", "counted_flops": "flops", "decode_bytes": "flops",
    "dense_flops": "flops", "peak_gflops": "flops",
    "InterleavedTiming": "interleave", "time_interleaved": "interleave",
    "MemoryResult": "memory", "kv_cache_bytes_analytic": "memory", "peak_memory": "memory",
    "retained_bytes": "memory", "storage_bytes": "memory",
    "median_ci": "stats", "paired_speedup": "stats", "summarize": "stats",
    "Timing": "timing", "time_fn": "timing",
}
"""Each public name -> the module of this package that defines it."""

__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})
