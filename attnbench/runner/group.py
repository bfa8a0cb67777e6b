"""Measure one comparison group (cells that differ only in the implementation) and return one row per cell.

The members are built and called once each (compile time apart, as for one cell), then timed together in
alternation (:func:`attnbench.measure.interleave.time_interleaved`) so that a drift of the machine hits
them alike and cancels in their paired speed-ups; peak memory and FLOPs are measured afterwards, one member
at a time. A member that fails (skipped, OOM, exception, invalid output, past its timeout) becomes its own
status row, as :func:`attnbench.runner.cell.run_cell` would record it, and the others carry on. Like
``run_cell``, this never raises for a problem of a member.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
import zlib
from collections.abc import Callable

import torch

from attnbench.measure import accuracy, contention, long_call
from attnbench.measure.interleave import InterleavedTiming, InterleaveSettings, time_interleaved
from attnbench.measure.timing import cuda_graph_replay
from attnbench.resolve import Skip
from attnbench.results.schema import Cell, display_name
from attnbench.runner import budget
from attnbench.runner.cell import (
    Built,
    CellTimeout,
    add_speedups,
    build_and_check,
    close_row,
    compiled_graphs,
    deadline,
    record_contention,
    record_failure,
    record_memory,
    record_timing,
    record_work,
    release,
    resolve_row,
    run_cell,
    start_row,
    torch_threads,
)
from attnbench.runner.sweep import Settings, default_baseline

_GROUPS_MEASURED = itertools.count()
"""Groups measured by this process so far: the default shuffle differs between the rounds a process measures."""

MIN_CYCLES = 6
"""Cycles before a group of two or more may stop on its CIs: fewer ratios give no distribution-free CI."""


def run_group(cells: list[Cell], settings: Settings, run_id: str, *, baseline: str,
              peak_gflops_per_s: float | None = None, on_member: Callable[[str], None] | None = None,
              seed: int | None = None) -> list[dict]:
    """Measure the comparison group ``cells`` (same device, dtype, mode, shape and variant) and return one row
    per cell, in order, with paired speed-ups against ``baseline`` (an implementation as in ``impl`` or as given
    to ``--impl``; rows say why when it cannot be paired, e.g. the baseline failed).

    Each member's sampling gets ``settings.budget_s`` (the group: that times its members). ``cell_timeout_s``
    applies to each member's build and first call, warm-up, each burst, its memory pass and its FLOP count.
    ``on_member(cell_id)`` is called before each of these steps, so a caller can attribute a death of the process.
    ``seed`` shuffles the bursts (default: from ``settings.seed``, the group and the groups this process measured
    before). torch's thread count is restored afterwards.
    """
    with torch_threads(settings.threads):
        return _run_group(cells, settings, run_id, baseline, peak_gflops_per_s, on_member, seed)


def _run_group(cells: list[Cell], settings: Settings, run_id: str, baseline: str, peak_gflops_per_s: float | None,
               on_member: Callable[[str], None] | None, seed: int | None) -> list[dict]:
    ids = [c.cell_id for c in cells]
    if len(set(ids)) != len(ids) or len({c.group_id for c in cells}) > 1:
        raise ValueError(f"not one comparison group of distinct cells: {ids}")
    notify = on_member or (lambda cell_id: None)
    rows = [start_row(c, run_id) for c in cells]
    own_s = [0.0] * len(cells)  # time spent in each member's own steps
    build_s = [0.0] * len(cells)  # of which building (and the first call)
    built: dict[int, Built] = {}
    device = torch.device("cpu")
    try:
        for i, cell in enumerate(cells):
            t0 = time.perf_counter()
            notify(ids[i])
            outcome = resolve_row(cell, rows[i])
            if not isinstance(outcome, Skip):
                device = outcome.device if outcome else device
                ok, b = _step(rows[i], settings, lambda cell=cell, i=i, outcome=outcome: build_and_check(cell, settings, rows[i],
                                                                                                           outcome))
                if ok and b is not None:  # None: an invalid output, the row says so
                    built[i] = b
            build_s[i] = time.perf_counter() - t0
            own_s[i] += build_s[i]

        timed_s = _time_members(cells, settings, rows, built, ids, baseline, notify, seed)
        for i in list(built) if settings.work_pass else []:  # memory, one member at a time: never interleaved
            t0 = time.perf_counter()
            notify(ids[i])  # (a predicted long call's first call measured it: recorded without another call)
            if not _step(rows[i], settings, lambda i=i: record_memory(built[i], rows[i]))[0]:
                del built[i]
            own_s[i] += time.perf_counter() - t0
        # FLOP counting last: FlopCounterMode over an eager FlexAttention leaves Dynamo unable to trace another
        # module, so every member's compiled code is run (timing, memory) before any member is counted
        counting = settings if settings.work_pass else dataclasses.replace(settings, flop_check=False)
        for i in list(built):
            t0 = time.perf_counter()
            notify(ids[i])
            if not _step(rows[i], settings, lambda i=i: record_work(built[i], counting, rows[i], peak_gflops_per_s))[0]:
                del built[i]
            own_s[i] += time.perf_counter() - t0
        accuracy_s = [0.0] * len(cells)  # issue 38: each member's error against the float64 reference, untimed
        for i in list(built) if settings.work_pass else []:
            notify(ids[i])
            _step(rows[i], settings, lambda i=i: accuracy.record(built[i], settings, rows[i], passthrough=(CellTimeout,)))
            accuracy_s[i] = float(rows[i].get("phase_accuracy_s") or 0.0)
        for i, row in enumerate(rows):
            close_row(row)
            row["duration_s"] = own_s[i] + (timed_s if i in built else 0.0) + accuracy_s[i]
            row.update(phase_build_s=build_s[i], phase_work_s=own_s[i] - build_s[i])
    finally:
        built.clear()
        release(device)
    return add_speedups(rows, baseline)


def _default_seed(cell: Cell, settings: Settings) -> int:
    """The shuffle's seed: from the settings' seed, the group, and how many groups this process has measured (a
    later round gets other orders; a fresh process repeats them)."""
    return zlib.crc32(cell.group_id.encode()) + 1_000_003 * settings.seed + next(_GROUPS_MEASURED)


def _step(row: dict, settings: Settings, step: Callable[[], object]) -> tuple[bool, object]:
    """``step()`` under the member's deadline: ``(True, its value)``, or ``(False, None)`` when it raised (the
    row then has the failure)."""
    try:
        with deadline(settings.cell_timeout_s):
            return True, step()
    except Exception as exc:
        record_failure(row, exc)
        return False, None


def _long_first_calls(built: dict[int, Built], ids: list[str], fns: dict) -> dict[str, float]:
    """Members whose first call (made when the cell was built) was a long call (:mod:`~attnbench.measure.long_call`)
    and compiled nothing: that call was their warm-up. A ``compiled:`` member's first call is its compile, never a warm-up."""
    return {ids[i]: b.first_call_s for i, b in built.items()
            if ids[i] in fns and not b.compiled and long_call.is_long(b.first_call_s)}


