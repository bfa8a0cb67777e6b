"""The instruction-count layer of ``attnbench compare``: two runs' ``instructions`` per call, cell by cell.

A cell **regresses** when B counts more than ``1 + threshold`` times A's instructions, and improves below
``1 / (1 + threshold)``. Each compared cell also names the functions whose counts changed most (B - A, per call, from
callgrind's per-function table kept in ``instr_functions``), the answer to "what started doing more work?". Cells are
matched on :data:`attnbench.results.schema.AXES`, as the timing comparison does; a cell counted in one run only, or
counted ``ok`` in one and not the other, is listed, never dropped.

**The threshold follows the noise** (issue 45). A count is the mean of ``instr_repeats`` repeats of the counted
loop (default 9), and ``instr_spread`` is their ``(max - min) / mean``: how far the same code counted apart in that
process (with the other core loaded, the smallest cell's repeats spread over 0.25%, and two counts of a cell were seen
0.144% apart). Unless ``--instr-threshold`` fixes it, each cell's threshold is ``max(SPREAD_FACTOR x spread,
THRESHOLD_FLOOR)``, the spread being the larger of the two runs':

* :data:`SPREAD_FACTOR` = 1: both runs' means lie inside the band their repeats fill, so two means of unchanged code
  differ by less than that band's width; nine repeats see about 3 standard deviations of a normal noise, while the
  difference of two means of nine has a standard deviation of 0.47 of one, so one spread is about 6 standard
  deviations of that difference (4 where the range is drawn at its 5th percentile), and a +0.5% change is still
  caught at spreads up to about 0.35%;
* :data:`THRESHOLD_FLOOR` = 0.1%: the noise a repeat cannot see, because it is the same in every repeat of one process
  (its environment's size and paths move the stack and heap: counts of the same code taken by different commands
  were seen up to 284 ppm apart, docs/instructions.md); 0.1% is 3.5 times that;
* runs counted before spreads were recorded (no ``instr_spread``) keep the old fixed :data:`FALLBACK_THRESHOLD`, 1%.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from attnbench.errors import ResultsError
from attnbench.results.schema import AXES

SPREAD_FACTOR = 1.0
"""Times the recorded repeat spread a cell's count must grow by to fail (see the module docstring)."""
THRESHOLD_FLOOR = 0.001
"""The smallest noise-derived threshold, 0.1% (see the module docstring)."""
FALLBACK_THRESHOLD = 0.01
"""The threshold of a cell whose runs recorded no spread (counted before issue 45), 1%: the old fixed default."""
DEFAULT_THRESHOLD = None
"""``--instr-threshold``'s default: each cell's from its recorded spread (:func:`cell_threshold`)."""
TOP_CHANGED = 5


def has_instructions(df: pd.DataFrame) -> bool:
    """Whether a results table holds at least one counted cell (a finite ``instructions`` value)."""
    return "instructions" in df and bool(np.isfinite(pd.to_numeric(df["instructions"], errors="coerce")).any())


def functions_of(row: dict) -> dict[str, float]:
    """A row's per-function table (``instr_functions``, JSON), {} when it has none."""
    text = row.get("instr_functions")
    if not isinstance(text, str) or not text:
        return {}
    try:
        return {str(k): float(v) for k, v in json.loads(text).items()}
    except (ValueError, AttributeError) as exc:
        raise ResultsError(f"{row.get('cell_id')}: instr_functions is not a JSON table ({exc})") from None


def top_changed(a: dict[str, float], b: dict[str, float], n: int = TOP_CHANGED) -> list[tuple[str, float, float]]:
    """The ``n`` functions whose count per call changed most from ``a`` to ``b``: ``(name, count in A, B - A)``,
    largest change first (``(other)``, the sum of the functions outside each table, is not a function)."""
    names = (set(a) | set(b)) - {"(other)"}
    deltas = [(name, a.get(name, 0.0), b.get(name, 0.0) - a.get(name, 0.0)) for name in names]
    deltas = [d for d in deltas if d[2]]
    return sorted(deltas, key=lambda d: (-abs(d[2]), d[0]))[:n]


def _key(row: dict) -> tuple:
    return tuple("" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)
                 for v in (row.get(a) for a in AXES))


def spread_of(row: dict) -> float:
    """A counted row's recorded repeat spread (``instr_spread``), NaN when it has none (one repeat, or a run counted
    before issue 45)."""
    value = row.get("instr_spread")
    return float(value) if _finite(value) and float(value) >= 0 else math.nan


def cell_threshold(spread_a: float, spread_b: float) -> tuple[float, str]:
    """A cell's default threshold from its two runs' spreads, and how it was set (words for the table): the larger
    spread times :data:`SPREAD_FACTOR`, at least :data:`THRESHOLD_FLOOR`; :data:`FALLBACK_THRESHOLD` when neither
    run recorded one."""
    spreads = [v for v in (spread_a, spread_b) if math.isfinite(v)]
    if not spreads:
        return FALLBACK_THRESHOLD, "no recorded spread: fixed"
    spread = max(spreads)
    if SPREAD_FACTOR * spread <= THRESHOLD_FLOOR:
        return THRESHOLD_FLOOR, "floor"
    return SPREAD_FACTOR * spread, f"{SPREAD_FACTOR:g} x spread"


