"""Issue 49 in the report: the roofline figure, the headroom table and the implausible rows.

The figure has one panel per device, dtype and thread count (each has its own ceilings): every ok row with an
intensity is a marker at its arithmetic intensity (x, FLOP per byte, log) and achieved GFLOP/s (y, log), coloured by
implementation; decode cells are hollow. The measured ceilings are lines: the compute ceiling (flat) and the memory
bandwidth (``GB/s × intensity``, slanted: the line decode cells live under), their minimum the roof. A row flagged
``implausible`` (:mod:`attnbench.measure.roofline`) is ringed in red. The headroom table lists the cells furthest
below their roof (``headroom`` = measured time / attainable time).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from attnbench.measure.roofline import compute_ceiling, implausible_rows, implausible_text
from attnbench.report import analysis as an
from attnbench.report import figures as figs

PANEL_AXES = ("device", "dtype", "threads")
"""The axes a roofline panel fixes: each combination has its own measured ceilings."""
HEADROOM_ROWS = 15
"""The headroom table's length: the cells furthest from their roofline."""
IMPLAUSIBLE_COLOUR = "#c00"


def placed(df: pd.DataFrame) -> pd.DataFrame:
    """The ok rows with roofline coordinates (none for a run before issue 49), their numbers as floats."""
    if "intensity" not in df.columns:
        return df.iloc[0:0]
    ok = an.ok_rows(df).copy()
    for col in ("intensity", "headroom", "attainable_s", "min_bytes", "ceiling_gflops_per_s", "ceiling_gbytes_per_s",
                "ceiling_gflops_rel", "peak_gflops_per_s", "flops", "gflops_per_s", "threads"):
        ok[col] = pd.to_numeric(ok[col], errors="coerce") if col in ok else math.nan
    return ok[np.isfinite(ok["intensity"]) & (ok["intensity"] > 0) & (ok["gflops_per_s"] > 0)]


def _panels(rows: pd.DataFrame) -> list[an.Group]:
    out = []
    for key, sub in rows.groupby(list(PANEL_AXES), sort=True, dropna=False):
        values = dict(zip(PANEL_AXES, key, strict=True))
        text = f"{values['device']} · {values['dtype']}" + (f" · {int(values['threads'])} thread{'s' if values['threads'] != 1 else ''}"
                                                              if values["threads"] and values["threads"] > 0 else "")
        out.append(an.Group(tuple(key), values, text, text, sub))
    return out


def _draw(styles: dict):
    def draw(ax, g, seen):
        rows = g.rows
        compute = float(np.nanmedian([compute_ceiling(dict(r)) for _, r in rows.iterrows()]))
        bandwidth = float(rows["ceiling_gbytes_per_s"].median())
        x = rows["intensity"].to_numpy(dtype=float)
        lo, hi = x.min() / 4, x.max() * 4
        if math.isfinite(compute) and math.isfinite(bandwidth) and bandwidth > 0:
            ridge = compute / bandwidth  # the intensity where the two ceilings meet
            lo, hi = min(lo, ridge / 4), max(hi, ridge * 4)
            xs = np.geomspace(lo, hi, 200)
            ax.plot(xs, np.minimum(compute, bandwidth * xs), color="#333", linewidth=1.6, zorder=2)
            ax.plot(xs, bandwidth * xs, color="#333", linestyle=":", linewidth=1.0, zorder=1)
            ax.axhline(compute, color="#333", linestyle="--", linewidth=1.0, zorder=1)
            seen.marks.add("roof")
        for _, r in rows.iterrows():
            st = styles[r["impl"]]
            hollow = r["mode"] == "decode"
            ax.scatter([r["intensity"]], [r["gflops_per_s"]], marker=st["marker"], s=40, zorder=3,
                       facecolors="none" if hollow else st["color"], edgecolors=st["color"], linewidths=1.2)
            if str(r.get("plausibility")) == "implausible":
                ax.scatter([r["intensity"]], [r["gflops_per_s"]], marker="o", s=160, facecolors="none",
                           edgecolors=IMPLAUSIBLE_COLOUR, linewidths=1.6, zorder=4)
                seen.marks.add("implausible")
            seen.marks |= {"decode"} if hollow else set()
            seen.impls.add(r["impl"])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_xlabel("arithmetic intensity (FLOP / minimal byte)")
        ax.set_ylabel("achieved GFLOP/s")
        return None

    return draw


