"""The speed-ups' between-round term: how far a paired speed-up moves from one round (or process) to the next, pooled
over a run's cells, so that a speed-up's interval covers what an independent rerun would measure.

A paired speed-up's own interval (:func:`attnbench.measure.stats.paired_speedup`) resamples the rounds of one cell:
with two or three rounds it cannot tell how far rounds spread, and on a shared VM whose speed changes every
50-500 ms (issue 30) rounds do spread: each round sees its own mix of fast and slow phases, and a memory-bound
member slows more in a slow phase than the baseline does. Every ok member of a comparison group has one log speed-up
per round; their variance between rounds, pooled over the run's cells, is a stable figure where one cell's two rounds
are not. Each cell's own variance is shrunk towards it (a moderated variance, as in limma: ``PRIOR_DF`` degrees of
freedom for the pooled figure, ``rounds - 1`` for the cell's own), and its interval is made at least as wide as the
prediction interval for another run's speed-up of as many rounds: ``z * sqrt(2 * (s^2 / rounds + r^2))`` on the log
scale on each side, where ``r`` is the run-level SD (:func:`run_sd`): what a fresh process moves a speed-up by beyond
its rounds' spread (each run is a new process, with its own allocations and thread placement; the rounds of one run
share them). An interval already wider keeps its width. Runs with one round per cell have no such term.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from attnbench.measure.stats import group_median, split_groups, z_value

DEFAULT_CPU_RUN_SD = 0.012
"""The run-level SD of a CPU speed-up on a machine without a calibration (log scale), measured on the 2-vCPU VM on
2026-12-02 01:36-01:40 UTC: ``python -m attnbench.tools.reproducibility --runs 4 --rounds 3 --speedups --baseline sdpa``,
quiet and under ``--load memory``: the speed-ups moved 3.1% and 3.2% (mean max/min) across 4 runs, about 1.5% (1 SD),
of which the rounds' spread (1.7% a round, over 3 rounds) explains 1.0%. ``--calibrate`` measures your machine's."""
CALIBRATION_KEY = "speedup_run_sd"
"""The key of the run-level SD in the machine's calibration entry (:mod:`attnbench.measure.drift`)."""
PRIOR_DF = 4.0
"""Degrees of freedom given to the pooled variance when a cell's own is shrunk towards it."""
MIN_CELLS = 3
"""Cells with two or more rounds needed before a pooled figure is trusted."""


def round_log_speedups(base_groups: Sequence[Sequence[float]], member_groups: Sequence[Sequence[float]]) -> list[float]:
    """The log speed-up of each round (cycle group) that has a cycle with both times: the median of its log ratios."""
    out = []
    for base, member in zip(base_groups, member_groups, strict=True):
        b, m = np.asarray(base, dtype=float), np.asarray(member, dtype=float)
        both = np.isfinite(b) & np.isfinite(m) & (b > 0) & (m > 0)
        if both.any():
            out.append(group_median([np.log(b[both] / m[both])]))
    return out


def pooled(per_cell: Iterable[Sequence[float]]) -> tuple[float | None, int]:
    """The pooled between-round SD of log speed-ups (mean of the cells' variances, each with ``rounds - 1`` degrees of
    freedom) and the number of cells it pools; None below :data:`MIN_CELLS` cells."""
    num, df, cells = 0.0, 0, 0
    for x in per_cell:
        if len(x) >= 2:
            num += float(np.var(x, ddof=1)) * (len(x) - 1)
            df += len(x) - 1
            cells += 1
    return (math.sqrt(num / df) if cells >= MIN_CELLS else None), cells


def moderated_sd(own: Sequence[float], pooled_sd: float) -> float:
    """A cell's between-round SD shrunk towards the pooled one (:data:`PRIOR_DF`)."""
    k = len(own) - 1
    own_var = float(np.var(own, ddof=1)) if k >= 1 else 0.0
    return math.sqrt((PRIOR_DF * pooled_sd ** 2 + k * own_var) / (PRIOR_DF + k))


