"""``attnbench run``'s progress line: the count of cells, a bar, the time so far and the time left, then the cell.

The time left comes from the plan (:class:`Forecast`): every cell of the session has a predicted time: learned from
the earlier runs on this machine where they price it (:mod:`attnbench.runner.learned`), else from the cost
model the measuring processes plan with (:mod:`attnbench.runner.budget`: the warm-up and the sampling budget, plus
the calls it makes at least at the analytic FLOPs' share of the machine's peak), so the first cell of a sweep of
long cells already has an ETA (rich's own estimate needs finished cells: ``0/64``, ``-:--:--`` for minutes). As cells
finish, the prediction is scaled by how long they took against theirs, and the peak GFLOP/s their rows measured
replaces the assumed one.

On a narrow terminal the cell's name is cut (``…``) and the bar shrinks; the count and the times are never cut.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Column
from rich.text import Text

FACTOR_RANGE = (0.1, 10.0)
"""The finished cells' time over their prediction, as applied to the cells left, is kept in this range (a first cell
that met a busy moment, or compiled, does not make the ETA absurd)."""


class Forecast:
    """Seconds left in a run session: the predicted seconds of the rounds not yet measured, scaled by how the
    finished ones compared with their predictions, less the time the cells now running have already had."""

    def __init__(self) -> None:
        self.cells: dict[str, tuple[float, float]] = {}  # cell_id -> (fixed seconds, FLOPs of its calls)
        self.learned: dict[str, float] = {}  # cell_id -> seconds per unit, learned from earlier runs
        self.units = 1  # rounds x processes: each cell is measured this many times
        self.done: dict[str, int] = {}
        self.running: set[str] = set()
        self.peak_gflops: float | None = None
        self.t0: float | None = None  # the first cell's start
        self.last: float | None = None  # the last cell's end

    def plan(self, cells: Iterable, settings, learned=None) -> None:
        """Predict each cell of the session under ``settings`` (the sweep's measurement settings): from ``learned``
        (:class:`attnbench.runner.learned.Learned`, the earlier runs' times) where it prices the cell, else
        analytically."""
        from attnbench.runner import budget
        from attnbench.runner.learned import Learned

        self.units = max(1, int(settings.rounds) * int(settings.processes))
        self.learned = dict(learned.unit_s) if isinstance(learned, Learned) else {}
        calls = budget.calls_at_least(settings)
        fixed = float(settings.warmup_s) + float(settings.budget_s)
        for cell in cells:
            try:
                flops = calls * float(budget.cell_flops(cell))
            except Exception:  # a cost model that cannot price the cell: its fixed part alone
                flops = 0.0
            self.cells[cell.cell_id] = (fixed, flops if math.isfinite(flops) else 0.0)

    def predicted_s(self, cell_id: str) -> float:
        """One measurement of ``cell_id``, predicted (0 for a cell not in the plan)."""
        from attnbench.runner import budget

        if cell_id in self.learned:
            return self.learned[cell_id]
        fixed, flops = self.cells.get(cell_id, (0.0, 0.0))
        peak = self.peak_gflops or budget.UNKNOWN_PEAK_GFLOPS
        return fixed + flops / (budget.ANALYTIC_EFFICIENCY * peak * 1e9)

    def started(self, cell_id: str, now: float) -> None:
        self.t0 = now if self.t0 is None else self.t0
        self.running.add(cell_id)

    def finished(self, cell_id: str, row: dict, now: float) -> None:
        """One measurement of ``cell_id`` ended with ``row``; a failed cell is not measured again."""
        self.t0 = now if self.t0 is None else self.t0
        self.last = now
        self.running.discard(cell_id)
        failed = row.get("status") != "ok"
        self.done[cell_id] = self.units if failed else min(self.done.get(cell_id, 0) + 1, self.units)
        peak = row.get("peak_gflops_per_s")
        if isinstance(peak, int | float) and math.isfinite(peak) and peak > 0:
            self.peak_gflops = float(peak)

    def eta_s(self, now: float) -> float | None:
        """Seconds left, or None before a plan."""
        if not self.cells:
            return None
        left = sum(self.predicted_s(c) * (self.units - self.done.get(c, 0)) for c in self.cells)
        spent = sum(self.predicted_s(c) * n for c, n in self.done.items())
        factor = 1.0
        if spent > 0 and self.last is not None and self.t0 is not None and self.last > self.t0:
            factor = min(max((self.last - self.t0) / spent, FACTOR_RANGE[0]), FACTOR_RANGE[1])
        since = now - (self.last if self.last is not None else self.t0 if self.t0 is not None else now)
        running = sum(self.predicted_s(c) for c in self.running) * factor
        return max(left * factor - min(max(since, 0.0), running), 0.0)


def clock(seconds: float) -> str:
    """``0:04:05``, as rich writes times."""
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class EtaColumn(ProgressColumn):
    """``ETA 0:04:05`` from the :class:`Forecast`; rich's estimate from the finished cells when there is no plan."""

    def __init__(self, forecast: Forecast, now: Callable[[], float] = time.perf_counter):
        super().__init__(table_column=Column(no_wrap=True))
        self.forecast, self.now = forecast, now

    def render(self, task) -> Text:
        eta = self.forecast.eta_s(self.now())
        if eta is None:
            eta = task.time_remaining
        return Text("ETA " + ("-:--:--" if eta is None else clock(eta)), style="progress.remaining")


class RunProgress:
    """The engine's ``progress(i, total, cell, row)`` callback driving the progress line, with ``plan(cells,
    settings)`` for the run session (:meth:`attnbench.runner.session.RunSession.measure` gives it its cells). The
    line counts cells: the engine counts each cell's rounds in each process, ``units_per_cell()`` of them, asked once
    the run has started (so that a resumed run's errors come from the engine first)."""

    def __init__(self, console: Console, units_per_cell: Callable[[], int] = lambda: 1,
                 now: Callable[[], float] = time.perf_counter):
        self.forecast, self.now, self.units_per_cell = Forecast(), now, units_per_cell
        whole = Column(no_wrap=True)
        self.bar = Progress(TextColumn("[bold]cell", table_column=whole), MofNCompleteColumn(table_column=whole),
                            BarColumn(bar_width=None, table_column=Column(min_width=4, max_width=40, ratio=1)),
                            TimeElapsedColumn(table_column=whole), EtaColumn(self.forecast, now),
                            TextColumn("{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis",
                                                                                 min_width=1, ratio=3)),
                            console=console, transient=False, expand=True)
        self.task = self.bar.add_task("", total=None)
        self.units: int | None = None

    def plan(self, cells, settings, learned=None) -> None:
        """Forecast the session; say before the first cell what the forecast was learned from, or why it was not."""
        from attnbench.runner.learned import Learned

        self.forecast.plan(cells, settings, learned)
        if isinstance(learned, Learned):
            self.bar.console.print(learned.line(self.forecast.units), style="dim", highlight=False)
        elif isinstance(learned, str):
            self.bar.console.print(f"warning: {learned}", style="yellow", highlight=False)

    def __call__(self, i: int, total: int, cell, row: dict | None) -> None:
        if not self.bar.live.is_started:  # started by the first cell: errors before it print cleanly
            self.units = self.units_per_cell()
            self.bar.start()
        now = self.now()
        if row is None:
            self.forecast.started(cell.cell_id, now)
        else:
            self.forecast.finished(cell.cell_id, row, now)
        self.bar.update(self.task, total=total // self.units, completed=i // self.units,
                        description=cell.cell_id if row is None else f"{cell.cell_id} -> {row['status']}")
