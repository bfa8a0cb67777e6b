"""Issue 37's report view: decode through a paged KV cache against a contiguous one at the same shape, per page size.

Within a comparison group of a page size (``attnbench run --page-size``), the rows with ``pages`` are paged caches and
the others contiguous ones (the group's page size names it; they have no pages). Each paged row is set against the
group's baseline when the baseline is contiguous (its paired speed-up, with the 95% interval, turned into a cost:
paged time / contiguous time), else against the group's first contiguous cache (a ratio of medians, no interval).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from attnbench.report import analysis as an
from attnbench.report.variants import CONFIG, variant_label
from attnbench.results.text import fmt_bytes, fmt_time

COLUMNS = ["configuration", "T", "variant", "page_size", "paged", "contiguous", "paged_s", "contiguous_s", "cost",
           "cost_low", "cost_high", "pages", "fragmentation", "paged_bytes", "contiguous_bytes"]


def _cost(p, c) -> tuple[float, float, float]:
    """Paged time / contiguous time, and its interval when the speed-up is paired against ``c`` (the baseline)."""
    if str(p.get("baseline") or "") == c["impl"] and np.isfinite(float(p.get("speedup", np.nan))):
        return 1 / float(p["speedup"]), 1 / float(p["speedup_ci_high"]), 1 / float(p["speedup_ci_low"])
    return float(p["median_s"]) / float(c["median_s"]), np.nan, np.nan


def table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per paged row of a run: its time and cache against the contiguous cache of its group (empty when the
    run has no paged decode rows)."""
    ok = an.ok_rows(df)
    if "page_size" not in ok.columns or "pages" not in ok.columns:
        return pd.DataFrame(columns=COLUMNS)
    ok = ok[(ok["mode"] == "decode") & (pd.to_numeric(ok["page_size"], errors="coerce").fillna(0) > 0)]
    rows = []
    for _, group in ok.groupby("group_id", sort=False):
        paged = group[np.isfinite(group["pages"].astype(float))]
        contiguous = group[~np.isfinite(group["pages"].astype(float))]
        if paged.empty or contiguous.empty:
            continue
        base = contiguous[contiguous["impl"] == paged.iloc[0].get("baseline")]
        c = (base if len(base) else contiguous).iloc[0]
        for _, p in paged.iterrows():
            cost, lo, hi = _cost(p, c)
            rows.append({"configuration": ", ".join(f"{k}={p[k]}" for k in CONFIG), "T": int(p["seq_len"]),
                         "variant": variant_label(p["num_heads"], p["num_kv_heads"], p["window"], p["causal"]),
                         "page_size": int(p["page_size"]), "paged": p["impl"], "contiguous": c["impl"],
                         "paged_s": float(p["median_s"]), "contiguous_s": float(c["median_s"]), "cost": cost,
                         "cost_low": lo, "cost_high": hi, "pages": int(p["pages"]),
                         "fragmentation": float(p["page_fragmentation"]), "paged_bytes": float(p["kv_cache_bytes"]),
                         "contiguous_bytes": float(c["kv_cache_bytes"])})
    return pd.DataFrame(rows, columns=COLUMNS)


def display(t: pd.DataFrame) -> pd.DataFrame:
    """:func:`table` formatted for the report."""
    out = t[["configuration", "T", "variant", "page_size", "paged", "contiguous"]].copy()
    out["paged time"] = [fmt_time(v) for v in t["paged_s"]]
    out["contiguous time"] = [fmt_time(v) for v in t["contiguous_s"]]
    out["paged / contiguous"] = [f"{c:.2f}×" + (f" ({lo:.2f}–{hi:.2f})" if np.isfinite(lo) else " (medians)")
                                 for c, lo, hi in zip(t["cost"], t["cost_low"], t["cost_high"], strict=True)]
    out["pages"] = t["pages"]
    out["fragmentation"] = [f"{100 * v:.1f}%" for v in t["fragmentation"]]
    out["cache paged / contiguous"] = [f"{fmt_bytes(a)} / {fmt_bytes(b)}"
                                       for a, b in zip(t["paged_bytes"], t["contiguous_bytes"], strict=True)]
    return out.rename(columns={"page_size": "page size"})
