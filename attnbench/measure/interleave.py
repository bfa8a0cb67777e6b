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
from dataclasses import dataclass, field, replace

import torch

from attnbench.devices import synchronize
from attnbench.measure import long_call
from attnbench.measure.stats import paired_speedup, summarize
from attnbench.measure.timing import cuda_event_intervals, gc_paused, l2_flusher

MIN_BURST_S = 0.01
MAX_BURST_S = 0.05
CALLS_PER_BURST_TARGET = 10
"""Default burst length with ``pairing="cycle"``: about 10 calls of the group's slowest member, kept within 10-50 ms
(always at least one call). Short enough that a cycle sees one state of the machine, long enough that switching
members (caches, allocator) is a small part of a burst."""
ADJACENT_BURST = (2, 0.003, 0.02)
"""Calls of the slowest member, minimum and maximum seconds of a burst with ``pairing="adjacent"``: a pair is a
member's burst and the baseline's next to it, so shorter bursts keep its two halves within one state of the machine
(measured on the 2-vCPU VM, 2026-12-02: 12 members at T=256, 9 s a group, 6 repeats: the speed-ups' SD between
repeats was 3.4% with these bursts against 5.7% with the same bursts in a shuffled cycle)."""


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
    stopped_by: str  # ci | long_call (every member a long call, known: attnbench.measure.long_call) | budget | max_cycles | failed
    baseline: str | None
    member_stopped_by: Mapping[str, str] = None  # per member: target (known within it) | long_call | budget | max_cycles | failed
    member_cycles: Mapping[str, int] = None  # per member: the cycles it ran in
    warmup_s_spent: Mapping[str, float] = None  # per member: seconds of warm-up (the rest of the wall time is cycles)
    pair_base_s: Mapping[str, tuple[float, ...]] = None  # pairing "adjacent": per member and cycle, the baseline's
    # per-call time in the bursts right before and after this member's (their geometric mean; NaN where none)
    pairing: str = "cycle"  # cycle: one burst per member and cycle | adjacent: a baseline burst between members

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
        return paired_speedup([self.paired_base(name)], [self.cycle_s[name]], seed=seed)

    def paired_base(self, name: str) -> tuple[float, ...]:
        """The baseline's per-cycle times that ``name``'s are paired with: the adjacent bursts' (pairing
        ``adjacent``), else the baseline's cycle times."""
        if self.pairing == "adjacent" and self.pair_base_s and name != self.baseline:
            return self.pair_base_s[name]
        return self.cycle_s[self.baseline]


PAIRINGS = ("cycle", "adjacent")
"""How a member's bursts are paired with the baseline's. ``cycle``: every member (the baseline too) runs one burst per
cycle, in a shuffled order, and a member's ratio is to the baseline's burst of the same cycle, up to a cycle away.
``adjacent``: the baseline runs between every two members (B m1 B m2 ... B), so each member's burst is paired with
the baseline's bursts right before and after it, milliseconds apart. On a shared VM whose speed changes every 50-500
ms, the adjacent pairs see one state of the machine where a cycle of 12 members does not; the baseline then takes
about half of the cycles' time."""


@dataclass(frozen=True)
class InterleaveSettings:
    """How :func:`time_interleaved` samples a group (each knob is described in its docstring)."""

    warmup_calls: int = 3
    warmup_s: float = 0.05
    target_rel_ci: float = 0.02
    min_samples: int = 10
    min_cycles: int = 6
    max_cycles: int = 10_000
    budget_s: float = 2.0
    burst_s: float | None = None
    min_block_s: float = 1e-3
    seed: int = 0
    l2_flush: bool = False
    baseline: str | None = None
    pairing: str = "cycle"


@dataclass
class _Cycles:
    """What the cycles recorded so far: per-member cycle and paired-baseline times, the orders, why they stopped and
    which members left known within the target."""

    cycles: dict[str, list[float]]
    pairs: dict[str, list[float]]
    orders: list[tuple[str, ...]] = field(default_factory=list)
    stopped_by: str = "max_cycles"
    known: set[str] = field(default_factory=set)
    long: set[str] = field(default_factory=set)  # members that left as long calls (attnbench.measure.long_call)


