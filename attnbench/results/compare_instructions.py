"""The instruction-count layer of ``attnbench compare``: two runs' ``instructions`` per call, cell by cell.

An instruction count repeats to a few parts per million for the same code and inputs (docs/instructions.md), so no
test of significance is needed: a cell **regresses** when B counts more than ``1 + threshold`` times A's instructions
(default 1%), and improves below ``1 / (1 + threshold)``. Each compared cell also names the functions whose counts
changed most (B - A, per call, from callgrind's per-function table kept in ``instr_functions``), the answer to "what
started doing more work?". Cells are matched on :data:`attnbench.results.schema.AXES`, as the timing comparison does;
a cell counted in one run only, or counted ``ok`` in one and not the other, is listed, never dropped.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from attnbench.errors import ResultsError
from attnbench.results.schema import AXES

DEFAULT_THRESHOLD = 0.01
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


@dataclass
class InstructionComparison:
    """``cells``: one row per cell counted ok in both runs (largest relative change first) with ``instructions_a``,
    ``instructions_b``, ``ratio`` (B/A), ``delta`` (B - A per call), ``change``, ``regression``, ``improvement`` and
    ``top_functions`` (:func:`top_changed`); ``unmatched``: cell ids counted in one run only; ``failed``: (cell id,
    status A, status B) of cells not counted ok in both."""

    cells: pd.DataFrame
    threshold: float
    unmatched: list[str] = field(default_factory=list)
    failed: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def regressions(self) -> pd.DataFrame:
        return self.cells[self.cells["regression"]] if len(self.cells) else self.cells

    @property
    def has_regression(self) -> bool:
        return bool(len(self.regressions))


def compare_instructions(dfa: pd.DataFrame, dfb: pd.DataFrame, threshold: float = DEFAULT_THRESHOLD) -> InstructionComparison:
    """Compare run B's instruction counts against run A's (see the module docstring)."""
    if threshold < 0:
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
    cols = ["cell_id", "impl", "seq_len", "mode", "instructions_a", "instructions_b", "ratio", "delta", "change",
            "regression", "improvement", "top_functions", "capability_note"]
    cells = pd.DataFrame(rows, columns=cols)
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


def _cell(ra: dict, rb: dict, threshold: float) -> dict:
    """One compared cell (both counted ok)."""
    a, b = float(ra["instructions"]), float(rb["instructions"])
    ratio = b / a if a > 0 else math.inf
    regression, improvement = ratio > 1 + threshold, ratio < 1 / (1 + threshold)
    change = "more instructions" if regression else "fewer instructions" if improvement else (
        "unchanged" if ratio == 1 else "within threshold")
    cap_a, cap_b = str(ra.get("cpu_capability") or ""), str(rb.get("cpu_capability") or "")
    return dict(cell_id=ra.get("cell_id"), impl=ra.get("impl"), seq_len=ra.get("seq_len"), mode=ra.get("mode"),
                instructions_a=a, instructions_b=b, ratio=ratio, delta=b - a, change=change, regression=bool(regression),
                improvement=bool(improvement), top_functions=top_changed(functions_of(ra), functions_of(rb)),
                capability_note="" if cap_a == cap_b else f"CPU capability differs: A {cap_a or '?'}, B {cap_b or '?'}")


def fmt_count(value: float) -> str:
    """An instruction count for a table: ``1.23 G``, ``456.7 M``, ``12.3 k`` or the integer."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.4g} {unit}"
    return f"{value:.0f}"
