"""Interleaved timing of a comparison group: every member in short bursts, in a shuffled order each cycle.

Timing each implementation in its own block lets the machine drift between the blocks, and the drift lands
in their ratio. Here one *cycle* runs one burst of every member (10-50 ms each), in an order shuffled every
cycle, so whatever the machine does during a cycle hits all members alike and cancels in the per-cycle ratio
("duet benchmarking", Bulej et al., ICPE 2020; google/benchmark's random interleaving). The per-cycle times
feed :func:`attnbench.measure.stats.paired_speedup`; the per-block samples inside the bursts are the member's
ordinary samples (its median and CI, as :func:`attnbench.measure.timing.time_fn` gives them).

CPU: ``time.perf_counter_ns`` around blocks of calls (at least ``min_block_s`` each). CUDA: a chain of CUDA
events on the current stream, one per call (with ``l2_flush``, the flush runs between an end event and the
next start event, outside the timed region), and a synchronisation before and after every burst.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from attnbench.devices import synchronize
from attnbench.measure.stats import paired_speedup, summarize
from attnbench.measure.timing import cuda_event_intervals, l2_flusher

MIN_BURST_S = 0.01
MAX_BURST_S = 0.05
CALLS_PER_BURST_TARGET = 10
"""Default burst length: about 10 calls of the group's slowest member, kept within 10-50 ms (always at least
one call). Short enough that a cycle sees one state of the machine, long enough that switching members
(caches, allocator) is a small part of a burst."""


@dataclass(frozen=True)
class InterleavedTiming:
    """What :func:`time_interleaved` measured, per member (keys as given)."""

    members: tuple[str, ...]
    samples_s: Mapping[str, tuple[float, ...]]  # per-call time of each timed block (the member's samples)
    cycle_s: Mapping[str, tuple[float, ...]]  # per-call time in each cycle, NaN where the member did not run
    orders: tuple[tuple[str, ...], ...]  # the members in the order their bursts ran, one tuple per cycle
    calls_per_sample: Mapping[str, int]
    calls_per_burst: Mapping[str, int]
    warmup_calls: Mapping[str, int]
    failures: Mapping[str, BaseException]  # members dropped (in warm-up or a burst), with what they raised
    timer: str  # perf_counter_ns | cuda_event
    stopped_by: str  # ci | budget | max_cycles | failed (no member left)
    baseline: str | None
    member_stopped_by: Mapping[str, str] = None  # per member: target (known within it) | budget | max_cycles | failed
    member_cycles: Mapping[str, int] = None  # per member: the cycles it ran in
    warmup_s_spent: Mapping[str, float] = None  # per member: seconds of warm-up (the rest of the wall time is cycles)

    @property
    def cycles(self) -> int:
        """The number of cycles run."""
        return len(self.orders)

    def stats(self, name: str) -> dict[str, float]:
        """Median, IQR, CI ... of a member's samples (see :func:`attnbench.measure.stats.summarize`)."""
        return summarize(self.samples_s[name])

    def speedup(self, name: str, seed: int = 0) -> tuple[float, float, float]:
        """``(speedup, ci_low, ci_high)`` of ``name`` against the baseline over this measurement's cycles
        (NaN without a baseline or without a cycle both ran in)."""
        if self.baseline is None:
            return math.nan, math.nan, math.nan
        return paired_speedup([self.cycle_s[self.baseline]], [self.cycle_s[name]], seed=seed)


