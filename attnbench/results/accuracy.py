"""Issue 38's views of the error columns (:mod:`attnbench.measure.accuracy`): the console's error column, the rows
whose error is worse than their precision has to be, and ``attnbench compare``'s accuracy gate.

An *accuracy regression* between run A and run B is a cell whose ``error_ratio`` (or, for forward+backward, its
``error_grad_ratio``) was at most the limit in A and is above it in B: the implementation became less accurate than
its precision has to be. The limit is :data:`DEFAULT_RATIO_LIMIT` (``attnbench compare --error-ratio-limit``), the
factor FlashAttention's tests allow over a naive implementation in the same precision. A cell already above the
limit in A is reported, not a regression (it was known); a run without the columns (before issue 38) is untested.
"""

from __future__ import annotations

import math

import pandas as pd

from attnbench.results.schema import AXES

DEFAULT_RATIO_LIMIT = 2.0
"""``attnbench compare``'s default ``--error-ratio-limit``; also the mark of the console and the report."""
ERROR_COLUMN = "error (× base)"


def _num(value) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return math.nan
    return x


def worst_ratio(r) -> float:
    """A row's (a mapping or a namedtuple) largest error ratio: the output's or the worst gradient's (NaN: none)."""
    get = r.get if isinstance(r, dict) else lambda k, d=None: getattr(r, k, d)
    ratios = [x for x in (_num(get("error_ratio")), _num(get("error_grad_ratio"))) if x == x]
    return max(ratios) if ratios else math.nan


def error_columns(df) -> list[str]:
    """The console table's error column when the run has error columns (an older run: none)."""
    return [ERROR_COLUMN] if "error_rms" in df and "error_note" in df and df["error_note"].notna().any() else []


def error_text(r, limit: float = DEFAULT_RATIO_LIMIT) -> str:
    """``2.9e-07 (1.0×)``: the output's RMS error and the largest ratio to the plain math's; ``!`` above ``limit``;
    ``not measured`` (the reason is in the row's ``error_note``)."""
    rms, worst = _num(getattr(r, "error_rms", None)), worst_ratio(r)
    if rms != rms:
        return "not measured"
    mark = " !" if worst > limit else ""
    return f"{rms:.1e} ({worst:.1f}×){mark}" if worst == worst else f"{rms:.1e}"


def above_limit(df, limit: float = DEFAULT_RATIO_LIMIT) -> pd.DataFrame:
    """The ok rows whose error ratio (output or worst gradient) is above ``limit``."""
    if "error_ratio" not in df or not len(df):
        return df.iloc[0:0]
    ok = df[df["status"] == "ok"]
    worst = ok.apply(worst_ratio, axis=1) if len(ok) else pd.Series(dtype=float)
    return ok[worst > limit]


def limit_lines(df, limit: float = DEFAULT_RATIO_LIMIT) -> list[str]:
    """One console line per row above the limit, then what it means (none when there are none)."""
    bad = above_limit(df, limit)
    lines = [f"  {r.cell_id}: error {r.error_rms:.2g}, {worst_ratio(r):.1f}× the plain math's in {r.dtype}"
             for r in bad.itertuples()]
    if lines:
        lines.append(f"note: {len(bad)} row(s) have an error ratio above {limit:g}: less accurate than their precision "
                     "has to be (their error against the float64 reference over that of the harness's plain math in the "
                     "same dtype; docs/accuracy.md)")
    return lines


def _keyed(df) -> dict:
    axes = [a for a in AXES if a in df]
    return {tuple(str(v) for v in r[axes]): r for _, r in df.iterrows()}


def accuracy_changes(frame_a, frame_b, limit: float = DEFAULT_RATIO_LIMIT) -> pd.DataFrame:
    """Cell by cell (ok in both runs), the error and its ratio in A and B and whether the ratio grew past ``limit``
    (``regression``); ``change`` says it in words (``untested``: a run has no error for the cell)."""
    if limit <= 0:
        raise ValueError(f"--error-ratio-limit must be > 0 (2 = twice the plain math's error), got {limit}")
    a, b = _keyed(frame_a), _keyed(frame_b)
    rows = []
    for key, rb in b.items():
        ra = a.get(key)
        if ra is None or ra.get("status") != "ok" or rb.get("status") != "ok":
            continue
        ratio_a, ratio_b = worst_ratio(dict(ra)), worst_ratio(dict(rb))
        row = {"impl": rb["impl"], "dtype": rb["dtype"], "mode": rb["mode"], "seq_len": rb["seq_len"],
               "cell_id": rb["cell_id"], "error_a": _num(ra.get("error_rms")), "error_b": _num(rb.get("error_rms")),
               "ratio_a": ratio_a, "ratio_b": ratio_b,
               "time_ratio": _num(rb.get("median_s")) / _num(ra.get("median_s")) if _num(ra.get("median_s")) else math.nan}
        row["regression"] = bool(ratio_a == ratio_a and ratio_b == ratio_b and ratio_a <= limit < ratio_b)
        row["change"] = ("untested" if ratio_a != ratio_a or ratio_b != ratio_b else
                         f"error ratio grew past {limit:g}" if row["regression"] else
                         f"above {limit:g} in both runs" if ratio_a > limit and ratio_b > limit else
                         f"back within {limit:g}" if ratio_a > limit else "within the limit")
        rows.append(row)
    cols = ["impl", "dtype", "mode", "seq_len", "cell_id", "error_a", "error_b", "ratio_a", "ratio_b", "time_ratio",
            "regression", "change"]
    out = pd.DataFrame(rows, columns=cols)
    return out.sort_values(["regression", "ratio_b"], ascending=[False, False], kind="stable").reset_index(drop=True)


def print_accuracy(console, frames, limit: float = DEFAULT_RATIO_LIMIT) -> int:
    """``attnbench compare``'s accuracy table on ``console`` (the cells whose error ratio changed side of ``limit``
    or is above it, each with its timing change B/A) and one line on what it found; the number of accuracy
    regressions."""
    from rich.table import Table

    if frames is None:
        return 0
    changes = accuracy_changes(frames[0], frames[1], limit)
    tested = changes[changes["change"] != "untested"]
    if not len(tested):
        if len(changes):
            console.print("accuracy: not compared (a run has no error columns: measured before issue 38, or with "
                          "--accuracy off)", markup=False)
        return 0
    shown = tested[tested["change"] != "within the limit"]
    if len(shown):
        table = Table(title=f"accuracy: error against float64 (RMS) and its ratio to the plain math's, A -> B "
                            f"(limit {limit:g})")
        for col in ("impl", "dtype", "mode", "T", "A error", "B error", "A ratio", "B ratio", "time B/A", "change"):
            table.add_column(col, justify="left" if col in ("impl", "dtype", "mode", "change") else "right")
        for r in shown.itertuples():
            table.add_row(r.impl, r.dtype, r.mode, str(r.seq_len), f"{r.error_a:.2g}", f"{r.error_b:.2g}",
                          f"{r.ratio_a:.1f}×", f"{r.ratio_b:.1f}×", f"{r.time_ratio:.3f}×", r.change,
                          style="bold red" if r.regression else None)
        console.print(table)
    n = int(tested["regression"].sum())
    console.print(f"accuracy: {len(tested)} cell(s) with errors in both runs: {n} error ratio(s) grew past {limit:g}, "
                  f"{int((tested['change'] == f'above {limit:g} in both runs').sum())} above it in both runs",
                  markup=False)
    return n