def _handles(styles: dict):
    def handles(seen):
        marks = []
        if "roof" in seen.marks:
            marks += [Line2D([], [], color="#333", linewidth=1.6, label="roof"),
                      Line2D([], [], color="#333", linestyle="--", label="peak GEMM"),
                      Line2D([], [], color="#333", linestyle=":", label="bandwidth × intensity")]
        if "decode" in seen.marks:
            marks.append(Line2D([], [], color="#666", marker="o", markerfacecolor="none", linestyle="none",
                                label="decode (hollow)"))
        if "implausible" in seen.marks:
            marks.append(Line2D([], [], color=IMPLAUSIBLE_COLOUR, marker="o", markerfacecolor="none", markersize=10,
                                linestyle="none", label="implausible"))
        return [*(figs._impl_handle(i, styles[i], linestyle="none") for i in sorted(seen.impls)), *marks]

    return handles


@figs._styled
def figures(df: pd.DataFrame, styles: dict, out_dir: Path) -> list[figs.Figure]:
    """The roofline figure (none when no ok row has an intensity: a run before issue 49, or blocks and models only)."""
    rows = placed(df)
    if rows.empty:
        return []
    return figs._paneled(
        "roofline", "Roofline", rows, _panels(rows), _draw(styles), _handles(styles),
        "Each cell at its arithmetic intensity (model FLOPs over the bytes it must move at the least: inputs, weights, "
        "KV cache read, output) and its achieved GFLOP/s, log-log. Lines: this machine's measured ceilings in the "
        "panel's dtype and thread count (cached per machine; attnbench.measure.roofline): the peak GEMM (dashed), the "
        "STREAM bandwidth times intensity (dotted) and their minimum, the roof. A cell's distance below the roof is its "
        "headroom; a cell above it (ringed red) is implausible. Above the slanted line at low intensity: the bytes "
        "stayed in a cache.", out_dir, max_cols=4)


def headroom_table(df: pd.DataFrame, n: int = HEADROOM_ROWS) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(display, raw)``: the ``n`` cells with the most headroom (furthest from their roofline), largest first."""
    rows = placed(df)
    rows = rows[np.isfinite(rows["headroom"])].sort_values("headroom", ascending=False).head(n)
    cols = ["impl", "device", "dtype", "mode", "batch", "seq_len", "num_heads", "d_model", "median_s", "flops",
            "min_bytes", "intensity", "bound", "attainable_s", "headroom", "gflops_per_s", "plausibility", "cell_id"]
    raw = rows[[c for c in cols if c in rows]].reset_index(drop=True)
    display = pd.DataFrame({
        "impl": raw.get("impl", []),
        "configuration": [f"{r.device} {r.dtype} {r.mode} b={r.batch} T={r.seq_len} h={r.num_heads} d={r.d_model}"
                          for r in raw.itertuples()],
        "median": [an.fmt_time(v) for v in raw.get("median_s", [])],
        "attainable": [an.fmt_time(v) for v in raw.get("attainable_s", [])],
        "headroom": [f"{v:.3g}×" for v in raw.get("headroom", [])],
        "bound": raw.get("bound", []),
        "intensity (FLOP/B)": [f"{v:.3g}" for v in raw.get("intensity", [])],
        "GFLOP/s": [f"{v:.3g}" for v in raw.get("gflops_per_s", [])],
        "flag": raw.get("plausibility", pd.Series(dtype=str)).map(lambda v: "implausible" if v == "implausible" else "")})
    return display, raw


def implausible_sentences(df: pd.DataFrame) -> list[str]:
    """One sentence per ok row flagged ``implausible``, naming it and its rate against the ceiling."""
    flagged = implausible_rows(an.ok_rows(df)) if len(df) else df
    return [implausible_text(r) for _, r in flagged.iterrows()]
