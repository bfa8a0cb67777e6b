"""Measure one cell and turn whatever happens into one results row.

This is the unit every executor runs: in-process (local), in a fresh subprocess (``--isolate``) and
on a Ray worker. It never raises for a problem of the cell itself: the row's ``status`` and
``error`` say what happened (``ok``, ``oom``, ``error``, ``timeout``, ``invalid``, ``skipped``).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
import zlib
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import torch

from attnbench.devices import device_name, synchronize
from attnbench.errors import (
    AttnbenchError,
    CellTimeout,
    InvalidSpecError,
    PluginLoadError,
    SweepError,
    UnavailableError,
    UnknownImplementationError,
)
from attnbench.measure import (
    accuracy,
    contention,
    counted_flops,
    decode_bytes,
    decode_rates,
    kv_cache_bytes_analytic,
    long_call,
    peak_gbytes_per_s,
    peak_gflops,
    peak_memory,
    roofline,
    time_fn,
)
from attnbench.measure.memory import MemoryResult
from attnbench.measure.stats import paired_speedup, split_groups, summarize, summarize_groups
from attnbench.models.generate import rescaled_rates
from attnbench.plugins.measured import REPEAT_ALARM_S
from attnbench.registry import resolve
from attnbench.resolve import Ready, Skip
from attnbench.results.schema import Cell, clear_measurements, display_name, empty_row
from attnbench.results.text import fmt_time
from attnbench.runner import budget, compile_cache, phases
from attnbench.runner import properties as run_properties
from attnbench.runner.masks import mask_columns
from attnbench.runner.sweep import Settings

if TYPE_CHECKING:
    from attnbench.runner.workload import Workload


@contextlib.contextmanager
def deadline(seconds: float | str | None, stopped_at: list | None = None):
    """Raise :class:`CellTimeout` in this (main) thread after ``seconds`` (``"auto"``: the default floor); the frame
    the first alarm interrupted is appended to ``stopped_at`` when given (where a hang was).

    In-process this interrupts Python-level hangs; a hang inside one native kernel call is only
    interrupted when it returns to Python, so use ``--isolate`` (a subprocess that is killed) for those.
    The alarm repeats every :data:`~attnbench.plugins.measured.REPEAT_ALARM_S` (the probes' interval) until the block
    ends, and a block that ends after the alarm by any other way (code that swallowed the :class:`CellTimeout`, a
    probe's ``except Exception`` that tried the next guess or turned it into a refusal) raises :class:`CellTimeout`
    then: a cell past its deadline is a ``timeout`` row, ended in-process, never a refusal or an ``error`` that the
    timing of a busy machine chose.
    """
    seconds = budget.seconds(seconds)  # "auto" without a plan (a direct call): the floor
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return
    message = f"cell exceeded its timeout of {seconds:g} s (--cell-timeout SECONDS or none to change it)"
    fired = []  # set once the alarm has gone off

    def on_alarm(signum, frame):
        if stopped_at is not None and not fired:
            stopped_at.append(frame)
        fired.append(True)
        raise CellTimeout(message)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, REPEAT_ALARM_S)
    try:
        yield
    except CellTimeout:
        raise
    except Exception as exc:
        if fired:  # what the swallowed alarm became (a refusal, an error): the cause is the deadline
            raise CellTimeout(message) from exc
        raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if fired:  # the block swallowed every alarm and finished late
        raise CellTimeout(message)


@contextlib.contextmanager
def torch_threads(threads: int | None):
    """torch's intra-op thread count set to ``threads`` for the block (unchanged when None), then restored."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(exc)
    return "out of memory" in text.lower() or "can't allocate memory" in text or "DefaultCPUAllocator" in text


def release(device: torch.device) -> None:
    """Forget what the cells measured here left behind (Dynamo's state, garbage, the CUDA cache)."""
    # Cells must not interact through torch.compile's in-memory state: FlopCounterMode over an eager
    # FlexAttention call (which compiles internally) leaves Dynamo unable to trace the next one, and a
    # compiled cell's caches would make the next cell's compile time look shorter.
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def skip_reason(cell: Cell) -> str | None:
    """Why ``cell`` cannot run here (:func:`attnbench.resolve.resolve`), or ``None``.

    An unknown or broken plug-in is not a skip: it becomes an ``error`` row when the cell is built.
    """
    try:
        return resolve(cell.impl, cell).reason
    except (UnknownImplementationError, PluginLoadError):
        return None


def run_cell(cell: Cell, settings: Settings = Settings(), run_id: str = "", peak_gflops_per_s: float | None = None) -> dict:
    """Measure ``cell`` and return its results row (never raises for a failure of the cell).

    ``peak_gflops_per_s``: the machine's peak for the cell's device and dtype when the caller measured it
    already (a subprocess per cell would otherwise measure it again in every cell's time window).
    torch's thread count is restored afterwards when ``settings.threads`` changed it.
    """
    with torch_threads(settings.threads):
        return _run_cell(cell, settings, run_id, peak_gflops_per_s)


def _run_cell(cell: Cell, settings: Settings, run_id: str, peak_gflops_per_s: float | None) -> dict:
    row = start_row(cell, run_id)
    t_start = time.perf_counter()
    outcome = resolve_row(cell, row)
    if isinstance(outcome, Skip):
        row["duration_s"] = time.perf_counter() - t_start
        return row
    device = outcome.device if outcome else torch.device("cpu")
    built = None
    try:
        with deadline(settings.cell_timeout_s):  # one deadline for the whole cell
            built = build_and_check(cell, settings, row, outcome)
            row["phase_build_s"] = time.perf_counter() - t_start
            if built is not None:
                _measure(built, settings, row, peak_gflops_per_s)
    except Exception as exc:
        record_failure(row, exc)
    finally:
        if not row["phase_build_s"] == row["phase_build_s"]:  # failed while building: all of it was building
            row["phase_build_s"] = time.perf_counter() - t_start
        close_row(row)  # the phase columns are kept: the time was spent either way
        del built
        release(device)
    row["duration_s"] = time.perf_counter() - t_start
    return row


# ---------------------------------------------------------------- the steps of measuring a cell
# run_cell runs them for one cell under one deadline; attnbench.runner.group runs them for every member of a
# comparison group, each step under the member's own deadline, with the timing interleaved between members.

@dataclass
class Built:
    """A cell built and called once with a valid output: ready to time. ``notes`` collect what the row's notes say."""

    cell: Cell
    workload: Workload
    first_call_s: float  # the first call (compiles compiled: cells)
    graphs_before: int | None  # Dynamo's graph count before the first call (compiled cells only)
    graphs_after_first: int | None
    notes: list[str] = field(default_factory=list)
    compile_cache: str = ""  # compiled cells: cold | warm (attnbench.runner.compile_cache), '' when not known
    output: torch.Tensor | None = None  # issue 38: the first call's output, judged by the accuracy pass (then dropped)
    first_memory: MemoryResult | None = None  # the first call's peak memory (a predicted long call: long_call)

    @property
    def compiled(self) -> bool:
        """Whether the cell is a ``compiled:`` one (its compile time and recompiles are recorded)."""
        return self.cell.impl.startswith("compiled:")


def start_row(cell: Cell, run_id: str) -> dict:
    """A fresh row for ``cell`` with where and when it is measured (status ``error`` until a step says otherwise)."""
    row = empty_row(cell, run_id)
    row.update(host=socket.gethostname(), worker=f"pid{os.getpid()}",
               started_at=datetime.now(UTC).isoformat(timespec="microseconds"))
    row["threads"] = torch.get_num_threads()
    return row


def resolve_row(cell: Cell, row: dict) -> Ready | Skip | None:
    """:func:`attnbench.resolve.resolve` of ``cell``; a :class:`Skip` also marks the row ``skipped`` with the reason.
    None for an unknown name or mode (building the cell raises it again, into a row with its status)."""
    try:
        outcome = resolve(cell.impl, cell)
    except AttnbenchError:
        return None
    if isinstance(outcome, Skip):
        row.update(status="skipped", error=outcome.reason)
    return outcome


def build_and_check(cell: Cell, settings: Settings, row: dict, ready: Ready | None) -> Built | None:
    """Build ``cell``'s workload, call it once and check the output. None when the output is invalid (the row
    says why, status ``invalid``); raises for every other failure (:func:`record_failure` turns it into the row)."""
    from attnbench.runner.workload import build_workload

    row["device_name"] = device_name(ready.device if ready else torch.device("cpu"))
    workload = build_workload(cell, seed=settings.seed, ready=ready, setup=settings.setup)
    compiled = cell.impl.startswith("compiled:")
    # Importing torch._dynamo costs seconds: only compiled cells count graphs.
    graphs_before = compiled_graphs() if compiled else None
    cache_before = compile_cache.counts() if compiled else None
    call = (None if compiled else getattr(workload, "first_call", None)) or workload.step  # a generation's observes
    memory, got = None, []  # its attention; a predicted long call's first call measures peak memory too (long_call)
    t0 = time.perf_counter()
    with compile_cache.all_cores() if compiled else contextlib.nullcontext():  # a compile uses the run's cores
        if cell.cell_id in settings.first_call_memory and not compiled:
            memory = peak_memory(lambda: got.append(call()), workload.device)
            out = got[0]
        else:
            out = call()  # the first call: compiles compiled: cells, checks the output
        synchronize(workload.device)
    first_call_s = time.perf_counter() - t0
    cache = compile_cache.state(cache_before, compile_cache.counts()) if compiled else ""
    problem = workload.check_output(out)
    if problem:
        del out
        row.update(status="invalid", error=problem)
        return None
    return Built(cell, workload, first_call_s, graphs_before, compiled_graphs() if compiled else None,
                 compile_cache=cache, output=out.detach(), first_memory=memory)


def record_timing(built: Built, row: dict, samples_s, *, calls_per_sample: int, warmup_calls: int, timer: str,
                  stopped_by: str, recompiled: int | None) -> dict[str, float]:
    """The timing columns of ``row`` from a cell's samples (and its compile time and recompiles); the statistics.

    ``warmup_calls`` excludes the first call (counted here); ``recompiled``: graphs Dynamo compiled during
    warm-up and timing (None when not counted)."""
    stats = summarize(samples_s)
    row.update(stats)
    row.update(samples_s=list(samples_s), calls_per_sample=calls_per_sample, warmup_calls=warmup_calls + 1, timer=timer)
    built.notes.append(f"sampling stopped by {stopped_by}")
    if built.compiled:
        row["compile_s"] = max(built.first_call_s - stats["median_s"], 0.0)
        row["compile_cache"] = built.compile_cache
        if built.graphs_before is None or built.graphs_after_first is None or recompiled is None:
            built.notes.append("recompiles not counted: this torch has no torch._dynamo.utils.counters")
        else:
            row["recompiles"] = float(recompiled)
            if built.graphs_after_first - built.graphs_before > 1:
                built.notes.append(f"{built.graphs_after_first - built.graphs_before} graphs compiled on the first call "
                                   "(graph breaks)")
            if recompiled > 0:
                built.notes.append(f"RECOMPILED {recompiled}x during warm-up/timing: timings include compilation")
    return stats


def record_contention(built: Built, row: dict, load: contention.Contention) -> None:
    """The share of the machine's CPU time other processes and steal took while the cell was timed
    (:mod:`attnbench.measure.contention`), and a note when it was contended or could not be measured."""
    row.update(load.row_fields())
    if load.note:
        built.notes.append(load.note)


def record_memory(built: Built, row: dict) -> None:
    """Peak memory of one step, measured on its own (never while another cell runs): a predicted long call's first
    call measured it already (the profiler's overhead then lands in that call, its warm-up, not in a timed one)."""
    mem = built.first_memory
    if mem is not None:
        built.notes.append("peak memory from the first call (a long call is not repeated for it)")
    else:
        mem = peak_memory(built.workload.step, built.workload.device)
    row.update(peak_bytes=mem.peak_bytes, peak_reserved_bytes=mem.peak_reserved_bytes, memory_method=mem.method)


def record_work(built: Built, settings: Settings, row: dict, peak_gflops_per_s: float | None = None) -> None:
    """FLOPs (the model, and counted unless compiled), throughput against the machine's peak, the KV cache of decode
    cells; then the row is ``ok`` with its notes."""
    cell, workload = built.cell, built.workload
    flops = workload.analytic_flops()
    row["flops"] = flops
    row.update(mask_columns(cell))  # issue 37: which FLOP count, and the mask's density
    if cell.mode == "decode":
        row["kv_cache_bytes"] = workload.kv_cache_bytes
        row["kv_cache_bytes_analytic"] = kv_cache_bytes_analytic(cell.batch, cell.seq_len, cell.kv_heads, cell.head_dim,
                                                                 cell.window, workload.x.element_size())
        row.update(decode_rates(decode_bytes(cell.batch, cell.seq_len, cell.d_model, cell.d_model, num_heads=cell.num_heads,
                                             num_kv_heads=cell.num_kv_heads, window=cell.window,
                                             element_bytes=workload.x.element_size()),
                                row["median_s"], peak_gbytes_per_s(str(workload.device))))
    long = long_call.is_long(row.get("median_s"))
    if settings.flop_check and not built.compiled and not long:
        # Under FlopCounterMode a compiled module recompiles (the mode fails its guards): counting
        # would cost a compile and measure the counter's trace, so compiled cells keep the model only.
        row["flops_counted"] = counted_flops(workload.step)
    elif settings.flop_check and long:
        built.notes.append("FLOPs not counted: a long call (the count would repeat it); the analytic model stands")
    row["gflops_per_s"] = flops / row["median_s"] / 1e9
    peak = peak_gflops_per_s or peak_gflops(str(workload.device), cell.dtype)
    notes = [*built.notes, *workload.notes]
    if row["gflops_per_s"] > peak:  # the peak met a busy moment: measure it again, keep the best
        peak = max(peak, peak_gflops(str(workload.device), cell.dtype, again=True))
        if row["gflops_per_s"] > peak:
            notes.append(f"{row['gflops_per_s']:.3g} GFLOP/s exceeds the peak GEMM measured here ({peak:.3g}), even "
                         "measured again: the fraction of peak is an upper bound")
    row["peak_gflops_per_s"] = peak
    row["frac_peak"] = row["gflops_per_s"] / peak
    row.update(workload.extra_columns(row["median_s"]))
    if settings.work_pass:  # issue 48; later rounds keep the first round's (merge_rounds), as memory and FLOPs
        props, note = run_properties.columns(workload, built.compiled, row["median_s"])
        row.update(props)
        notes += [note] if note else []
    row["status"] = "ok"
    row["notes"] = "; ".join(notes)
    roofline.record(row, str(workload.device))  # issue 49: intensity, bound, headroom against the cached ceilings


def record_failure(row: dict, exc: BaseException) -> None:
    """The status and error of a cell that raised: ``timeout``, ``skipped`` (impossible here), ``oom`` or ``error``."""
    if isinstance(exc, CellTimeout):
        row.update(status="timeout", error=str(exc))
    elif isinstance(exc, UnavailableError | InvalidSpecError | SweepError):
        row.update(status="skipped", error=str(exc))
    elif _is_oom(exc):
        row.update(status="oom", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    else:
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        at = f" (at {os.path.basename(where.filename)}:{where.lineno})" if where else ""
        first = str(exc).splitlines()[0][:500] if str(exc) else ""
        row.update(status="error", error=f"{type(exc).__name__}: {first}{at}")


def close_row(row: dict) -> None:
    """A row that is not ``ok`` loses every measurement it may have half-recorded
    (:func:`attnbench.results.schema.clear_measurements`)."""
    if row["status"] != "ok":
        clear_measurements(row)


def _measure(built: Built, settings: Settings, row: dict, peak_gflops_per_s: float | None = None) -> None:
    """One cell timed on its own (:func:`attnbench.measure.timing.time_fn`), then its memory and work."""
    cell, device = built.cell, built.workload.device
    workload = built.workload
    t0 = time.perf_counter()
    with contention.sampled() as load:  # what other processes and steal took while this cell was timed
        timing = time_fn(workload.timed_step or workload.step, device, between=workload.restore,  # restore: untimed
                         warmup_calls=settings.warmup_calls, warmup_s=settings.warmup_s,
                         target_rel_ci=settings.target_rel_ci, min_samples=settings.min_samples,
                         max_samples=settings.max_samples, budget_s=settings.budget_s,
                         l2_flush=cell.cache == "cold", cuda_graph=settings.cuda_graph and cell.mode == "inference",
                         warmed_s=None if built.compiled else built.first_call_s)  # a long first call warmed it up
    record_contention(built, row, load.result)
    if timing.stopped_by == "long_call":
        built.notes.append(long_call.note(timing.warm_call_s, timing.samples_s))
    graphs_after_timing = compiled_graphs() if built.compiled else None
    recompiled = (graphs_after_timing - built.graphs_after_first
                  if graphs_after_timing is not None and built.graphs_after_first is not None else None)
    record_timing(built, row, timing.samples_s, calls_per_sample=timing.calls_per_sample, warmup_calls=timing.warmup_calls,
                  timer=timing.timer, stopped_by=timing.stopped_by, recompiled=recompiled)
    row["stopped_by"] = "target" if timing.stopped_by == "ci" else timing.stopped_by
    t1 = time.perf_counter()
    row["phase_timed_s"] = t1 - t0  # time_fn's warm-up included: it does not report it apart
    if settings.work_pass:  # later rounds keep the first round's memory and counted FLOPs (sweep.for_round)
        record_memory(built, row)
    record_work(built, settings if settings.work_pass else replace(settings, flop_check=False), row, peak_gflops_per_s)
    row["phase_work_s"] = time.perf_counter() - t1
    if settings.work_pass:  # issue 38: the error against the float64 reference, untimed (attnbench.measure.accuracy)
        accuracy.record(built, settings, row, passthrough=(CellTimeout,))


def merge_rounds(rows: list[dict], processes: int = 1, drift: float = 0.0) -> dict:
    """One row from the rows of the same ok cell measured in several rounds (and processes): raw samples
    pooled, in groups (``sample_groups``) over which the CI is hierarchical; peak memory is the largest
    seen; compile time is the first round's. ``stability`` says whether the groups agree and the samples
    have one mode (both modes go into ``notes`` when not). A single row keeps its statistics and gets
    ``stability``. Either way the CI is widened by the between-run term ``drift``
    (:mod:`attnbench.measure.drift`; ``ci_within_rel`` keeps the CI before widening, ``drift_rel`` the term)."""
    merged = dict(rows[0])
    groups = [list(r["samples_s"]) for r in rows]
    stats, modes = summarize_groups(groups, seed=zlib.crc32(str(merged.get("cell_id")).encode()), drift=drift)
    merged.update({k: stats[k] for k in ("ci_low_s", "ci_high_s", "ci_rel", "ci_within_rel", "drift_rel")})
    merged["sample_groups"] = [len(g) for g in groups]
    # burst cycles (interleaved groups): concatenated in the same order, one cycle group per round and process
    merged["cycle_s"] = [float(c) for r in rows for c in _as_list(r.get("cycle_s"))]
    merged["cycle_groups"] = [int(n) for r in rows for n in _cycle_groups(r)]
    merged["pair_base_s"] = [float(c) for r in rows for c in _as_list(r.get("pair_base_s"))]
    merged["stability"] = "unstable" if modes else "stable"
    notes = [modes.text()] if modes else []
    if len(rows) > 1:
        merged.update(stats)
        merged["samples_s"] = [s for g in groups for s in g]
        for key in ("peak_bytes", "peak_reserved_bytes"):
            values = [r[key] for r in rows if r[key] is not None and r[key] == r[key]]
            merged[key] = max(values) if values else math.nan
        merged["gflops_per_s"] = merged["flops"] / merged["median_s"] / 1e9
        merged["frac_peak"] = merged["gflops_per_s"] / merged["peak_gflops_per_s"]
        if merged.get("mode") == "decode":
            merged.update(decode_rates(merged["decode_bytes"], merged["median_s"], merged["peak_gbytes_per_s"]))
        merged.update(rescaled_rates(rows[0], merged["median_s"]))  # generation's tokens/s from the pooled median
        merged.update(roofline.coordinates(merged))  # issue 49: attainable time and headroom of the pooled median
        recompiles = [r["recompiles"] for r in rows if r["recompiles"] == r["recompiles"]]
        merged["recompiles"] = float(sum(recompiles)) if recompiles else math.nan
        merged["warmup_calls"] = sum(r["warmup_calls"] for r in rows)
        merged["duration_s"] = sum(r["duration_s"] for r in rows)
        # one round's speed-up is not the run's: add_speedups pairs the merged cycles of the whole group
        merged.update(speedup=math.nan, speedup_ci_low=math.nan, speedup_ci_high=math.nan)
        workers = list(dict.fromkeys(str(r.get("worker") or "") for r in rows))
        merged["worker"] = ", ".join(w for w in workers if w)
        merged.update(contention.merge(rows))
        notes.append(contention.merge_note(rows))
        medians = ", ".join(fmt_time(r["median_s"]) for r in rows)
        rounds = len(rows) // processes
        how = f"{rounds} rounds" + (f" x {processes} processes" if processes > 1 else "")
        notes.append(f"{how} in shuffled order, round medians {medians}")
    merged["notes"] = "; ".join(n for n in (*notes, rows[0]["notes"]) if n)
    merged.update(phases.merged_columns(rows))
    merged.update(accuracy.merged_columns(rows))  # issue 38: the round that measured the error
    merged.update(run_properties.merged_columns(rows))  # issue 48: the round that measured them
    return merged


def _as_list(values) -> list:
    """A list column's value as a list (None, NaN from an older table, or an array read back from Parquet)."""
    if values is None or isinstance(values, float | str):
        return []
    return list(values)


def _cycle_groups(row: dict) -> list[int]:
    """The sizes of a row's cycle groups: ``cycle_groups``, or one group of all its cycles when that is absent."""
    groups = _as_list(row.get("cycle_groups"))
    cycles = _as_list(row.get("cycle_s"))
    if groups and sum(int(n) for n in groups) == len(cycles):
        return [int(n) for n in groups]
    return [len(cycles)] if cycles else []


def add_speedups(rows: list[dict], baseline: str) -> list[dict]:
    """The rows of one comparison group (merged over rounds and processes, any status) with ``baseline``,
    ``speedup`` and its CI filled in against the baseline implementation (a name as in ``impl`` or as given to
    ``--impl``): from each member's ``cycle_s`` and the baseline's (its bursts next to the member's, ``pair_base_s``,
    with adjacent pairs), paired cycle by cycle within each cycle group (:func:`attnbench.measure.stats.paired_speedup`).
    The baseline's own row gets 1.0. A speed-up that cannot be paired is NaN and the row's notes say why; the notes of
    an unstable member's (or against an unstable baseline's) speed-up say so."""
    name = display_name(baseline)
    base = next((r for r in rows if r.get("impl") == name or r.get("impl") == baseline), None)
    out = []
    for row in rows:
        row = {**row, "baseline": name, "speedup": math.nan, "speedup_ci_low": math.nan, "speedup_ci_high": math.nan}
        out.append(row)
        if row.get("status") != "ok":
            continue  # its status says what happened; it has no time to compare
        why = None
        if base is None:
            why = f"no speed-up: the baseline {name} is not in this group"
        elif base.get("status") != "ok":
            failed = "was skipped" if base.get("status") == "skipped" else "failed"
            why = f"no speed-up: the baseline {name} {failed} ({base.get('status')}: {base.get('error') or 'no reason given'})"
        elif row.get("cell_id") == base.get("cell_id"):
            row.update(speedup=1.0, speedup_ci_low=1.0, speedup_ci_high=1.0)
        else:
            mine, theirs = _cycle_groups(row), _cycle_groups(base)
            if not mine or not theirs:
                why = "no speed-up: not timed in alternation with the baseline (no burst cycles)"
            elif mine != theirs:
                why = (f"no speed-up: its cycles ({'+'.join(map(str, mine))}) do not line up with the baseline's "
                       f"({'+'.join(map(str, theirs))})")
            else:
                seed = zlib.crc32(str(row.get("cell_id")).encode())
                pairs = paired_base(row, base), _as_list(row["cycle_s"])
                s, lo, hi = paired_speedup(split_groups(pairs[0], mine), split_groups(pairs[1], mine), seed=seed)
                if s == s and sum(1 for b, m in zip(*pairs, strict=True) if math.isfinite(b) and math.isfinite(m)) < 2:
                    row.update(speedup=s, speedup_ci_low=math.nan, speedup_ci_high=math.nan)
                    why = ("speed-up from one paired cycle (a long call leaves after one): no interval; --rounds 2 "
                           "gives one")
                elif s == s:
                    row.update(speedup=s, speedup_ci_low=lo, speedup_ci_high=hi)
                else:
                    why = f"no speed-up: no burst cycle in which both it and the baseline {name} ran"
            unstable = [who for who, r in (("this implementation", row), (f"the baseline {name}", base))
                        if r.get("stability") == "unstable"]
            if why is None and unstable:
                why = (f"speed-up of unstable timings ({' and '.join(unstable)} "
                       f"{'have' if len(unstable) > 1 else 'has'} two modes): read it with care")
        if why:
            row["notes"] = "; ".join(n for n in (row.get("notes"), why) if n)
    return out


def paired_base(row: dict, base: dict) -> list[float]:
    """The baseline's per-cycle times ``row``'s are paired with: its adjacent baseline bursts (``pair_base_s``, adjacent
    pairs) when it has them for every cycle, else the baseline's own cycle times."""
    adjacent = _as_list(row.get("pair_base_s"))
    return adjacent if len(adjacent) == len(_as_list(row.get("cycle_s"))) and adjacent else _as_list(base["cycle_s"])


def compiled_graphs() -> int | None:
    """Graphs Dynamo has compiled in this process, or None when this torch does not count them.

    ``torch._dynamo.utils.counters`` is not public API: this is its one use.
    """
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except (ImportError, AttributeError, KeyError, TypeError):
        return None
