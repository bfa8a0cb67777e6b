"""The timing primitive: warm up, then repeat until the median is known well enough or time runs out.

CPU: ``time.perf_counter_ns`` around a block of calls (a block is long enough to dwarf the clock's
overhead), synchronising nothing because CPU kernels are synchronous. Python's cyclic garbage collector is paused
while samples are taken (:func:`gc_paused`), as ``timeit`` and ``torch.utils.benchmark`` pause it: a collection that
lands in a block is the interpreter's, not the implementation's, and it made small Python-heavy cells (the book's
wrapper at 0.7 ms a call) read 6-8% slower than ``blocked_autorange`` (issue 30's fidelity check).
CUDA: one pair of CUDA events per call on the current stream; the GPU's L2 cache can be flushed
before each call *outside* the timed region (``cold``); tiny workloads can be captured once in a
CUDA graph and replayed (``cuda_graph``), removing launch overhead from the measurement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from attnbench.devices import synchronize
from attnbench.measure import long_call
from attnbench.measure.stats import summarize


@dataclass(frozen=True)
class Timing:
    """Raw per-call samples (seconds) and how they were taken."""

    samples_s: tuple[float, ...]
    calls_per_sample: int
    warmup_calls: int
    timer: str  # perf_counter_ns | cuda_event | cuda_graph
    stopped_by: str  # ci | budget | max_samples | long_call (attnbench.measure.long_call)
    warm_call_s: float = math.nan  # the warm-up's mean call time (a long call: the call that stood for it)

    def stats(self) -> dict[str, float]:
        """Median, IQR, CI ... of :attr:`samples_s` (see :func:`attnbench.measure.stats.summarize`)."""
        return summarize(self.samples_s)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (reference counting still frees), back as it was after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def l2_flusher(device: torch.device) -> Callable[[], None]:
    """A function that evicts the GPU's L2 cache by writing a buffer twice its size."""
    size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 * 2**20
    buffer = torch.empty(2 * size, dtype=torch.int8, device=device)

    def flush() -> None:
        buffer.zero_()

    return flush


