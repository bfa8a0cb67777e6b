"""Where a run's time went: its phases, measured, in ``meta.json`` (``phases``), one console line and the report.

The measuring processes record per row the member's own seconds (``phase_build_s``: resolving, building and the
first call; ``phase_warmup_s``; ``phase_timed_s``: its share of the group's timed cycles; ``phase_work_s``: the
memory and FLOP pass) and its compile time (``compile_s``, part of the first call). The driver adds what it
measures itself: the process's start-up before the session (imports), the measuring workers' start-up (a fresh
Python importing torch), the time waited for the machine's measurement lock and, from the CLI, the report.
*bookkeeping* is what is left of the session's wall time: sending cells to the workers and their rows back, each
process's per-group set-up (imports, the machine's peak GFLOP/s once, Dynamo's reset between groups), merging
rounds, speed-ups and writing the results. The phases add up to the wall time by construction; a phase that is
large says what a flag would save (``--no-report``, a smaller ``--budget``, fewer ``compiled:`` cells).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterable, Mapping

PHASES = ("start-up", "workers", "building", "compiling", "warm-up", "timed cycles", "memory/FLOPs", "accuracy",
          "locks waited", "interrupted", "bookkeeping", "report")
"""The phases in the order a run passes through them (``workers``: the measuring processes' start-up;
``interrupted``: after Ctrl-C, the time the cells then in flight had had)."""
ROW_PHASES = {"building": "phase_build_s", "warm-up": "phase_warmup_s", "timed cycles": "phase_timed_s",
              "memory/FLOPs": "phase_work_s", "accuracy": "phase_accuracy_s"}  # accuracy: issue 38
"""The row columns each measured phase is summed from (``compiling`` is ``compile_s``, taken out of building)."""


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: ``/proc/self/stat`` against ``/proc/uptime``), or None."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = float(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _number(value) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return 0.0
    return x if math.isfinite(x) else 0.0


def from_rows(rows: Iterable[Mapping]) -> dict[str, float]:
    """The measured phases summed over rows: building (less compiling), compiling, warm-up, timed cycles,
    memory/FLOPs."""
    out = dict.fromkeys(("building", "compiling", "warm-up", "timed cycles", "memory/FLOPs", "accuracy"), 0.0)
    for row in rows:
        for phase, column in ROW_PHASES.items():
            out[phase] += _number(row.get(column))
        compile_s = _number(row.get("compile_s"))
        out["compiling"] += compile_s
        out["building"] -= compile_s
    out["building"] = max(out["building"], 0.0)
    return out


def account(rows: Iterable[Mapping], wall_s: float, *, workers_s: float = 0.0, locks_s: float = 0.0,
            interrupted_s: float = 0.0) -> dict[str, float]:
    """Every phase of a session of ``wall_s`` seconds: the rows' phases, the driver's (``workers_s``, ``locks_s``;
    ``interrupted_s``: at most what the others leave) and ``bookkeeping`` as the rest (never below zero), rounded to
    milliseconds; ``wall`` is the total (start-up and report are the command line's: :func:`with_cli`)."""
    out = dict.fromkeys(PHASES, 0.0)
    out.update(from_rows(rows))
    out.update({"workers": workers_s, "locks waited": locks_s})
    out["interrupted"] = min(max(interrupted_s, 0.0), max(wall_s - sum(out.values()), 0.0))
    measured = sum(out.values())
    out["bookkeeping"] = max(wall_s - measured, 0.0)
    out["wall"] = max(wall_s, measured)
    return {k: round(v, 3) for k, v in out.items()}


def merged_columns(rows: list[Mapping]) -> dict:
    """The issue-30 columns of one cell's rows from several rounds: cycles and phase seconds summed, the rounds'
    ``stopped_by`` in order (``target,budget``), the first round's ``compile_cache`` (its ``compile_s`` is kept)."""
    out = {"cycles": int(sum(_number(r.get("cycles")) for r in rows)),
           "stopped_by": ",".join(str(r.get("stopped_by")) for r in rows if r.get("stopped_by")) or None,
           "compile_cache": rows[0].get("compile_cache")}
    for column in ROW_PHASES.values():
        out[column] = float(sum(_number(r.get(column)) for r in rows))
    return out


def merge(previous: Mapping | None, current: Mapping) -> dict[str, float]:
    """The phases of a resumed run: each session's added up."""
    out = {k: float(v) for k, v in (previous or {}).items()}
    for k, v in current.items():
        out[k] = round(out.get(k, 0.0) + float(v), 3)
    return out


def with_cli(phases: Mapping, startup_s: float = 0.0, report_s: float = 0.0) -> dict[str, float]:
    """``phases`` with what the command line measured around the session: its own start-up (imports, the sweep) and
    the report, both added to the wall time."""
    out = dict(phases)
    for key, seconds in (("start-up", startup_s), ("report", report_s)):
        out[key] = round(out.get(key, 0.0) + seconds, 3)
        out["wall"] = round(out.get("wall", 0.0) + seconds, 3)
    return out


def line(phases: Mapping) -> str:
    """``time: 62.1 s = start-up 1.2 s, workers 3.0 s, ...`` (phases under 0.05 s left out)."""
    parts = [f"{k} {float(phases[k]):.1f} s" for k in PHASES if float(phases.get(k, 0.0)) >= 0.05]
    return f"time: {float(phases.get('wall', 0.0)):.1f} s = " + ", ".join(parts)


def table(phases: Mapping) -> list[dict]:
    """``[{"phase", "seconds", "share"}]`` for the report, every phase in :data:`PHASES` order, then the wall time."""
    wall = float(phases.get("wall", 0.0)) or math.nan
    rows = [{"phase": k, "seconds": float(phases.get(k, 0.0)), "share": float(phases.get(k, 0.0)) / wall}
            for k in PHASES]
    return [*rows, {"phase": "wall", "seconds": float(phases.get("wall", 0.0)), "share": 1.0}]


def stop_text(rows: Iterable[Mapping]) -> str:
    """How the run's rows stopped sampling, and the median half-width of their paired speed-ups' CIs (the figure issue
    30's acceptance compares): ``cycles per member: median 14 (6-40); rounds stopped by: 50 target, 19 budget; ...``."""
    cycles, reasons, widths = [], {}, []
    for row in rows:
        if row.get("status") != "ok":
            continue
        sp, lo, hi = (_number(row.get(k)) for k in ("speedup", "speedup_ci_low", "speedup_ci_high"))
        if sp > 0 and hi > lo:  # not the baseline's own row (1.0, 1.0, 1.0)
            widths.append((hi - lo) / 2 / sp)
        if _number(row.get("cycles")) > 0:
            cycles.append(int(row["cycles"]))
        for reason in str(row.get("stopped_by") or "").split(","):
            if reason:
                reasons[reason] = reasons.get(reason, 0) + 1
    if not reasons:
        return ""
    said = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1]))
    text = f"rounds stopped by: {said}"
    if cycles:
        cycles.sort()
        text = f"cycles per member: median {cycles[len(cycles) // 2]} ({cycles[0]}-{cycles[-1]}); {text}"
    if widths:
        widths.sort()
        text += f"; paired speed-up CI half-width: median ±{100 * widths[len(widths) // 2]:.1f}% over {len(widths)} rows"
    return text


def report_frames(meta: Mapping, df):
    """The report's two tables: the run's phases (seconds, share of the wall time; empty for a run before issue 30)
    and, per ok row, the cycles it was timed in, why its rounds stopped and its compile cache."""
    import pandas as pd

    recorded = meta.get("phases") if isinstance(meta, Mapping) else None
    time_df = pd.DataFrame([{"phase": r["phase"], "seconds": f"{r['seconds']:.1f}",
                             "share": f"{100 * r['share']:.0f}%" if r["share"] == r["share"] else "–"}
                            for r in table(recorded)] if recorded else [], columns=["phase", "seconds", "share"])
    cols = ["impl", "mode", "seq_len", "cycles", "stopped_by", "compile_cache"]
    ok = df[(df["status"] == "ok")] if "status" in df else df.iloc[0:0]
    have = [c for c in cols if c in ok]
    sampling = ok[have].copy() if "stopped_by" in ok and ok["stopped_by"].notna().any() else pd.DataFrame(columns=cols)
    return time_df, sampling.fillna("").astype(str).reset_index(drop=True)


class Clock:
    """Seconds the driver spends in named phases (``with clock("workers"): ...``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0