@dataclass
class InstructionComparison:
    """``cells``: one row per cell counted ok in both runs (largest relative change first) with ``instructions_a``,
    ``instructions_b``, ``ratio`` (B/A), ``delta`` (B - A per call), ``spread_a``/``spread_b`` (each run's recorded
    repeat spread), ``threshold`` (the cell's) and ``threshold_source`` (how it was set), ``change``, ``regression``,
    ``improvement`` and ``top_functions`` (:func:`top_changed`); ``threshold``: the one given, None when each cell's
    follows its spread; ``unmatched``: cell ids counted in one run only; ``failed``: (cell id, status A, status B)
    of cells not counted ok in both."""

    cells: pd.DataFrame
    threshold: float | None
    unmatched: list[str] = field(default_factory=list)
    failed: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def regressions(self) -> pd.DataFrame:
        return self.cells[self.cells["regression"]] if len(self.cells) else self.cells

    @property
    def has_regression(self) -> bool:
        return bool(len(self.regressions))

    def describe_threshold(self) -> str:
        """The threshold in words: the fixed one, or how each cell's followed its spread and their range."""
        if self.threshold is not None:
            return f"{self.threshold:.2%} (--instr-threshold)"
        rule = (f"max({SPREAD_FACTOR:g} x the repeat spread, {THRESHOLD_FLOOR:.1%}) per cell, {FALLBACK_THRESHOLD:.0%} "
                "where no spread was recorded")
        if not len(self.cells):
            return rule
        lo, hi = float(self.cells["threshold"].min()), float(self.cells["threshold"].max())
        spreads = pd.concat([self.cells["spread_a"], self.cells["spread_b"]]).dropna()
        said = f"; spreads measured up to {spreads.max():.3%}" if len(spreads) else ""
        return f"{rule}: {lo:.2%}" + (f" to {hi:.2%}" if hi > lo else "") + said


CELL_COLUMNS = ["cell_id", "impl", "seq_len", "mode", "instructions_a", "instructions_b", "ratio", "delta", "spread_a",
                "spread_b", "threshold", "threshold_source", "change", "regression", "improvement", "top_functions",
                "capability_note"]


def compare_instructions(dfa: pd.DataFrame, dfb: pd.DataFrame,
                         threshold: float | None = DEFAULT_THRESHOLD) -> InstructionComparison:
    """Compare run B's instruction counts against run A's (see the module docstring); ``threshold``: a fixed one
    for every cell, None: each cell's from its recorded spread (:func:`cell_threshold`)."""
    if threshold is not None and threshold < 0:
        raise ResultsError(f"--instr-threshold must be >= 0 (a fraction: 0.01 means 1%), got {threshold}")
    ia = {_key(r): r for r in dfa.to_dict("records")}
    ib = {_key(r): r for r in dfb.to_dict("records")}
    rows, failed = [], []
    for key in (k for k in ia if k in ib):
        ra, rb = ia[key], ib[key]
        counted = [_finite(r.get("instructions")) and r.get("status") == "ok" for r in (ra, rb)]
        if not all(counted):
            failed.append((str(ra.get("cell_id")), str(ra.get("status")), str(rb.get("status"))))
            continue
        rows.append(_cell(ra, rb, threshold))
    cells = pd.DataFrame(rows, columns=CELL_COLUMNS)
    if len(cells):
        order = (cells["ratio"] - 1).abs().sort_values(ascending=False).index
        cells = cells.loc[order].sort_values("regression", ascending=False, kind="stable").reset_index(drop=True)
    unmatched = [str(r.get("cell_id")) for k, r in {**ia, **ib}.items() if (k in ia) != (k in ib)]
    return InstructionComparison(cells, threshold, unmatched, failed)


def _finite(value) -> bool:
    try:
        return value is not None and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _cell(ra: dict, rb: dict, threshold: float | None) -> dict:
    """One compared cell (both counted ok), against ``threshold`` or, when None, its spreads' threshold."""
    a, b = float(ra["instructions"]), float(rb["instructions"])
    spread_a, spread_b = spread_of(ra), spread_of(rb)
    limit, source = (threshold, "given") if threshold is not None else cell_threshold(spread_a, spread_b)
    ratio = b / a if a > 0 else math.inf
    regression, improvement = ratio > 1 + limit, ratio < 1 / (1 + limit)
    change = "more instructions" if regression else "fewer instructions" if improvement else (
        "unchanged" if ratio == 1 else "within threshold")
    cap_a, cap_b = str(ra.get("cpu_capability") or ""), str(rb.get("cpu_capability") or "")
    return dict(cell_id=ra.get("cell_id"), impl=ra.get("impl"), seq_len=ra.get("seq_len"), mode=ra.get("mode"),
                instructions_a=a, instructions_b=b, ratio=ratio, delta=b - a, spread_a=spread_a, spread_b=spread_b,
                threshold=limit, threshold_source=source, change=change, regression=bool(regression),
                improvement=bool(improvement), top_functions=top_changed(functions_of(ra), functions_of(rb)),
                capability_note="" if cap_a == cap_b else f"CPU capability differs: A {cap_a or '?'}, B {cap_b or '?'}")


def fmt_count(value: float) -> str:
    """An instruction count for a table: ``1.23 G``, ``456.7 M``, ``12.3 k`` or the integer."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.4g} {unit}"
    return f"{value:.0f}"
