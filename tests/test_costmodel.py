"""Issue 49: the cost model (time = a·FLOPs + b·bytes + c), its held-out error, the cells it mispredicts, the report's
table and ``attnbench run --predict``."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from sample_runs import ok_row

from attnbench.cli.app import cli
from attnbench.measure import costmodel
from attnbench.measure import predict as pr
from attnbench.report import costmodel as costmodel_view
from attnbench.results.schema import Cell
from attnbench.results.store import RunStore
from attnbench.runner.budget import cell_flops

A, B, C = 2e-11, 5e-10, 3e-5  # s per FLOP, s per byte, s per call


def exact_table(impls=("x", "y"), slow: dict | None = None) -> pd.DataFrame:
    """Rows whose time is exactly A·F + B·bytes + C, FLOPs and bytes varied apart (batch, T and width); ``slow``:
    cell_id -> factor its time is multiplied by (a planted change of regime)."""
    rows = []
    for impl in impls:
        for d in (64, 256):
            for t in (32, 128, 512, 2048):
                for b in (1, 4):
                    flops = 4.0 * b * t * t * d + 8.0 * b * t * d * d
                    nbytes = 4.0 * (2 * b * t * d + 4 * d * d)
                    cell_id = f"{impl}|b{b}|T{t}|d{d}"
                    rows.append({"impl": impl, "device": "cpu", "dtype": "float32", "mode": "inference", "status": "ok",
                                 "cell_id": cell_id, "batch": b, "seq_len": t, "flops": flops, "min_bytes": nbytes,
                                 "median_s": (A * flops + B * nbytes + C) * (slow or {}).get(cell_id, 1.0)})
    return pd.DataFrame(rows)


def test_an_exact_table_is_fitted_exactly_and_held_out_cells_are_predicted():
    a = costmodel.assess(exact_table())
    assert list(a.summary["cells"]) == [16, 16]
    assert a.summary["heldout_median_rel_error"].max() < 1e-6
    assert not a.cells["off"].any() and a.mispredicted.empty
    for key, model in a.models.items():
        assert (model.a, model.b, model.c) == pytest.approx((A, B, C), rel=1e-4), key
    assert np.isfinite(a.cells["predicted_s"]).all()  # every cell predicted by a model that did not see it


def test_held_out_folds_are_dealt_in_size_order_and_deterministic():
    c = costmodel.cells(exact_table(impls=("x",)))
    folds = costmodel.folds_of(c, 5)
    order = c.sort_values(["flops", "nbytes"]).index
    assert list(folds[order]) == [i % 5 for i in range(len(c))]
    assert sorted(np.bincount(folds)) == [3, 3, 3, 3, 4]
    shuffled = c.sample(frac=1, random_state=3)  # the same cells in another order: the same folds
    assert dict(zip(shuffled["cell_id"], costmodel.folds_of(shuffled.reset_index(drop=True), 5), strict=True)) == \
        dict(zip(c["cell_id"], folds, strict=True))


def test_a_planted_change_of_regime_is_listed_as_mispredicted_and_only_there():
    planted = {"x|b4|T2048|d256": 5.0, "x|b4|T2048|d64": 5.0, "x|b1|T128|d256": 5.0}
    a = costmodel.assess(exact_table(slow=planted))
    assert set(a.mispredicted["cell_id"]) == set(planted)
    assert (a.mispredicted["ratio"] > 3).all()  # measured several times slower than the held-out prediction
    x, y = (a.summary.set_index("impl").loc[i] for i in ("x", "y"))
    assert x["mispredicted"] == 3 and y["mispredicted"] == 0 and y["heldout_median_rel_error"] < 1e-6
    assert x["heldout_median_rel_error"] < 0.2  # the robust fit is not dragged by the three


def test_too_few_cells_get_no_held_out_error_and_say_so():
    df = exact_table(impls=("x",)).head(3)
    a = costmodel.assess(df)
    row = a.summary.iloc[0]
    assert row["cells"] == 3 and math.isnan(row["heldout_median_rel_error"]) and row["mispredicted"] == 0
    assert costmodel.TOO_FEW in row["note"] and "at least 5" in row["note"]
    assert a.cells["predicted_s"].isna().all() and a.mispredicted.empty
    display, _, _, _ = costmodel_view.tables(df)
    assert display["held-out median error"].iloc[0] == f"{costmodel.TOO_FEW} (3 cells)"
    assert display["> 2× off"].iloc[0] == "–" and display["worst measured / predicted"].iloc[0] == "–"


def test_modes_are_pooled_when_a_mode_has_too_few_cells():
    one = exact_table(impls=("x",))
    other = one.head(3).assign(mode="forward+backward", cell_id=lambda d: d["cell_id"] + "|fb")
    a = costmodel.assess(pd.concat([one, other], ignore_index=True))
    assert len(a.summary) == 1 and a.summary["mode"].iloc[0] == "forward+backward,inference"
    assert "modes pooled" in a.summary["note"].iloc[0] and a.summary["cells"].iloc[0] == 19


def test_the_report_table_lists_errors_and_mispredicted_cells():
    display, raw, off, off_raw = costmodel_view.tables(exact_table(slow={"x|b4|T2048|d256": 5.0}))
    assert list(display["impl"]) == ["x", "y"] and display["> 2× off"].tolist() == ["1", "0"]
    assert display["held-out median error"].iloc[1] == "0.0%"
    assert len(off) == 1 and "T=2048" in off["cell"].iloc[0] and "slower than predicted" in off.iloc[0, -1]
    assert off_raw["cell_id"].tolist() == ["x|b4|T2048|d256"] and raw["cells"].tolist() == [16, 16]


# ---------------------------------------------------------------- --predict

SEQS = (32, 64, 128, 256, 512)


def call_s(flops: float) -> float:
    return 1e-4 + 2e-10 * flops


def earlier_run(root, run_id: str, machine: dict, unit_s: float = 0.5) -> None:
    """A fabricated finished run of sdpa at :data:`SEQS`: calls of :func:`call_s` of their analytic FLOPs, phases that
    add up to ``unit_s`` a round, two rounds."""
    phases = {"start-up": 3.0, "workers": 1.0, "bookkeeping": 2.5, "report": 4.0}
    meta = {**machine, "timestamp": f"2026-01-01T00:00:{run_id[-1]}0", "phases": phases,
            "sweep": {"settings": {"rounds": 2, "processes": 1, "budget_s": 0.25}}}
    store = RunStore(root, run_id=run_id, meta=meta)
    for t in SEQS:
        cell = Cell(impl="sdpa", seq_len=t, d_model=64, num_heads=4, mode="inference")
        flops = cell_flops(cell)
        store.append(ok_row(cell, [call_s(flops)] * 5, flops=flops, phase_build_s=0.2 * unit_s * 2,
                            phase_timed_s=0.8 * unit_s * 2))
    store.finalize()


def test_predict_estimates_each_cell_and_the_run_from_earlier_runs_on_this_machine(tmp_path):
    earlier_run(tmp_path, "run1", pr.this_machine())
    earlier_run(tmp_path, "run9", {**pr.this_machine(), "hostname": "elsewhere"}, unit_s=100.0)  # another machine
    cells = [Cell(impl="sdpa", seq_len=t, d_model=64, num_heads=4, mode="inference") for t in (32, 128, 1024)]
    est = pr.estimate(cells, {"rounds": 2, "processes": 1, "budget_s": 0.25}, tmp_path)  # 1024: not run before
    assert est.cells["call_from"].tolist() == ["measured", "measured", "model"]
    assert est.cells["call_s"].iloc[2] == pytest.approx(call_s(cell_flops(cells[2])), rel=1e-3)  # extrapolated
    assert est.cells["cell_s"].tolist() == pytest.approx([1.0] * 3, rel=1e-3)  # 0.5 s a round, two rounds
    assert est.total_s == pytest.approx(3 * 1.0 + 3 + 1 + 2.5 / 5 * 3 + 4, rel=1e-3)  # + start-up, workers, bookkeeping, report
    assert [p.split("/")[-1] for p in est.runs] == ["run1"] and not est.notes
    text = "\n".join(pr.lines(est))
    assert "sdpa|cpu|float32|b1|T1024|h4|d64|inference|warm: call ~" in text and "(model)" in text
    assert "predicted wall time: ~" in text and "from 1 earlier run(s) on this machine: run1" in text
    shaky = pr.estimate(cells, {"rounds": 1, "processes": 1, "budget_s": 1.0}, tmp_path)
    assert shaky.cells["cell_s"].tolist() == pytest.approx([0.5] * 3, rel=1e-3)
    assert any("budget_s 0.25 -> 1.0" in n for n in shaky.notes) and any("rounds" in n for n in shaky.notes)


def test_a_cells_wall_time_is_its_duration_else_its_phases():
    rows = pd.DataFrame({"duration_s": [2.0, math.nan], "phase_build_s": [0.5, 0.5], "phase_timed_s": [1.0, 1.25]})
    assert pr.cell_seconds(rows).tolist() == [2.0, 1.75]


@pytest.mark.slow
def test_run_predict_prints_an_estimate_and_measures_nothing(tmp_path):
    earlier_run(tmp_path, "run1", pr.this_machine())
    args = ["run", "--impl", "sdpa", "--seq", "32,1024", "--batch", "1", "--heads", "4", "--d-model", "64", "--mode",
            "inference", "--rounds", "2", "--budget", "0.25", "--out", str(tmp_path), "--predict"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "T32|h4|d64|inference|warm: call ~" in result.output and "(measured)" in result.output
    assert "predicted wall time: ~" in result.output and "(model)" in result.output
    said = json.loads(CliRunner().invoke(cli, [*args, "--json"]).output.strip().splitlines()[-1])
    assert said["predicted_s"] == pytest.approx(2 * 1.0 + 3 + 1 + 2.5 / 5 * 2 + 4, rel=1e-3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run1"]  # no run folder made: nothing measured


def test_predict_says_plainly_when_there_is_no_earlier_run(tmp_path):
    result = CliRunner().invoke(cli, ["run", "--impl", "sdpa", "--seq", "32", "--out", str(tmp_path / "none"),
                                      "--predict", "--json"])
    assert result.exit_code == 0, result.output
    said = json.loads(result.output.strip().splitlines()[-1])
    assert said["predicted_s"] is None and "no earlier run on this machine" in said["reason"]


@pytest.mark.slow
def test_the_report_has_the_cost_model_section_and_its_tables(tmp_path):
    from sample_runs import synthetic_run

    from attnbench.report import build_report

    run = synthetic_run(tmp_path / "runs", impls=("sdpa", "weight_split"), seq_lens=(32, 64, 128, 256, 512),
                        failures=False, noisy=False, run_id="cm")
    html = build_report(run, out_dir=tmp_path / "report", formats="png", dpi=40).read_text()
    assert 'id="costmodel"' in html and 'href="#costmodel"' in html and "held-out median error" in html
    table = pd.read_csv(tmp_path / "report" / "tables" / "costmodel.csv")
    assert sorted(table["impl"]) == ["sdpa", "weight_split"] and (table["cells"] == 5).all()
    assert (table["heldout_median_rel_error"] < 0.5).all()  # T² and T terms: the model fits the synthetic times
    assert (tmp_path / "report" / "tables" / "mispredicted.csv").is_file()