def time_interleaved(fns: dict[str, Callable[[], object]], device: torch.device | str = "cpu",
                     settings: InterleaveSettings | None = None, *, on_burst: Callable[[str], None] | None = None,
                     guard: Callable[[str], contextlib.AbstractContextManager] | None = None,
                     between: dict[str, Callable[[], object]] | None = None,
                     warmed: dict[str, float] | None = None, **knobs) -> InterleavedTiming:
    """Time the members of ``fns`` (one call = one iteration of a member's workload) in alternation.

    ``settings`` (:class:`InterleaveSettings`), with any of its fields given as keywords (``knobs``) replacing its own:
    each member is warmed up in turn (at least ``warmup_calls`` calls and ``warmup_s`` seconds), which also
    measures its call time; the burst length is then ``burst_s`` (default: about 10 calls of the slowest
    member, within 10-50 ms; adjacent pairs: :data:`ADJACENT_BURST`) and every member's calls per burst are fixed from
    its call time. Each cycle runs every active member's burst once, in an order shuffled per cycle
    (``random.Random(seed)``); with ``pairing="adjacent"`` and a ``baseline``, the baseline's burst also runs between
    every two others and at both ends (:data:`PAIRINGS`). After ``min_cycles`` cycles, a member whose figure the user reads is known within
    ``target_rel_ci`` leaves the cycles: with a ``baseline``, a member's paired speed-up CI and the baseline's median CI
    (its block samples, at least ``min_samples`` of them); without one, each member's median CI (:func:`_settled`).
    The baseline stays while any other member is timed. Sampling stops when every member has left (``ci``), or when the
    members still in the cycles have had their share of ``budget_s`` (and at least 3 cycles; a ceiling, not a quota):
    each cycle's wall time is split evenly among the members that ran in it, and each member's share of the budget is
    ``budget_s / len(fns)``. With no member leaving that is ``budget_s`` of cycles; time a member leaves unspent when
    its figure is known is saved, not handed to the others. Or at ``max_cycles``. ``member_stopped_by`` says
    per member why it stopped (``target`` when it left known, else the group's reason) and ``member_cycles`` how many
    cycles it ran in.

    A member that raises (in warm-up or in a burst) is dropped from later cycles and reported in
    ``failures``; the others carry on. ``on_burst(name)`` is called before each member's warm-up and each
    burst, and ``guard(name)`` (a context manager, e.g. a deadline) is entered around them: both outside
    the timed region. ``between[name]`` (a decode step's cache restore) runs after each of that member's calls,
    outside the timed region: its calls are then timed one by one. ``warmed[name]``: the seconds of a call the member
    already made (untimed here) that was a long call (:mod:`attnbench.measure.long_call`): it gets no further warm-up and that call
    stands for its warm-up call.
    """
    s = replace(settings or InterleaveSettings(), **knobs)  # an unknown knob: TypeError naming it
    device = torch.device(device)
    if s.baseline is not None and s.baseline not in fns:
        raise ValueError(f"baseline {s.baseline!r} is not one of the members {list(fns)}")
    if s.pairing not in PAIRINGS:
        raise ValueError(f"pairing {s.pairing!r}: use one of {', '.join(PAIRINGS)}")
    names = tuple(fns)
    run = _Bursts(fns, device, between or {}, guard or (lambda name: contextlib.nullcontext()), on_burst)
    per_call_s, warm, warm_s = run.warm_all(s.warmup_calls, s.warmup_s, warmed or {})
    run.plan(per_call_s, s.burst_s, s.min_block_s, s.l2_flush, s.pairing == "adjacent" and s.baseline is not None)
    c = _run_cycles(run, names, s, per_call_s)
    failures = run.failures
    return InterleavedTiming(
        members=names, samples_s={n: tuple(x) for n, x in run.samples.items()},
        cycle_s={n: tuple(x) for n, x in c.cycles.items()}, orders=tuple(c.orders),
        calls_per_sample={n: run.block_calls.get(n, 0) for n in names},
        calls_per_burst={n: run.block_calls[n] * run.blocks[n] if n in run.blocks else 0 for n in names},
        warmup_calls=warm, failures=failures, timer="cuda_event" if device.type == "cuda" else "perf_counter_ns",
        stopped_by=c.stopped_by, baseline=s.baseline,
        member_stopped_by={n: "failed" if n in failures else "long_call" if n in c.long else "target" if n in c.known
                           else c.stopped_by for n in names},
        member_cycles={n: sum(1 for x in c.cycles[n] if x == x) for n in names}, warmup_s_spent=warm_s,
        pair_base_s={n: tuple(p) for n, p in c.pairs.items()} if s.pairing == "adjacent" else None, pairing=s.pairing)


