"""Issue 48's report views: the implementation x property table, and the mixed serving step's parts.

**Properties.** A run's ok rows carry ``deterministic`` and ``batch_invariant`` (:mod:`attnbench.runner.properties`:
``bitwise``, ``within k ulps``, ``differs by X``, or empty where they were not measured). The table has one row per
implementation and one column per property, holding the *worst* statement over the rows it was measured on and how
many of them were bitwise. Each cell has a class for its colour (:data:`CLASSES`): green bitwise, amber within a few
ulps, red differs, grey not measured.

**Mixed step.** The rows with a ``batch_spec`` (``attnbench run --batch-spec``): per spec and implementation, the
whole step's time, its prefill and decode parts (``prefill_s``, ``decode_s``), the paired speed-up against the group's
baseline and GFLOP/s over real tokens.
"""

from __future__ import annotations

import math
import re

import pandas as pd

from attnbench.report import analysis as an
from attnbench.results.text import fmt_time

PROPERTIES = ("deterministic", "batch_invariant")
"""The property columns of a run's rows, in the table's order."""
CLASSES = {"bitwise": "prop-bitwise", "ulps": "prop-ulps", "differs": "prop-differs", "": "prop-none"}
"""The HTML class of a cell by the kind of its statement (the report's stylesheet colours them)."""

_ULPS = re.compile(r"^within (\d+) ulps?$")
_DIFFERS = re.compile(r"^differs by (\S+)$")


def kind(text) -> str:
    """``bitwise``, ``ulps``, ``differs`` or ``""`` (not measured) of one statement."""
    text = "" if text is None or (isinstance(text, float) and math.isnan(text)) else str(text).strip()
    if text == "bitwise":
        return "bitwise"
    return "ulps" if _ULPS.match(text) else "differs" if _DIFFERS.match(text) else ""


def severity(text) -> tuple[int, float]:
    """An order on statements, worst last: bitwise < within 1 ulp < within 5 ulps < differs by 1e-6 < by 1e-3."""
    k = kind(text)
    if k == "ulps":
        return 1, float(_ULPS.match(str(text).strip()).group(1))
    if k == "differs":
        try:
            return 2, float(_DIFFERS.match(str(text).strip()).group(1))
        except ValueError:
            return 2, math.inf
    return (0, 0.0) if k == "bitwise" else (-1, 0.0)


def table(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, list[list[str]]]:
    """The displayed table (implementation, one column per property), the raw one (one row per implementation and
    property: worst statement, rows measured, rows bitwise) and each displayed cell's class. Empty when no row of
    the run has a property measured (or the run is older than the columns)."""
    ok = an.ok_rows(df)
    present = [p for p in PROPERTIES if p in ok.columns]
    if not present or not any(ok[p].map(kind).ne("").any() for p in present):
        return pd.DataFrame(), pd.DataFrame(), []
    raw, shown, classes = [], [], []
    for impl in an.impl_order(ok):
        rows = ok[ok["impl"] == impl]
        line, line_classes = {"implementation": impl}, [""]
        for prop in present:
            measured = [str(v).strip() for v in rows[prop] if kind(v)]
            worst = max(measured, key=severity) if measured else ""
            bitwise = sum(kind(v) == "bitwise" for v in measured)
            raw.append({"impl": impl, "property": prop, "worst": worst, "rows_measured": len(measured),
                        "rows_bitwise": bitwise})
            line[prop] = (f"{worst} ({bitwise}/{len(measured)} rows bitwise)" if measured and worst != "bitwise"
                          else f"bitwise ({len(measured)} rows)" if measured else "not measured")
            line_classes.append(CLASSES[kind(worst)])
        shown.append(line)
        classes.append(line_classes)
    return pd.DataFrame(shown), pd.DataFrame(raw), classes


def cells(display: pd.DataFrame, classes: list[list[str]]) -> list[list[tuple[str, str]]]:
    """The displayed table's rows as ``(text, class)`` pairs, for the template to colour each cell."""
    return [list(zip((str(v) for v in row), line, strict=True))
            for row, line in zip(display.itertuples(index=False), classes, strict=True)]


MIXED_COLUMNS = ["batch_spec", "impl", "step_s", "prefill_s", "decode_s", "speedup", "speedup_ci_low",
                 "speedup_ci_high", "baseline", "gflops_per_s", "tokens"]


def mixed_table(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The mixed serving step's rows, displayed and raw (empty when the run has none). Skipped rows are listed under
    the failed and skipped cells, with their reasons."""
    if "batch_spec" not in df.columns:
        return pd.DataFrame(), pd.DataFrame()
    ok = an.ok_rows(df)
    ok = ok[ok["batch_spec"].fillna("").astype(str) != ""]
    if ok.empty:
        return pd.DataFrame(), pd.DataFrame()
    raw = ok.assign(step_s=ok["median_s"])[[c for c in MIXED_COLUMNS if c in ok.columns or c == "step_s"]]
    raw = raw.sort_values(["batch_spec", "step_s"], kind="stable").reset_index(drop=True)
    shown = pd.DataFrame({
        "batch spec": raw["batch_spec"], "implementation": raw["impl"],
        "step": [fmt_time(v) for v in raw["step_s"]],
        "prefill part": [fmt_time(v) if v == v else "–" for v in raw["prefill_s"]],
        "decode part": [fmt_time(v) if v == v else "–" for v in raw["decode_s"]],
        "speed-up": [_speedup(r) for r in raw.itertuples()],
        "GFLOP/s (real tokens)": [an.fmt_num(v) for v in raw["gflops_per_s"]],
        "new tokens": raw["tokens"].astype(int)})
    return shown, raw


def _speedup(r) -> str:
    if str(r.baseline or "") == r.impl:
        return "baseline"
    if not (isinstance(r.speedup, float) and math.isfinite(r.speedup)):
        return "–"
    return f"{r.speedup:.2f}× ({r.speedup_ci_low:.2f}–{r.speedup_ci_high:.2f}) vs {r.baseline}"