def time_interleaved(fns: dict[str, Callable[[], object]], device: torch.device | str = "cpu", *,
                     warmup_calls: int = 3, warmup_s: float = 0.05, target_rel_ci: float = 0.02, min_samples: int = 10,
                     min_cycles: int = 6, max_cycles: int = 10_000, budget_s: float = 2.0, burst_s: float | None = None,
                     min_block_s: float = 1e-3, seed: int = 0, l2_flush: bool = False, baseline: str | None = None,
                     on_burst: Callable[[str], None] | None = None,
                     guard: Callable[[str], contextlib.AbstractContextManager] | None = None,
                     between: dict[str, Callable[[], object]] | None = None) -> InterleavedTiming:
    """Time the members of ``fns`` (one call = one iteration of a member's workload) in alternation.

    Each member is warmed up in turn (at least ``warmup_calls`` calls and ``warmup_s`` seconds), which also
    measures its call time; the burst length is then ``burst_s`` (default: about 10 calls of the slowest
    member, within 10-50 ms) and every member's calls per burst are fixed from its call time. Each cycle
    runs every active member's burst once, in an order shuffled per cycle (``random.Random(seed)``). After
    ``min_cycles`` cycles, a member whose figure the user reads is known within ``target_rel_ci`` leaves the
    cycles: with a ``baseline``, a member's paired speed-up CI and the baseline's median CI (its block samples,
    at least ``min_samples`` of them); without one, each member's median CI (:func:`_settled`). The baseline stays
    while any other member is timed. Sampling stops when every member has left (``ci``), or after ``budget_s`` of
    cycles (and at least 3; a ceiling, not a quota), or at ``max_cycles``. ``member_stopped_by`` says per member
    why it stopped (``target`` when it left known, else the group's reason) and ``member_cycles`` how many cycles
    it ran in.

    A member that raises (in warm-up or in a burst) is dropped from later cycles and reported in
    ``failures``; the others carry on. ``on_burst(name)`` is called before each member's warm-up and each
    burst, and ``guard(name)`` (a context manager, e.g. a deadline) is entered around them: both outside
    the timed region. ``between[name]`` (a decode step's cache restore) runs after each of that member's calls,
    outside the timed region: its calls are then timed one by one.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    if baseline is not None and baseline not in fns:
        raise ValueError(f"baseline {baseline!r} is not one of the members {list(fns)}")
    names = tuple(fns)
    between = between or {}
    guard = guard or (lambda name: contextlib.nullcontext())
    failures: dict[str, BaseException] = {}
    per_call_s: dict[str, float] = {}
    warm: dict[str, int] = {name: 0 for name in names}
    warm_s: dict[str, float] = {name: 0.0 for name in names}
    for name in names:
        t_warm = time.perf_counter()
        try:
            if on_burst:
                on_burst(name)
            with guard(name):
                per_call_s[name], warm[name] = _warm_up(fns[name], device, warmup_calls, warmup_s, between.get(name))
        except Exception as exc:  # the member is out; the group goes on
            failures[name] = exc
        warm_s[name] = time.perf_counter() - t_warm

    if burst_s is None:
        slowest = max(per_call_s.values(), default=0.0)
        burst_s = min(max(CALLS_PER_BURST_TARGET * slowest, MIN_BURST_S), MAX_BURST_S)
    # calls per burst: `blocks` timed blocks of `block_calls` calls (CUDA: one call per event interval)
    block_calls = {n: 1 if cuda or n in between else max(1, math.ceil(min_block_s / max(t, 1e-9)))
                   for n, t in per_call_s.items()}
    blocks = {n: max(1, round(burst_s / max(t * block_calls[n], 1e-9))) for n, t in per_call_s.items()}
    flush = l2_flusher(device) if cuda and l2_flush else None

    samples: dict[str, list[float]] = {name: [] for name in names}
    cycles: dict[str, list[float]] = {name: [] for name in names}
    orders: list[tuple[str, ...]] = []
    rng = random.Random(seed)
    active = [n for n in names if n not in failures]
    stopped_by = "max_cycles" if active else "failed"
    known: set[str] = set()  # members that left the cycles known within the target
    start = time.perf_counter()
    while active and len(orders) < max_cycles:
        order = rng.sample(active, len(active))
        for name in names:
            cycles[name].append(math.nan)
        for name in order:
            try:
                if on_burst:
                    on_burst(name)
                with guard(name):
                    synchronize(device)  # the previous member's work is finished before this burst starts
                    burst = (_burst_cuda(fns[name], blocks[name], flush, device, between.get(name)) if cuda
                             else _burst_cpu(fns[name], blocks[name], block_calls[name], between.get(name)))
            except Exception as exc:
                failures[name] = exc
                active.remove(name)
                continue
            samples[name].extend(burst)
            cycles[name][-1] = sum(burst) / len(burst)  # blocks are equally long: their mean is the per-call time
        orders.append(tuple(order))
        if not active:
            stopped_by = "failed"
            break
        if len(orders) >= min_cycles:
            settled = _settled(samples, cycles, active, baseline, min_samples, target_rel_ci)
            if settled == set(active):
                known |= settled
                stopped_by = "ci"
                break
            known |= settled - {baseline}
            # a member known well enough (its median, and its speed-up against the baseline) leaves the cycles,
            # so the group's time goes to the members still short of the target; the baseline stays while any
            # other member is timed, since every paired ratio needs it in the same cycle
            active = [n for n in active if n not in settled or n == baseline]
        if time.perf_counter() - start > budget_s and len(orders) >= min(3, max_cycles):
            stopped_by = "budget"
            break
    return InterleavedTiming(
        members=names, samples_s={n: tuple(s) for n, s in samples.items()},
        cycle_s={n: tuple(c) for n, c in cycles.items()}, orders=tuple(orders),
        calls_per_sample={n: block_calls.get(n, 0) for n in names},
        calls_per_burst={n: block_calls[n] * blocks[n] if n in blocks else 0 for n in names},
        warmup_calls=warm, failures=failures, timer="cuda_event" if cuda else "perf_counter_ns",
        stopped_by=stopped_by, baseline=baseline,
        member_stopped_by={n: "failed" if n in failures else "target" if n in known else stopped_by for n in names},
        member_cycles={n: sum(1 for c in cycles[n] if c == c) for n in names}, warmup_s_spent=warm_s)


def _warm_up(fn: Callable[[], object], device: torch.device, warmup_calls: int, warmup_s: float,
             between: Callable[[], object] | None = None) -> tuple[float, int]:
    """Warm ``fn`` up as :func:`attnbench.measure.timing.time_fn` does; its mean call time (``between`` not counted)
    and the calls made."""
    calls, start, spent = 0, time.perf_counter(), 0.0
    while calls < warmup_calls or time.perf_counter() - start < warmup_s:
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        spent += time.perf_counter() - t0
        if between is not None:
            between()
        calls += 1
    return spent / max(calls, 1), calls


def _burst_cpu(fn: Callable[[], object], blocks: int, block_calls: int,
               between: Callable[[], object] | None = None) -> list[float]:
    """Per-call time of each of ``blocks`` blocks of ``block_calls`` calls (``between`` after each block, untimed)."""
    out = []
    for _ in range(blocks):
        t0 = time.perf_counter_ns()
        for _ in range(block_calls):
            fn()
        out.append((time.perf_counter_ns() - t0) * 1e-9 / block_calls)
        if between is not None:
            between()
    return out


def _burst_cuda(fn: Callable[[], object], calls: int, flush: Callable[[], None] | None, device: torch.device,
                between: Callable[[], object] | None = None) -> list[float]:
    """Per-call times of ``calls`` calls from CUDA events (one interval per call), read after a synchronisation
    (``between`` after each call's end event, untimed)."""
    if flush is None and between is None:  # a chain: the end of one call is the start of the next
        events = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
        events[0].record()
        for i in range(calls):
            fn()
            events[i + 1].record()
        pairs = list(zip(events[:-1], events[1:], strict=True))
    else:
        pairs = cuda_event_intervals(fn, calls, flush, between)
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) * 1e-3 for s, e in pairs]


def _settled(samples: dict[str, list[float]], cycles: dict[str, list[float]], active: list[str], baseline: str | None,
             min_samples: int, target_rel_ci: float) -> set[str]:
    """The active members known within the target, on the figure the user reads: with an active baseline, a member's
    paired speed-up against it and the baseline's median (block samples, at least ``min_samples``); without one,
    each member's median."""
    settled = set()
    paired = baseline is not None and baseline in active
    for name in active:
        if paired and name != baseline:
            # one group: the distribution-free interval of the median log ratio, no bootstrap (cheap between cycles)
            s, lo, hi = paired_speedup([cycles[baseline]], [cycles[name]])
            if not (hi - lo) / 2 / s <= target_rel_ci:  # NaN is not settled
                continue
        elif len(samples[name]) < min_samples or not summarize(samples[name])["ci_rel"] <= target_rel_ci:
            continue
        settled.add(name)
    return settled
