"""Issue 49: the plan learns each cell's time from the earlier runs on this machine (:mod:`attnbench.runner.learned`):
the progress line's forecast starts from those times, and an executor that measures units at once gets the longest
first."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

import attnbench
from attnbench.results.schema import Cell
from attnbench.runner import learned
from attnbench.runner.sweep import Settings, Sweep

FAST = {"budget_s": 0.05, "min_samples": 3, "warmup_calls": 1, "warmup_s": 0.0, "flop_check": False,
        "accuracy": False, "drift": 0.0}
AXES = {"impl": ["weight_split", "sdpa"], "seq_len": [16, 32], "d_model": [32], "num_heads": [2], "batch": [1],
        "mode": ["forward"]}


def test_a_second_run_is_planned_from_the_first_runs_measured_times(tmp_path):
    first = attnbench.run(**AXES, out=tmp_path, settings=FAST)
    cells = [Cell(**{k: r[k] for k in ("impl", "seq_len", "d_model", "num_heads", "batch", "mode")})
             for r in first.to_dict("records")]
    got = learned.learn(cells, tmp_path)
    assert got is not None and got.runs == 1 and got.cells == 4
    assert set(got.unit_s) == set(first.cell_id) and all(h == "measured" for h in got.how.values())
    for row in first.to_dict("records"):  # one round in one process: a unit's time is the row's own wall time
        assert got.unit_s[row["cell_id"]] == pytest.approx(row["duration_s"])
    assert learned.learn(cells, tmp_path / "elsewhere") is None  # no earlier run: the plan stays analytic
    second = attnbench.run(**AXES, out=tmp_path, settings=FAST, progress=_Planning())
    from attnbench.results.store import read_meta

    said = read_meta(second.attrs["run_dir"])["forecast"]
    assert said["learned_cells"] == said["cells"] == 4 and said["runs"] == 1
    assert said["learned_cells_s"] == pytest.approx(sum(got.unit_s.values()))


class _Planning:
    """A progress callback that takes a plan, as the CLI's does."""

    def plan(self, cells, settings, learned=None):
        self.learned = learned

    def __call__(self, *args):
        pass


def test_the_forecast_starts_from_the_learned_times_and_says_where_they_came_from():
    from attnbench.cli.progress import RunProgress

    cells = [Cell("sdpa", seq_len=t) for t in (16, 32, 64)]
    priced = learned.Learned({cells[0].cell_id: 2.0, cells[1].cell_id: 3.0},
                             {cells[0].cell_id: "measured", cells[1].cell_id: "model"}, runs=2, cells=3)
    out = io.StringIO()
    progress = RunProgress(Console(file=out, width=200), now=lambda: 0.0)
    progress.plan(cells, Settings(budget_s=0.5, rounds=2), priced)
    forecast = progress.forecast
    assert forecast.predicted_s(cells[0].cell_id) == 2.0 and forecast.predicted_s(cells[1].cell_id) == 3.0
    analytic = forecast.predicted_s(cells[2].cell_id)
    assert analytic >= 0.5 and analytic != 2.0  # not priced by the runs: the budget and FLOPs, as before
    assert forecast.eta_s(0.0) == pytest.approx(2 * (2.0 + 3.0 + analytic))
    said = out.getvalue()
    assert "forecast: ~10 s of measuring for the 2 learned cell(s), from 2 earlier run(s)" in said
    assert "1 as measured before, 1 by the cost model, 1 from FLOPs" in said


def test_an_unreadable_history_is_said_not_swallowed():
    from attnbench.cli.progress import RunProgress

    out = io.StringIO()
    progress = RunProgress(Console(file=out, width=200), now=lambda: 0.0)
    progress.plan([Cell("sdpa")], Settings(), "forecast not learned from the earlier runs in r: OSError: denied")
    assert "warning: forecast not learned from the earlier runs in r: OSError: denied" in out.getvalue()
    assert progress.forecast.learned == {}


def test_longest_first_orders_units_and_puts_unpriced_ones_first():
    a, b, c, d = (Cell("sdpa", seq_len=t) for t in (16, 32, 64, 128))
    priced = learned.Learned({a.cell_id: 1.0, b.cell_id: 5.0, c.cell_id: 2.0}, {}, runs=1, cells=4)
    units = [(a,), (b,), (c, a), (d,)]
    assert learned.longest_first(units, priced) == [(d,), (b,), (c, a), (a,)]
    assert learned.longest_first(units, None) == units
    assert learned.longest_first(units, "not learned: ...") == units


class _Concurrent:
    """An executor measuring units at once: it records the order the session gave them."""

    concurrent = True

    def __init__(self):
        self.order = []

    def execute(self, units, on_row, on_start=None):
        from tests.sample_runs import ok_row

        for unit in units:
            self.order.append(unit.cells[0].seq_len)
            for cell in unit.cells:
                on_start(cell)
                on_row(cell, ok_row(cell, [1e-3] * 5))

    def close(self):
        pass

    def environment(self):
        return {"workers": [], "nodes": []}


def test_a_concurrent_executor_gets_the_longest_units_first(tmp_path, monkeypatch):
    from attnbench.runner.session import RunSession

    def times(cells, results):
        cells = list(cells)
        return learned.Learned({c.cell_id: float(c.seq_len % 48) for c in cells}, {}, runs=1, cells=len(cells))

    monkeypatch.setattr(learned, "learn", times)
    executor = _Concurrent()
    sweep = Sweep(impl=("sdpa",), seq_len=(16, 32, 64, 96), settings=Settings(drift=0.0, cpu_bind=False, rounds=2))
    session = RunSession.start(sweep, out=tmp_path, executor="local", make_executor=lambda *a: executor)
    session.measure(lock="off")
    # seconds 16, 32, 16, 0: each round starts with the longest unit, ties in the sweep's order
    assert executor.order == [32, 16, 64, 96] * 2


def test_a_concurrent_executor_without_a_history_keeps_the_shuffle(tmp_path):
    from attnbench.runner.session import RunSession

    executor = _Concurrent()
    sweep = Sweep(impl=("sdpa",), seq_len=(16, 32, 64, 96, 128, 160), settings=Settings(drift=0.0, cpu_bind=False,
                                                                                        rounds=3))
    session = RunSession.start(sweep, out=tmp_path, executor="local", make_executor=lambda *a: executor)
    session.measure(lock="off")
    assert session.learned is None
    rounds = [executor.order[i:i + 6] for i in (0, 6, 12)]
    assert all(sorted(r) == [16, 32, 64, 96, 128, 160] for r in rounds) and len({tuple(r) for r in rounds}) > 1