def _time_members(cells: list[Cell], settings: Settings, rows: list[dict], built: dict[int, Built], ids: list[str],
                  baseline: str, notify: Callable[[str], None], seed: int | None) -> float:
    """Time the built members in alternation and record their timing columns (members that fail there leave
    ``built`` with their failure on their row). Each timed member's share of the timing's wall time."""
    if not built:
        return 0.0
    first = built[next(iter(built))]
    device, cell = first.workload.device, first.cell
    graph = settings.cuda_graph and device.type == "cuda" and cell.mode == "inference"
    fns, between = _timed_steps(settings, rows, built, ids, device, graph)
    if not fns:
        return 0.0
    name = display_name(baseline)
    base = next((ids[i] for i in built if cells[i].impl in (baseline, name) or display_name(cells[i].impl) == name), None)
    graphs = _GraphCounter(fns, any(built[i].compiled for i in built), notify)

    def guard(cid: str):
        return deadline(settings.cell_timeout_s)  # each warm-up and burst: a member past it is dropped as `timeout`

    t0 = time.perf_counter()
    with contention.sampled() as load:  # the group's timed region: what other processes and steal took meanwhile
        sampling = InterleaveSettings(
            warmup_calls=settings.warmup_calls, warmup_s=settings.warmup_s, target_rel_ci=settings.target_rel_ci,
            min_samples=settings.min_samples, min_cycles=MIN_CYCLES if len(fns) > 1 else 1,
            max_cycles=settings.max_samples, budget_s=settings.budget_s * len(fns),
            seed=_default_seed(cell, settings) if seed is None else seed, l2_flush=cell.cache == "cold",
            baseline=base, pairing=settings.pairing)
        timing = time_interleaved(fns, device, sampling, on_burst=graphs.on_burst, guard=guard, between=between,
                                  warmed=_long_first_calls(built, ids, fns))
    graphs.charge()
    share_s = (time.perf_counter() - t0) / len(fns)
    record_phases(rows, ids, timing, time.perf_counter() - t0)
    _record_members(cells, rows, built, ids, fns, timing, graphs, load.result, graph, base)
    return share_s