def time_fn(fn: Callable[[], object], device: torch.device | str = "cpu", *, warmup_calls: int = 3,
            warmup_s: float = 0.05, target_rel_ci: float = 0.02, min_samples: int = 10, max_samples: int = 10_000,
            budget_s: float = 2.0, min_block_s: float = 1e-3, l2_flush: bool = False,
            cuda_graph: bool = False, between: Callable[[], object] | None = None,
            warmed_s: float | None = None) -> Timing:
    """Time ``fn`` (one call = one iteration of the workload) and return raw per-call samples.

    Warm-up runs at least ``warmup_calls`` calls and at least ``warmup_s`` seconds. Sampling then
    continues until the median's 95% CI half-width is below ``target_rel_ci`` of the median (after
    ``min_samples``), or ``budget_s`` of sampling has passed, or ``max_samples`` were taken.
    ``between`` runs after every call outside the timed region (a decode step's cache restore): each call is
    then timed on its own (CPU) or between its events (CUDA). A long call (:mod:`attnbench.measure.long_call`) is
    warmed up by one call, or by none when ``warmed_s`` (the seconds of a call already made, untimed here) is one,
    and sampled one call at a time until it is known (``stopped_by`` ``long_call``).
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    warm_calls, per_call_s = _warm(fn, device, warmup_calls, warmup_s, between, warmed_s)
    if cuda:
        with gc_paused():
            timing = _time_cuda(fn, device, warm_calls, target_rel_ci, min_samples, max_samples, budget_s, l2_flush,
                                cuda_graph and between is None, between, long_s=per_call_s)
    else:
        calls = max(1, math.ceil(min_block_s / max(per_call_s, 1e-9)))  # block long enough for the clock
        with gc_paused():
            timing = _sample_cpu(fn, calls, warm_calls, target_rel_ci, min_samples, max_samples, budget_s, between,
                                 long_s=per_call_s)
    return dataclasses.replace(timing, warm_call_s=per_call_s)


def _warm(fn: Callable[[], object], device: torch.device, warmup_calls: int, warmup_s: float,
          between: Callable[[], object] | None, warmed_s: float | None) -> tuple[int, float]:
    """The warm-up: calls made and the mean call time (a long call already made stands for it)."""
    if long_call.is_long(warmed_s):
        return 0, float(warmed_s)
    warm_calls, start = 0, time.perf_counter()
    while warm_calls < warmup_calls or time.perf_counter() - start < warmup_s:
        fn()
        if between is not None:
            between()
        synchronize(device)
        warm_calls += 1
        if warm_calls == 1 and long_call.is_long(time.perf_counter() - start):  # one is warm-up enough
            break
    return warm_calls, (time.perf_counter() - start) / warm_calls


def _sample_cpu(fn: Callable[[], object], calls: int, warm_calls: int, target_rel_ci: float, min_samples: int,
                max_samples: int, budget_s: float, between: Callable[[], object] | None,
                long_s: float | None = None) -> Timing:
    """Blocks of ``calls`` calls until the median is known within ``target_rel_ci`` or the budget is spent (a long
    call: until :func:`attnbench.measure.long_call.known`, whose warm-up call took ``long_s``)."""
    samples: list[float] = []
    stopped_by = "max_samples"
    sampling_start = time.perf_counter()
    while len(samples) < max_samples:
        if between is None:
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            elapsed_ns = time.perf_counter_ns() - t0
        else:
            elapsed_ns = 0
            for _ in range(calls):
                t0 = time.perf_counter_ns()
                fn()
                elapsed_ns += time.perf_counter_ns() - t0
                between()
        samples.append(elapsed_ns * 1e-9 / calls)
        if long_call.known(long_s, samples):
            stopped_by = "long_call"
            break
        if _converged(samples, min_samples, target_rel_ci):
            stopped_by = "ci"
            break
        if time.perf_counter() - sampling_start > budget_s and len(samples) >= 3:
            stopped_by = "budget"
            break
    return Timing(tuple(samples), calls, warm_calls, "perf_counter_ns", stopped_by)


def _converged(samples: list[float], min_samples: int, target_rel_ci: float) -> bool:
    n = len(samples)
    if n < min_samples or (n % 5 and n > 50):  # check every 5th sample once there are many
        return False
    ci_rel = summarize(samples)["ci_rel"]
    return ci_rel == ci_rel and ci_rel <= target_rel_ci


def cuda_graph_replay(fn: Callable[[], object], device: torch.device) -> Callable[[], None]:
    """``fn`` captured once in a CUDA graph: the returned function replays it (no launch overhead)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm the side stream before capture, as the CUDA-graph docs require
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def cuda_event_intervals(fn: Callable[[], object], calls: int, flush: Callable[[], None] | None = None,
                         between: Callable[[], object] | None = None) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
    """A start and an end CUDA event around each of ``calls`` calls of ``fn`` on the current stream; ``flush`` runs
    before the start event and ``between`` after the end event, both outside the timed region. Read the intervals
    after a synchronisation."""
    pairs = []
    for _ in range(calls):
        if flush is not None:
            flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if between is not None:
            between()
        pairs.append((start, end))
    return pairs


def _time_cuda(fn, device, warm_calls, target_rel_ci, min_samples, max_samples, budget_s, l2_flush, cuda_graph,
               between=None, long_s: float | None = None) -> Timing:
    flush = l2_flusher(device) if l2_flush else None
    timer = "cuda_event"
    call = fn
    if cuda_graph:
        call, timer = cuda_graph_replay(fn, device), "cuda_graph"
    samples: list[float] = []
    stopped_by = "max_samples"
    sampling_start = time.perf_counter()
    batch = 1 if long_call.is_long(long_s) else 10
    while len(samples) < max_samples:
        events = cuda_event_intervals(call, batch, flush, between)
        torch.cuda.synchronize(device)
        samples.extend(s.elapsed_time(e) * 1e-3 for s, e in events)
        if long_call.known(long_s, samples):
            stopped_by = "long_call"
            break
        if _converged(samples, min_samples, target_rel_ci):
            stopped_by = "ci"
            break
        if time.perf_counter() - sampling_start > budget_s:
            stopped_by = "budget"
            break
    return Timing(tuple(samples), 1, warm_calls, timer, stopped_by)