def widened(row: Mapping, sd: float, rounds: int, run: float = 0.0, confidence: float = 0.95) -> tuple[float, float]:
    """``row``'s speed-up interval made at least ``z * sqrt(2 * (sd^2 / rounds + run^2))`` wide on each side (log
    scale): a prediction interval for another run's speed-up."""
    s, lo, hi = float(row["speedup"]), float(row["speedup_ci_low"]), float(row["speedup_ci_high"])
    h = z_value(confidence) * math.sqrt(2.0 * (sd ** 2 / rounds + run ** 2))
    return min(lo, s * math.exp(-h)), max(hi, s * math.exp(h))


def per_round(rows: list[dict], paired_base) -> dict[str, list[float]]:
    """Each ok, paired member's per-round log speed-ups (by ``cell_id``), from the rows of one or more comparison
    groups; ``paired_base(row, base_row)`` gives the baseline times a member's cycles pair with."""
    out: dict[str, list[float]] = {}
    by_group: dict[str, list[dict]] = {}
    for row in rows:
        by_group.setdefault(str(row.get("group_id")), []).append(row)
    for members in by_group.values():
        base = next((r for r in members if r.get("status") == "ok" and r.get("speedup") == 1.0
                     and r.get("impl") == r.get("baseline")), None)
        if base is None:
            continue
        for row in members:
            if row is base or row.get("status") != "ok" or not (row.get("speedup") == row.get("speedup")):
                continue
            sizes = [int(n) for n in (row.get("cycle_groups") or [])]
            cycles = list(row.get("cycle_s") or [])
            if len(sizes) < 2 or sum(sizes) != len(cycles):
                continue
            x = round_log_speedups(split_groups(paired_base(row, base), sizes), split_groups(cycles, sizes))
            if len(x) >= 2:
                out[row["cell_id"]] = x
    return out


def run_sd(device_type: str, allocator: str) -> tuple[float, str]:
    """The run-level SD for speed-ups on ``device_type`` and where it came from: this machine's calibration
    (``speedup_run_sd`` in its entry of the drift calibration file), else :data:`DEFAULT_CPU_RUN_SD` for CPU, else 0."""
    from attnbench.measure import drift

    entry = drift.load_calibrations().get(drift.machine_key(device_type, allocator)) or {}
    value = entry.get(CALIBRATION_KEY)
    if isinstance(value, int | float) and value >= 0:
        return float(value), f"calibrated on this machine {entry.get('date', '?')}"
    if device_type == "cpu":
        return DEFAULT_CPU_RUN_SD, ("default for CPU (measured on a shared 2-vCPU VM); calibrate with `python -m "
                                    "attnbench.tools.reproducibility --speedups --calibrate`")
    return 0.0, f"uncalibrated on {device_type}: speed-up intervals cover the rounds' spread only"


def estimate_run_sd(frames: list[pd.DataFrame]) -> float | None:
    """The run-level SD from several runs of one sweep: per paired cell, the variance of its log speed-up across runs
    less what its rounds explain (the mean of ``speedup_spread_rel^2 / rounds``), pooled over cells, at least 0;
    None without a cell paired in two runs with a between-round term."""
    rows = pd.concat([f.assign(_run=i) for i, f in enumerate(frames)])
    rows = rows[(rows.status == "ok") & (rows.impl != rows.baseline)] if "baseline" in rows else rows.iloc[:0]
    excess = []
    for _, g in rows.groupby("cell_id", sort=False):
        sp = pd.to_numeric(g["speedup"], errors="coerce").to_numpy(dtype=float)
        spread = pd.to_numeric(g.get("speedup_spread_rel"), errors="coerce").to_numpy(dtype=float)
        rounds = np.array([max(len(c) if c is not None else 0, 1) for c in g["cycle_groups"]], dtype=float)
        ok = np.isfinite(sp) & (sp > 0) & np.isfinite(spread)
        if ok.sum() >= 2:
            excess.append(float(np.var(np.log(sp[ok]), ddof=1) - np.mean(spread[ok] ** 2 / rounds[ok])))
    return math.sqrt(max(float(np.mean(excess)), 0.0)) if excess else None
