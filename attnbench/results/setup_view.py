"""Issue 37 in tables: a variable-length row's lengths, and its setup cost beside its time (console and report).

``attention + setup`` and ``attention alone`` of a row follow its ``setup_policy`` (:mod:`attnbench.runner.setup`):
under ``per-call`` the timed median already includes ``prepare`` (attention alone = median - setup_s, an estimate
from the setup measured apart); under ``once`` it does not (attention + setup = median + setup_s).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from attnbench.results.text import fmt_time

SETUP_COLUMNS = ["setup", "attn alone", "attn + setup"]
"""The console's setup columns (when some row measured a setup)."""


def has_lengths(df) -> bool:
    """Whether any row is a variable-length batch."""
    return "lengths" in df and bool((df["lengths"].fillna("").astype(str) != "").any())


def has_setup(df) -> bool:
    """Whether any ok row measured a setup (``setup_s`` finite)."""
    return "setup_s" in df and bool(np.isfinite(pd.to_numeric(df["setup_s"], errors="coerce")).any())


def lengths_text(r) -> str:
    """``longtail 3..433 62%pad`` (the distribution, the shortest and longest sequence, and the share of a padded batch
    that is padding) for a variable-length row; ``-`` for a rectangle."""
    dist = str(getattr(r, "lengths", "") or "")
    if not dist or dist == "nan":
        return "-"
    pad = getattr(r, "padding_frac", math.nan)
    return f"{dist} {int(r.lengths_min)}..{int(r.lengths_max)}" + (f" {100 * pad:.0f}%pad" if pad == pad else "")


def attention_times(r) -> tuple[float, float]:
    """``(attention alone, attention + setup)`` seconds per call of a row (NaN where it has no setup)."""
    setup = getattr(r, "setup_s", math.nan)
    if setup is None or setup != setup:
        return math.nan, math.nan
    if str(getattr(r, "setup_policy", "")) == "once":
        return r.median_s, r.median_s + setup
    return max(r.median_s - setup, 0.0), r.median_s


def setup_cells(r) -> list[str]:
    """A row's cells under :data:`SETUP_COLUMNS`: the setup with whether the timed call included it, then attention
    alone and attention + setup (``~`` marks the one estimated from the setup measured apart)."""
    setup = getattr(r, "setup_s", math.nan)
    if setup is None or setup != setup:
        return ["none", fmt_time(r.median_s), fmt_time(r.median_s)]
    alone, total = attention_times(r)
    once = str(getattr(r, "setup_policy", "")) == "once"
    return [f"{fmt_time(setup)} ({'untimed' if once else 'in call'})", ("" if once else "~") + fmt_time(alone),
            ("~" if once else "") + fmt_time(total)]


def setup_note(df) -> str | None:
    """The line under the console table that says what the setup columns mean, or None without any."""
    if not has_setup(df):
        return None
    policies = sorted({str(p) for p in df.loc[df.status == "ok", "setup_policy"].dropna() if str(p)})
    return ("note: setup = the implementation's prepare() (padding/document/block mask, nested tensor) measured apart; "
            f"--setup {'/'.join(policies)}: " + ("per-call times include it (as a model does, once per forward), "
                                                 if "per-call" in policies else "")
            + ("once times exclude it, " if "once" in policies else "")
            + "~ marks the figure estimated from the setup measured apart")


def report_table(df) -> pd.DataFrame:
    """The report's table of variable-length rows and rows that measured a setup: per configuration (the length
    distribution's shape and skew), each implementation's time, its setup measured apart, attention alone and attention
    + setup (``~``: derived from ``setup_s``), the paired speed-up and GFLOP/s of the real tokens. Empty without any."""
    if not len(df) or not (has_lengths(df) or has_setup(df)):
        return pd.DataFrame()
    keep = df["status"] == "ok"
    lengths = df["lengths"].fillna("").astype(str) if "lengths" in df else pd.Series("", index=df.index)
    setup = pd.to_numeric(df["setup_s"], errors="coerce") if "setup_s" in df else pd.Series(math.nan, index=df.index)
    rows = df[keep & ((lengths != "") | setup.notna())]
    rows = rows.sort_values(["group_id", "median_s"])
    out = []
    for r in rows.itertuples():
        alone, total = setup_cells(r)[1:]
        sp = getattr(r, "speedup", math.nan)
        out.append({
            "configuration": f"b={r.batch} T={r.seq_len} h={r.num_heads} d={r.d_model} {r.mode} {r.dtype}",
            "lengths": lengths_text(r), "impl": r.impl,
            "tokens": int(r.tokens) if getattr(r, "tokens", 0) else int(r.batch * r.seq_len),
            "median": fmt_time(r.median_s), "setup": setup_cells(r)[0], "attention alone": alone,
            "attention + setup": total,
            "speed-up (95% CI)": "baseline" if r.impl == getattr(r, "baseline", None) else
            ("–" if sp != sp else f"{sp:.2f}× ({r.speedup_ci_low:.2f}–{r.speedup_ci_high:.2f})"),
            "GFLOP/s": f"{r.gflops_per_s:.1f}"})
    return pd.DataFrame(out)