def _run_cycles(run: _Bursts, names: tuple[str, ...], s: InterleaveSettings,
                per_call_s: dict[str, float] | None = None) -> _Cycles:
    """Run cycles until every member is known within the target (or, a long call, by :func:`_long_known`), the budget
    is spent, every member failed, or ``max_cycles`` (see :func:`time_interleaved`)."""
    c = _Cycles(cycles={name: [] for name in names}, pairs={name: [] for name in names})
    rng = random.Random(s.seed)
    active = [n for n in names if n not in run.failures]
    c.stopped_by = "max_cycles" if active else "failed"
    # each member's share of the cycles' time so far, against its share of the budget (see the docstring)
    share_s, per_member_s = 0.0, s.budget_s / max(len(names), 1)
    last = _clock()
    while active and len(c.orders) < s.max_cycles:
        in_cycle = len(active)
        # a long baseline runs once per cycle: adjacent pairs would repeat a call of seconds to minutes around every
        # member, for a pairing whose point (milliseconds apart) a long call does not have (attnbench.measure.long_call)
        long_base = long_call.is_long((per_call_s or {}).get(s.baseline))
        order = _order(rng, active, s.baseline, "cycle" if long_base else s.pairing)
        with gc_paused():  # the collector runs between cycles, untimed (attnbench.measure.timing.gc_paused)
            times = run.cycle(order, active)
        _record_cycle(order, times, s.baseline, c.cycles, c.pairs)
        c.orders.append(order)
        if not active:
            c.stopped_by = "failed"
            break
        long = _long_known(run.samples, per_call_s or {}, active)
        settled = set(long)
        if len(c.orders) >= s.min_cycles:
            paired_to = c.pairs if s.pairing == "adjacent" else None
            settled |= _settled(run.samples, c.cycles, active, s.baseline, s.min_samples, s.target_rel_ci, paired_to)
        if settled and settled == set(active):
            c.known |= settled
            c.long |= long
            c.stopped_by = "long_call" if long == settled else "ci"
            break
        # a member known well enough (its median, and its speed-up against the baseline) leaves the cycles,
        # so the group's time goes to the members still short of the target; the baseline stays while any
        # other member is timed, since every paired ratio needs it in the same cycle
        leaving = settled - {s.baseline}
        c.known |= leaving
        c.long |= long & leaving
        active[:] = [n for n in active if n not in leaving]
        now = _clock()
        share_s, last = share_s + (now - last) / in_cycle, now
        if share_s > per_member_s and len(c.orders) >= min(3, s.max_cycles):
            c.stopped_by = "budget"
            break
    return c


def _long_known(samples: dict[str, list[float]], per_call_s: dict[str, float], active: list[str]) -> set[str]:
    """The active members that are long calls known from their timed calls (:func:`attnbench.measure.long_call.known`)."""
    return {name for name in active if long_call.known(per_call_s.get(name), samples[name])}


_clock = time.perf_counter
"""The clock the budget is charged by (tests replace it with a synthetic one)."""


def _order(rng: random.Random, active: list[str], baseline: str | None, pairing: str) -> tuple[str, ...]:
    """One cycle's bursts: the active members shuffled; ``adjacent``: the baseline between every two and at both ends."""
    if pairing != "adjacent" or baseline not in active or len(active) < 2:
        return tuple(rng.sample(active, len(active)))
    others = [n for n in active if n != baseline]
    order = [baseline]
    for name in rng.sample(others, len(others)):
        order += [name, baseline]
    return tuple(order)


def _record_cycle(order: tuple[str, ...], times: list[float], baseline: str | None, cycles: dict[str, list[float]],
                  pairs: dict[str, list[float]]) -> None:
    """A cycle's per-call times (NaN: the burst failed) into each member's cycle time (the baseline's: the mean of its
    bursts) and, for the others, the geometric mean of the baseline's bursts next to theirs (``pairs``)."""
    for name in cycles:
        cycles[name].append(math.nan)
        pairs[name].append(math.nan)
    base = [t for n, t in zip(order, times, strict=True) if n == baseline and t == t]
    if base:
        cycles[baseline][-1] = sum(base) / len(base)
    for k, (name, t) in enumerate(zip(order, times, strict=True)):
        if name == baseline or t != t:
            continue
        cycles[name][-1] = t
        near = [times[j] for j in (k - 1, k + 1) if 0 <= j < len(order) and order[j] == baseline and times[j] == times[j]]
        if near:
            pairs[name][-1] = math.exp(sum(math.log(x) for x in near) / len(near))