def _timed_steps(settings: Settings, rows: list[dict], built: dict[int, Built], ids: list[str], device, graph: bool
                 ) -> tuple[dict[str, Callable[[], object]], dict[str, Callable[[], object]]]:
    """Each built member's timed call (a CUDA graph's replay when ``graph``) and, for a decode step whose cache is
    restored (no rewind_cache), the restore run untimed in between. A graph capture that fails is the member's
    failure: it leaves ``built``."""
    fns: dict[str, Callable[[], object]] = {}
    between: dict[str, Callable[[], object]] = {}
    for i in list(built):
        if graph:  # captured per member, outside any timed region
            ok, replay = _step(rows[i], settings, lambda i=i: cuda_graph_replay(built[i].workload.step, device))
            if not ok:
                del built[i]
                continue
            fns[ids[i]] = replay
        else:
            fns[ids[i]] = built[i].workload.timed_step or built[i].workload.step
            if built[i].workload.restore is not None:
                between[ids[i]] = built[i].workload.restore
    return fns, between


class _GraphCounter:
    """Recompiles per member: Dynamo's graph count is per process, so it is read between bursts and the graphs
    compiled since the previous read are charged to the member that ran in between (when any member is compiled)."""

    def __init__(self, fns: dict, counting: bool, notify: Callable[[str], None]):
        self.counting, self.notify = counting, notify
        self.graphs: dict[str, int] = {cid: 0 for cid in fns}
        self.name: str | None = None
        self.count = compiled_graphs() if counting else None

    def charge(self) -> None:
        now = compiled_graphs() if self.counting else None
        if self.name is not None and now is not None and self.count is not None:
            self.graphs[self.name] += now - self.count
        self.count = now

    def on_burst(self, cid: str) -> None:
        self.charge()
        self.name = cid
        self.notify(cid)

    def recompiled(self, cid: str, b: Built) -> int | None:
        """The graphs ``cid`` compiled after its first call, or None when that cannot be told."""
        return self.graphs[cid] if self.counting and b.graphs_after_first is not None and self.count is not None else None


def _record_members(cells: list[Cell], rows: list[dict], built: dict[int, Built], ids: list[str], fns: dict,
                    timing: InterleavedTiming, graphs: _GraphCounter, load, graph: bool, base: str | None) -> None:
    """Each timed member's timing columns, notes and contention from the interleaved ``timing``; a member that
    failed there gets its failure and leaves ``built``."""
    others = len(fns) - 1
    for i in list(built):
        cid = ids[i]
        if cid not in fns:
            continue
        if cid in timing.failures:
            record_failure(rows[i], timing.failures[cid])
            del built[i]
            continue
        b = built[i]
        record_timing(b, rows[i], timing.samples_s[cid], calls_per_sample=timing.calls_per_sample[cid],
                      warmup_calls=timing.warmup_calls[cid], timer="cuda_graph" if graph else timing.timer,
                      stopped_by=timing.member_stopped_by[cid], recompiled=graphs.recompiled(cid, b))
        if timing.member_stopped_by[cid] == "long_call":
            warm_s = b.first_call_s if not b.compiled else (timing.warmup_s_spent or {}).get(cid, math.nan)
            b.notes.append(long_call.note(warm_s, timing.samples_s[cid]))
        record_contention(b, rows[i], load)
        if others:
            dropped = [display_name(cells[j].impl) for j in range(len(cells)) if ids[j] in timing.failures]
            b.notes.append(f"timed in alternation with {others} other implementation(s) in {timing.cycles} cycles of "
                           f"{timing.calls_per_burst[cid]}-call bursts"
                           + (f" ({', '.join(dropped)} dropped when it failed)" if dropped else ""))
        rows[i]["cycle_s"] = [float(c) for c in timing.cycle_s[cid]]
        if timing.pair_base_s is not None and cid != base:  # the baseline's bursts next to this member's
            rows[i]["pair_base_s"] = [float(c) for c in timing.pair_base_s[cid]]
        rows[i]["cycle_groups"] = [timing.cycles]


