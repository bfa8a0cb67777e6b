"""Issue 49 in the report: the cost model's held-out error per implementation, and the cells it mispredicts.

:mod:`attnbench.measure.costmodel` fits ``time = a·FLOPs + b·bytes + c`` per implementation, device, dtype (and mode
when each has enough cells) and predicts every cell from the other folds. The report shows, per model, the cells, the
held-out median relative error (or why there is none), how many cells are more than
:data:`~attnbench.measure.costmodel.OFF_FACTOR` off and the coefficients as rates (``1/a``: GFLOP/s at the margin;
``1/b``: GB/s; ``c``: the fixed cost of a call); then the mispredicted cells, worst first: where the implementation
changes regime.
"""

from __future__ import annotations

import math

import pandas as pd

from attnbench.measure import costmodel
from attnbench.report import analysis as an

MISPREDICTED_ROWS = 30
"""The longest mispredicted list shown (``tables/mispredicted.csv`` has them all)."""


def _rate(seconds_per_unit: float) -> str:
    """``1 / (seconds per unit)`` in G units per second; ``–`` when the term is not used (0)."""
    return f"{1 / seconds_per_unit / 1e9:.3g}" if seconds_per_unit > 0 and math.isfinite(seconds_per_unit) else "–"


def _error_text(r) -> str:
    if math.isfinite(r.heldout_median_rel_error):
        return f"{100 * r.heldout_median_rel_error:.1f}%"
    return f"{costmodel.TOO_FEW} ({r.cells} cell{'s' if r.cells != 1 else ''})"


def _ratio_text(ratio: float) -> str:
    if not math.isfinite(ratio):
        return "–"
    return f"{ratio:.2f}× (slower than predicted)" if ratio >= 1 else f"{ratio:.2f}× (faster than predicted)"


def tables(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """``(summary display, summary raw, mispredicted display, mispredicted raw)``; empty frames when no ok cell has
    FLOPs and a time."""
    a = costmodel.assess(df)
    raw = a.summary.drop(columns="key") if len(a.summary) else a.summary
    if raw.empty:
        return raw, raw, raw, raw
    summary = pd.DataFrame({
        "impl": raw["impl"], "configuration": [f"{r.device} {r.dtype} {r.mode}" for r in raw.itertuples()],
        "cells": raw["cells"], "held-out median error": [_error_text(r) for r in raw.itertuples()],
        f"> {costmodel.OFF_FACTOR:g}× off": [str(n) if math.isfinite(e) else "–" for n, e in
                                              zip(raw["mispredicted"], raw["heldout_median_rel_error"], strict=True)],
        "worst measured / predicted": [f"{v:.2f}×" if math.isfinite(v) else "–" for v in raw["worst_ratio"]],
        "GFLOP/s (1/a)": [_rate(v) for v in raw["a_s_per_flop"]],
        "GB/s (1/b)": [_rate(v) for v in raw["b_s_per_byte"]],
        "per call (c)": [an.fmt_time(v) if v > 0 else "0" for v in raw["c_s"]], "note": raw["note"]})
    off = a.mispredicted
    off_raw = off.reset_index(drop=True)
    shown = off_raw.head(MISPREDICTED_ROWS)
    mispredicted = pd.DataFrame({
        "impl": shown["impl"],
        "cell": [f"{r.device} {r.dtype} {r.cell_mode} b={_int(r.batch)} T={_int(r.seq_len)}" for r in shown.itertuples()],
        "measured": [an.fmt_time(v) for v in shown["measured_s"]],
        "predicted (held out)": [an.fmt_time(v) for v in shown["predicted_s"]],
        "measured / predicted": [_ratio_text(v) for v in shown["ratio"]]})
    return summary, raw, mispredicted, off_raw


def _int(v) -> str:
    try:
        return str(int(v))
    except (TypeError, ValueError):
        return "?"
