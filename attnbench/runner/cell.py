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
from datetime import UTC, datetime

import torch

from attnbench.devices import device_name, synchronize
from attnbench.errors import AttnbenchError, InvalidSpecError, PluginLoadError, SweepError, UnavailableError, UnknownImplementationError
from attnbench.measure import (
    analytic_flops,
    counted_flops,
    decode_bytes,
    decode_rates,
    kv_cache_bytes_analytic,
    peak_gbytes_per_s,
    peak_gflops,
    peak_memory,
    time_fn,
)
from attnbench.measure.stats import summarize_groups
from attnbench.resolve import Skip, resolve
from attnbench.results.schema import Cell, empty_row
from attnbench.results.text import fmt_time
from attnbench.runner.sweep import Settings


class CellTimeout(Exception):
    """Raised inside a cell that ran past ``cell_timeout_s``."""


@contextlib.contextmanager
def _deadline(seconds: float | None):
    """Raise :class:`CellTimeout` in this (main) thread after ``seconds``.

    In-process this interrupts Python-level hangs; a hang inside one native kernel call is only
    interrupted when it returns to Python, so use ``--isolate`` (a subprocess that is killed) for those.
    """
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def on_alarm(signum, frame):
        raise CellTimeout(f"cell exceeded its timeout of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


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


def _release(device: torch.device) -> None:
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
    row = empty_row(cell, run_id)
    row.update(host=socket.gethostname(), worker=f"pid{os.getpid()}",
               started_at=datetime.now(UTC).isoformat(timespec="microseconds"))
    t_start = time.perf_counter()
    row["threads"] = torch.get_num_threads()
    try:
        outcome = resolve(cell.impl, cell)
    except AttnbenchError:
        outcome = None  # an unknown name or mode: build_workload raises it again, into a row with its status
    if isinstance(outcome, Skip):
        row.update(status="skipped", error=outcome.reason)
        row["duration_s"] = time.perf_counter() - t_start
        return row
    device = outcome.device if outcome else torch.device("cpu")
    workload = None
    try:
        with _deadline(settings.cell_timeout_s):
            row["device_name"] = device_name(device)
            from attnbench.runner.workload import build_workload

            workload = build_workload(cell, seed=settings.seed, ready=outcome)
            _measure(workload, cell, settings, row, peak_gflops_per_s)
    except CellTimeout as exc:
        row.update(status="timeout", error=str(exc))
    except (UnavailableError, InvalidSpecError, SweepError) as exc:
        row.update(status="skipped", error=str(exc))
    except Exception as exc:
        if _is_oom(exc):
            row.update(status="oom", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        else:
            where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
            at = f" (at {os.path.basename(where.filename)}:{where.lineno})" if where else ""
            first = str(exc).splitlines()[0][:500] if str(exc) else ""
            row.update(status="error", error=f"{type(exc).__name__}: {first}{at}")
    finally:
        if row["status"] != "ok":
            for key in ("median_s", "iqr_s", "mean_s", "std_s", "min_s", "max_s", "ci_low_s", "ci_high_s", "ci_rel",
                        "gflops_per_s", "frac_peak", "gbytes_per_s", "frac_peak_bw"):
                row[key] = math.nan
            row["samples_s"] = []
            row["n"] = 0
        del workload
        _release(device)
    row["duration_s"] = time.perf_counter() - t_start
    return row


def _measure(workload, cell: Cell, settings: Settings, row: dict, peak_gflops_per_s: float | None = None) -> None:
    device = workload.device
    compiled = cell.impl.startswith("compiled:")
    # Importing torch._dynamo costs seconds: only compiled cells count graphs.
    graphs_before = _compiled_graphs() if compiled else None
    t0 = time.perf_counter()
    out = workload.step()  # the first call: compiles compiled: cells, checks the output
    synchronize(device)
    first_call_s = time.perf_counter() - t0
    problem = workload.check_output(out)
    del out
    if problem:
        row.update(status="invalid", error=problem)
        return
    graphs_after_first = _compiled_graphs() if compiled else None
    timing = time_fn(workload.timed_step or workload.step, device, between=workload.restore,  # restore: outside the timed region
                     warmup_calls=settings.warmup_calls, warmup_s=settings.warmup_s,
                     target_rel_ci=settings.target_rel_ci, min_samples=settings.min_samples,
                     max_samples=settings.max_samples, budget_s=settings.budget_s,
                     l2_flush=cell.cache == "cold", cuda_graph=settings.cuda_graph and cell.mode == "inference")
    graphs_after_timing = _compiled_graphs() if compiled else None
    stats = timing.stats()
    row.update(stats)
    row.update(samples_s=list(timing.samples_s), calls_per_sample=timing.calls_per_sample,
               warmup_calls=timing.warmup_calls + 1, timer=timing.timer)
    notes = [f"sampling stopped by {timing.stopped_by}", *workload.notes]
    if compiled:
        row["compile_s"] = max(first_call_s - stats["median_s"], 0.0)
        if graphs_before is None or graphs_after_first is None or graphs_after_timing is None:
            notes.append("recompiles not counted: this torch has no torch._dynamo.utils.counters")
        else:
            row["recompiles"] = float(graphs_after_timing - graphs_after_first)
            if graphs_after_first - graphs_before > 1:
                notes.append(f"{graphs_after_first - graphs_before} graphs compiled on the first call (graph breaks)")
            if graphs_after_timing > graphs_after_first:
                notes.append(f"RECOMPILED {graphs_after_timing - graphs_after_first}x during warm-up/timing: "
                             "timings include compilation")
    mem = peak_memory(workload.step, device)
    row.update(peak_bytes=mem.peak_bytes, peak_reserved_bytes=mem.peak_reserved_bytes, memory_method=mem.method)
    flops = analytic_flops(cell.batch, cell.seq_len, cell.d_model, cell.d_model, cell.mode, num_heads=cell.num_heads,
                           num_kv_heads=cell.num_kv_heads, window=cell.window, causal=cell.causal)
    row["flops"] = flops
    if cell.mode == "decode":
        row["kv_cache_bytes"] = workload.kv_cache_bytes
        row["kv_cache_bytes_analytic"] = kv_cache_bytes_analytic(cell.batch, cell.seq_len, cell.kv_heads, cell.head_dim,
                                                                 cell.window, workload.x.element_size())
        row.update(decode_rates(decode_bytes(cell.batch, cell.seq_len, cell.d_model, cell.d_model, num_heads=cell.num_heads,
                                             num_kv_heads=cell.num_kv_heads, window=cell.window,
                                             element_bytes=workload.x.element_size()),
                                stats["median_s"], peak_gbytes_per_s(str(device))))
    if settings.flop_check and not compiled:
        # Under FlopCounterMode a compiled module recompiles (the mode fails its guards): counting
        # would cost a compile and measure the counter's trace, so compiled cells keep the model only.
        row["flops_counted"] = counted_flops(workload.step)
    row["gflops_per_s"] = flops / stats["median_s"] / 1e9
    peak = peak_gflops_per_s or peak_gflops(str(device), cell.dtype)
    row["peak_gflops_per_s"] = peak
    row["frac_peak"] = row["gflops_per_s"] / peak
    row["status"] = "ok"
    row["notes"] = "; ".join(notes)


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
        recompiles = [r["recompiles"] for r in rows if r["recompiles"] == r["recompiles"]]
        merged["recompiles"] = float(sum(recompiles)) if recompiles else math.nan
        merged["warmup_calls"] = sum(r["warmup_calls"] for r in rows)
        merged["duration_s"] = sum(r["duration_s"] for r in rows)
        workers = list(dict.fromkeys(str(r.get("worker") or "") for r in rows))
        merged["worker"] = ", ".join(w for w in workers if w)
        medians = ", ".join(fmt_time(r["median_s"]) for r in rows)
        rounds = len(rows) // processes
        how = f"{rounds} rounds" + (f" x {processes} processes" if processes > 1 else "")
        notes.append(f"{how} in shuffled order, round medians {medians}")
    merged["notes"] = "; ".join(n for n in (*notes, rows[0]["notes"]) if n)
    return merged


def _compiled_graphs() -> int | None:
    """Graphs Dynamo has compiled in this process, or None when this torch does not count them.

    ``torch._dynamo.utils.counters`` is not public API: this is its one use.
    """
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except (ImportError, AttributeError, KeyError, TypeError):
        return None