def record_phases(rows: list[dict], ids: list[str], timing: InterleavedTiming, wall_s: float) -> None:
    """Each timed member's warm-up seconds, its share of the group's timed cycles (the wall time less every warm-up,
    split evenly), the cycles it ran in and why it stopped (issue 30; :mod:`attnbench.runner.phases`)."""
    warm = timing.warmup_s_spent or {}
    cycles_s = max(wall_s - sum(warm.values()), 0.0) / max(len(timing.members), 1)
    for i, cid in enumerate(ids):
        if cid in timing.members:
            rows[i].update(phase_warmup_s=float(warm.get(cid, 0.0)), phase_timed_s=cycles_s,
                           cycles=int(timing.member_cycles[cid]), stopped_by=timing.member_stopped_by[cid])


def measure_unit(cells: tuple[Cell, ...] | list[Cell], settings: Settings, run_id: str, *,
                 peak_gflops_per_s: float | None = None, on_member=None, on_plan=None) -> list[dict]:
    """The rows of a unit measured in this process: :func:`~attnbench.runner.cell.run_cell` for one cell, the
    comparison group timed in alternation (:func:`~attnbench.runner.group.run_group`) for several. What every
    measuring process (this one, a worker, a Ray worker) runs.

    First each cell's cost and memory are predicted (:mod:`attnbench.runner.budget`): ``on_plan(plan)`` gets the
    unit's timeout and announcements when they differ from what the caller assumes (a worker tells its driver), a
    cell predicted not to fit in memory is a ``skipped`` row, and every row records the prediction."""
    cells = list(cells)
    asked = budget.seconds(settings.cell_timeout_s, cells[0])  # what the caller waits for unless told otherwise
    plans, settings = plan_unit(cells, settings, peak_gflops_per_s, on_member)
    announce = [a for a in (p.announcement() for p in plans.values()) if a]
    if on_plan and (announce or settings.cell_timeout_s != asked):
        on_plan({"timeout_s": settings.cell_timeout_s, "announce": announce})
    todo = [c for c in cells if plans[c.cell_id].skip is None]
    if len(cells) == 1 and todo:
        if on_member:
            on_member(cells[0].cell_id)
        measured = [run_cell(cells[0], settings, run_id, peak_gflops_per_s=peak_gflops_per_s)]
    elif todo:
        measured = run_group(todo, settings, run_id, baseline=settings.baseline or default_baseline([c.impl for c in cells]),
                             peak_gflops_per_s=peak_gflops_per_s, on_member=on_member)
    else:
        measured = []
    by_id = {r["cell_id"]: r for r in measured}
    rows = [by_id.get(c.cell_id) or _skipped_row(c, run_id, plans[c.cell_id].skip) for c in cells]
    for cell, row in zip(cells, rows, strict=True):
        row.update(plans[cell.cell_id].columns())
    return rows


def plan_unit(cells: list[Cell], settings: Settings, peak_gflops_per_s: float | None,
              on_member=None) -> tuple[dict[str, budget.Plan], Settings]:
    """Each cell's :class:`~attnbench.runner.budget.Plan` (calibrated under the cell's floor timeout when it may be
    large) and the settings with the unit's timeout in seconds (or None)."""
    plans = {}
    for cell in cells:
        if on_member:
            on_member(cell.cell_id)
        floor = budget.seconds(settings.cell_timeout_s, cell)
        try:
            plans[cell.cell_id] = budget.plan_cell(cell, settings, peak_gflops_per_s, lambda floor=floor: deadline(floor))
        except Exception as exc:  # a prediction that fails (a bug in a cost model) costs the cell its forecast, not its row
            plans[cell.cell_id] = budget.Plan(cell.cell_id, math.nan, math.nan, math.nan, math.nan, floor,
                                              f"no prediction ({type(exc).__name__}: {exc})")
    timeout = budget.unit_timeout(list(plans.values()))
    long = tuple(c for c, p in plans.items() if settings.work_pass and long_call.is_long(p.call_s))
    return plans, dataclasses.replace(settings, cell_timeout_s=timeout, first_call_memory=long)


def _skipped_row(cell: Cell, run_id: str, reason: str) -> dict:
    row = start_row(cell, run_id)
    row.update(status="skipped", error=reason, duration_s=0.0)
    close_row(row)
    return row