class _Bursts:
    """The members' warm-up and bursts: their calls per block and blocks per burst, samples and failures."""

    def __init__(self, fns, device, between, guard, on_burst):
        self.fns, self.device, self.between, self.guard, self.on_burst = fns, device, between, guard, on_burst
        self.failures: dict[str, BaseException] = {}
        self.samples: dict[str, list[float]] = {name: [] for name in fns}
        self.block_calls: dict[str, int] = {}
        self.blocks: dict[str, int] = {}
        self.flush = None

    def warm_all(self, warmup_calls: int, warmup_s: float, warmed: dict[str, float]):
        """Warm every member up in turn (a long call ``warmed`` already made stands for it): per-call times, calls
        made and seconds spent, per member."""
        per_call_s = {name: t for name, t in warmed.items() if name in self.fns and long_call.is_long(t)}
        warm = {name: 0 for name in self.fns}
        warm_s = {name: 0.0 for name in self.fns}
        for name in [n for n in self.fns if n not in per_call_s]:
            t_warm = time.perf_counter()
            try:
                if self.on_burst:
                    self.on_burst(name)
                with self.guard(name):
                    per_call_s[name], warm[name] = _warm_up(self.fns[name], self.device, warmup_calls, warmup_s,
                                                            self.between.get(name))
            except Exception as exc:  # the member is out; the group goes on
                self.failures[name] = exc
            warm_s[name] = time.perf_counter() - t_warm
        return per_call_s, warm, warm_s

    def plan(self, per_call_s: dict[str, float], burst_s: float | None, min_block_s: float, l2_flush: bool,
             adjacent: bool = False) -> None:
        """Each member's calls per timed block and blocks per burst, so that every burst lasts about ``burst_s``
        (default: :data:`CALLS_PER_BURST_TARGET`, or :data:`ADJACENT_BURST` for adjacent pairs)."""
        cuda = self.device.type == "cuda"
        if burst_s is None:
            calls, low, high = ADJACENT_BURST if adjacent else (CALLS_PER_BURST_TARGET, MIN_BURST_S, MAX_BURST_S)
            slowest = max(per_call_s.values(), default=0.0)
            burst_s = min(max(calls * slowest, low), high)
        # calls per burst: `blocks` timed blocks of `block_calls` calls (CUDA: one call per event interval)
        self.block_calls = {n: 1 if cuda or n in self.between else max(1, math.ceil(min_block_s / max(t, 1e-9)))
                            for n, t in per_call_s.items()}
        self.blocks = {n: max(1, round(burst_s / max(t * self.block_calls[n], 1e-9))) for n, t in per_call_s.items()}
        self.flush = l2_flusher(self.device) if cuda and l2_flush else None

    def cycle(self, order: tuple[str, ...], active: list[str]) -> list[float]:
        """Run the bursts of ``order``; each burst's per-call time (NaN where it failed: that member leaves ``active``)."""
        out = []
        for name in order:
            if name not in active:  # failed earlier in this cycle
                out.append(math.nan)
                continue
            try:
                if self.on_burst:
                    self.on_burst(name)
                with self.guard(name):
                    synchronize(self.device)  # the previous member's work is finished before this burst starts
                    burst = self.burst(name)
            except Exception as exc:
                self.failures[name] = exc
                active.remove(name)
                out.append(math.nan)
                continue
            self.samples[name].extend(burst)
            out.append(sum(burst) / len(burst))  # blocks are equally long: their mean is the per-call time
        return out

    def burst(self, name: str) -> list[float]:
        fn, between = self.fns[name], self.between.get(name)
        if self.device.type == "cuda":
            return _burst_cuda(fn, self.blocks[name], self.flush, self.device, between)
        return _burst_cpu(fn, self.blocks[name], self.block_calls[name], between)


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
        if calls == 0 and long_call.is_long(spent):  # a long call: one is warm-up enough (attnbench.measure.long_call)
            calls = warmup_calls = 1
            warmup_s = 0.0
            if between is not None:
                between()
            break
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
             min_samples: int, target_rel_ci: float, pairs: dict[str, list[float]] | None = None) -> set[str]:
    """The active members known within the target, on the figure the user reads: with an active baseline, a member's
    paired speed-up against it (``pairs[name]``: its adjacent baseline bursts, else the baseline's cycles) and the
    baseline's median (block samples, at least ``min_samples``); without one, each member's median."""
    settled = set()
    paired = baseline is not None and baseline in active
    for name in active:
        if paired and name != baseline:
            # one group: the distribution-free interval of the median log ratio, no bootstrap (cheap between cycles)
            s, lo, hi = paired_speedup([pairs[name] if pairs else cycles[baseline]], [cycles[name]])
            if not (hi - lo) / 2 / s <= target_rel_ci:  # NaN is not settled
                continue
        elif len(samples[name]) < min_samples or not summarize(samples[name])["ci_rel"] <= target_rel_ci:
            continue
        settled.add(name)
    return settled
