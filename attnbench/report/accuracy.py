"""Issue 38 in the report: accuracy against latency, per dtype, and the table of error ratios.

One figure per dtype: a panel per configuration (at its longest sequence), one point per implementation at its
median time (x) and its RMS error against the float64 reference (y, log); the non-dominated implementations (no other
is both faster and more accurate) are ringed and joined, and a dotted line marks :data:`RATIO_LIMIT` times the plain
math's error in that dtype. The table lists every ok row's errors; rows above the limit are marked and named.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, NullFormatter

from attnbench.report import analysis as an
from attnbench.report import figures as figs
from attnbench.results.accuracy import DEFAULT_RATIO_LIMIT as RATIO_LIMIT
from attnbench.results.accuracy import worst_ratio


def measured(df: pd.DataFrame) -> pd.DataFrame:
    """The ok rows with a measured error (none for a run before issue 38 or with ``--accuracy off``)."""
    if "error_rms" not in df:
        return df.iloc[0:0]
    ok = an.ok_rows(df)
    return ok[pd.to_numeric(ok["error_rms"], errors="coerce").notna()]


def front(times, errors) -> list[bool]:
    """Whether each point is non-dominated: no other point is at most as slow and as inaccurate, and better in one."""
    pts = list(zip(times, errors, strict=True))
    return [not any((t2 <= t and e2 <= e) and (t2 < t or e2 < e) for t2, e2 in pts) for t, e in pts]


def _draw(styles: dict):
    def draw(ax, g, seen):
        rows = g.rows[g.rows["seq_len"] == g.rows["seq_len"].max()]
        rows = rows[(rows["error_rms"] > 0) & np.isfinite(rows["error_rms"])]
        if rows.empty:
            return "no measured error"
        best = front(rows["median_s"].tolist(), rows["error_rms"].tolist())
        for (_, r), on_front in zip(rows.iterrows(), best, strict=True):
            st = styles[r["impl"]]
            ax.scatter([r["median_s"]], [r["error_rms"]], color=st["color"], marker=st["marker"], s=46, zorder=3,
                       edgecolors="black" if on_front else "none", linewidths=1.4)
            seen.impls.add(r["impl"])
        line = rows[best].sort_values("median_s")
        ax.plot(line["median_s"], line["error_rms"], color="#444", linestyle="--", linewidth=0.8, zorder=2)
        base = pd.to_numeric(rows["error_base"], errors="coerce").dropna()
        if len(base) and base.iloc[0] > 0:
            ax.axhline(RATIO_LIMIT * base.iloc[0], color="#b00", linestyle=":", linewidth=1.0)
            seen.marks.add("limit")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: an.fmt_time(v)))
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels crowd a short axis
        ax.set_xlabel(f"median time per call (T={int(rows['seq_len'].iloc[0])})")
        ax.set_ylabel("RMS error vs float64")
        return None

    return draw


@figs._styled
def figures(df: pd.DataFrame, styles: dict, out_dir: Path) -> list[figs.Figure]:
    """The accuracy-versus-latency figures, one per dtype (none when no row has a measured error)."""
    rows = measured(df)
    out = []
    for dtype in sorted(rows["dtype"].unique(), key=str) if len(rows) else []:
        sub = rows[rows["dtype"] == dtype]

        def handles(seen):
            marks = [Line2D([], [], color="white", marker="o", markeredgecolor="black", label="non-dominated")]
            if "limit" in seen.marks:
                marks.append(Line2D([], [], color="#b00", linestyle=":", label=f"{RATIO_LIMIT:g}× the plain math's error"))
            return [*(figs._impl_handle(i, styles[i], linestyle="none") for i in sorted(seen.impls)), *marks]

        out += figs._paneled(
            f"accuracy-{dtype}", f"Accuracy vs latency, {dtype}", sub, an.groups(sub), _draw(styles), handles,
            "One point per implementation at the configuration's longest sequence: its median time and its RMS error "
            "against the float64 reference (log scales). Ringed and joined: non-dominated (no other implementation is "
            "both faster and more accurate). Dotted: twice the error of the harness's plain math in the same dtype.",
            out_dir, max_cols=4)
    return out


def table(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """``(display, raw, classes)``: every ok row's errors and ratios (rows above the limit get class ``regression``)."""
    rows = an.ok_rows(df) if "error_note" in df else df.iloc[0:0]
    cols = ["impl", "dtype", "mode", "seq_len", "median_s", "error_rel", "error_rms", "error_base", "error_ratio",
            "error_grad_rms", "error_grad_ratio", "error_note"]
    raw = rows[[c for c in cols if c in rows]].reset_index(drop=True)
    worst = [worst_ratio(dict(r)) for _, r in raw.iterrows()]

    def g(v):
        return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2g}"

    display = pd.DataFrame({
        "impl": raw.get("impl", []), "configuration": [f"{r.dtype} {r.mode} T={r.seq_len}" for r in raw.itertuples()],
        "median": [an.fmt_time(v) for v in raw.get("median_s", [])],
        "error (max)": [g(v) for v in raw.get("error_rel", [])], "error (RMS)": [g(v) for v in raw.get("error_rms", [])],
        "plain math (RMS)": [g(v) for v in raw.get("error_base", [])],
        "ratio": [("–" if v != v else f"{v:.2f}×") for v in raw.get("error_ratio", [])],
        "gradient ratio": [("–" if v != v else f"{v:.2f}×") for v in raw.get("error_grad_ratio", [])],
        "note": raw.get("error_note", []).fillna("") if len(raw) else []})
    classes = ["regression" if w > RATIO_LIMIT else "" for w in worst]
    return display, raw, classes


def above_sentences(raw: pd.DataFrame) -> list[str]:
    """One sentence per row whose error ratio is above the limit."""
    out = []
    for _, r in raw.iterrows():
        w = worst_ratio(dict(r))
        if w > RATIO_LIMIT:
            out.append(f"{r['impl']} ({r['dtype']} {r['mode']} T={r['seq_len']}): its error is {w:.1f}× that of the "
                       f"harness's plain math in {r['dtype']} — worse than this precision has to be.")
    return out
