"""Peak memory of one call, over the memory already held before it.

CUDA: the caching allocator's peak allocated and peak reserved bytes, reset before the call.
CPU: the profiler's memory events (every allocation and free of the CPU allocator, in order),
accumulated to find the high-water mark. Process RSS would be dominated by the torch import and the
allocator's caching, so it is not used.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from attnbench.devices import synchronize


class _NativeStderr:
    """What native code wrote to file descriptor 2 inside :func:`native_stderr` (empty unless capturing)."""

    def __init__(self) -> None:
        self._text = ""

    def text(self) -> str:
        """The captured text (available after the ``with`` block)."""
        return self._text


@contextlib.contextmanager
def native_stderr(capture: bool = False):
    """Silence file descriptor 2 (C++ logging such as kineto's ``profiler_start`` lines) for the duration;
    with ``capture=True`` keep what was written (``.text()`` after the block). Python exceptions still propagate."""
    out = _NativeStderr()
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 (some notebooks, pytest capture): nothing to redirect
        yield out
        return
    sink = tempfile.TemporaryFile() if capture else open(os.devnull, "wb")  # noqa: SIM115  (closed below)
    try:
        os.dup2(sink.fileno(), 2)
        yield out
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        if capture:
            sink.seek(0)
            out._text = sink.read().decode(errors="replace")
        sink.close()


def _memory_events(prof) -> list | None:
    """The CPU allocator's ``[memory]`` events of a finished profiler, oldest first, or None when this torch
    does not expose them (``prof.profiler.kineto_results`` is not public API: this is its one use)."""
    try:
        events = prof.profiler.kineto_results.events()
        mem = [e for e in events if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
        mem.sort(key=lambda e: e.start_ns())
        return mem
    except AttributeError:
        return None


@dataclass(frozen=True)
class MemoryResult:
    """Peak bytes allocated (and reserved, on CUDA) during the call, above the pre-call baseline."""

    peak_bytes: float
    peak_reserved_bytes: float
    method: str


def peak_memory(fn: Callable[[], object], device: torch.device | str = "cpu") -> MemoryResult:
    """Run ``fn`` once and return its peak memory on ``device`` above what was allocated before."""
    device = torch.device(device)
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base_alloc = torch.cuda.memory_allocated(device)
        base_reserved = torch.cuda.memory_reserved(device)
        fn()
        synchronize(device)
        return MemoryResult(float(torch.cuda.max_memory_allocated(device) - base_alloc),
                            float(torch.cuda.max_memory_reserved(device) - base_reserved), "cuda_allocator")
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with native_stderr():  # kineto prints "profiler_start/stop" lines straight to fd 2
        prof.start()
    try:
        fn()
    finally:
        with native_stderr():
            prof.stop()
    events = _memory_events(prof)
    if events is None:
        return MemoryResult(math.nan, math.nan, "unavailable: this torch.profiler exposes no memory events")
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return MemoryResult(float(peak), math.nan, "profiler_memory_events")
