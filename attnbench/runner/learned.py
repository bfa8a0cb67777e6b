"""What a run's plan learns from the earlier runs on this machine (issue 49): each cell's wall seconds per round and
process, as ``attnbench run --predict`` would say (:mod:`attnbench.measure.predict`: the same cell measured before,
else its group's cost model), so that

* the progress line's ETA (:class:`attnbench.cli.progress.Forecast`) starts from learned times, not from the analytic
  FLOPs at a guessed share of the peak (which err long on purpose, for timeouts), and the run says its forecast
  before the first cell;
* an executor that measures units at once (Ray) starts the longest first (longest-processing-time order: the last
  unit to finish is a short one), where a serial executor keeps its seeded shuffle, the statistics' guard against
  drift.

Timeouts and the memory guard stay with the analytic plan in the measuring process (:mod:`attnbench.runner.budget`):
a timeout from a learned time would cut a cell short on a machine that is busier than when it learned.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

LEARNED_FROM = ("measured", "model")
"""Where a cell's time may come from to count as learned (``measured (skipped)`` and the like count as measured);
an implementation's or every cell's median is too coarse to plan by."""


@dataclass(frozen=True)
class Learned:
    """Seconds per round and process of the cells the earlier runs price (``unit_s``), where each came from (``how``),
    and how many runs they were read from."""

    unit_s: dict[str, float]
    how: dict[str, str]
    runs: int
    cells: int  # the cells of the session, priced or not

    def line(self, units: int) -> str:
        """The forecast, for the console before the first cell."""
        counts: dict[str, int] = {}
        for how in self.how.values():
            key = "as measured before" if how.startswith("measured") else "by the cost model"
            counts[key] = counts.get(key, 0) + 1
        unpriced = self.cells - len(self.unit_s)
        parts = [f"{n} {k}" for k, n in counts.items()] + ([f"{unpriced} from FLOPs"] if unpriced else [])
        total = sum(self.unit_s.values()) * units
        return (f"forecast: ~{total:.0f} s of measuring for the {len(self.unit_s)} learned cell(s), from "
                f"{self.runs} earlier run(s) on this machine ({', '.join(parts)})")


def learn(cells: Iterable, results: str | Path) -> Learned | None:
    """The learned times of ``cells`` from the runs under ``results`` (the run's ``--out``); None when there is no
    earlier run on this machine, or none of the cells can be priced."""
    from attnbench.measure import predict

    cells = list(cells)
    runs = predict.earlier_runs(results)
    past = predict.history(runs)
    if not cells or past.empty:
        return None
    new = predict.new_rows(cells)
    seconds, how = predict.predicted(new, past, "unit_s")
    unit_s, said = {}, {}
    for cell_id, s, h in zip(new["cell_id"], seconds, how, strict=True):
        if math.isfinite(s) and h.split(" ")[0] in LEARNED_FROM:
            unit_s[cell_id], said[cell_id] = max(float(s), 0.0), h
    return Learned(unit_s, said, len(runs), len(cells)) if unit_s else None


def longest_first(units: list, learned: Learned | str | None, unit_cells=lambda u: u) -> list:
    """``units`` (each a tuple of cells, or anything ``unit_cells`` maps to one) longest-predicted first; a unit with
    a cell the earlier runs do not price counts as longest (it may be large). Ties keep their order."""
    if not isinstance(learned, Learned):  # none, or the sentence saying why none was learned
        return list(units)

    def key(unit) -> float:
        times = [learned.unit_s.get(c.cell_id, math.inf) for c in unit_cells(unit)]
        return -sum(times)

    return sorted(units, key=key)
