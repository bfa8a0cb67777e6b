"""Comparison groups through the runner: one unit per group, shuffled per round, rows stored with paired speed-ups,
and a member that kills its measuring process recorded while the rest of its group is measured again."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import attnbench
from attnbench.runner import engine
from attnbench.runner.executors.local import InProcessExecutor

LATE = str(Path(__file__).parent / "plugins" / "late_faults.py")
FAST = {"budget_s": 0.05, "warmup_s": 0.0, "warmup_calls": 1, "min_samples": 3, "threads": 1}
TINY = dict(batch=[1], seq_len=[16], num_heads=[2], d_model=[16], mode=["inference"])


@pytest.mark.slow  # issue 45: the README's test command stays under 5 minutes (processes measured)
def test_units_are_comparison_groups_shuffled_per_round(tmp_path, monkeypatch):
    seen = []

    class Recording(InProcessExecutor):
        def execute(self, units, on_row, on_start=None):
            units = list(units)
            seen.append([[c.cell_id for c in u.cells] for u in units])
            super().execute(units, on_row, on_start)

    monkeypatch.setattr(engine, "make_executor", lambda kind, settings, run_id, ray_address=None: Recording(settings, run_id))
    df = attnbench.run(impl=["weight_split", "einsum", "sdpa"], out=tmp_path, settings={**FAST, "rounds": 3},
                       **{**TINY, "seq_len": [8, 16, 24, 32]})
    assert len(seen) == 3  # one pass per round
    for units in seen:
        assert len(units) == 4  # one unit per shape, each with the three implementations
        for ids in units:
            assert len(ids) == 3 and len({i.split("|", 1)[1] for i in ids}) == 1
    assert len({tuple(u[0] for u in units) for units in seen}) > 1  # the groups' order changes between rounds
    assert (df.status == "ok").all() and (df.baseline == "sdpa").all()
    assert (df[df.impl == "sdpa"].speedup == 1.0).all()
    others = df[df.impl != "sdpa"]
    assert others.speedup.notna().all() and (others.speedup_ci_low <= others.speedup).all()
    assert (others.speedup <= others.speedup_ci_high).all()
    assert all(len(c) == sum(g) and len(g) == 3 for c, g in zip(df.cycle_s, df.cycle_groups, strict=True))


@pytest.mark.slow  # issue 45: the README's test command stays under 5 minutes (processes measured)
def test_a_member_that_aborts_its_process_is_recorded_and_the_rest_measured_again(tmp_path):
    df = attnbench.run(impl=["weight_split", "einsum", f"{LATE}:AbortsLater"], out=tmp_path, settings=FAST, **TINY)
    rows = df.set_index("impl")
    dead = rows.loc[f"{LATE}:AbortsLater"]
    assert dead.status == "error" and "SIGABRT" in dead.error and math.isnan(dead.median_s)
    for name in ("weight_split", "einsum"):
        assert rows.loc[name, "status"] == "ok", rows.loc[name, "error"]
        assert "measured again without" in rows.loc[name, "notes"] and "AbortsLater" in rows.loc[name, "notes"]
    assert rows.loc["weight_split", "baseline"] == "weight_split" and rows.loc["weight_split", "speedup"] == 1.0
    assert rows.loc["einsum", "speedup"] > 0 and rows.loc["einsum", "speedup_ci_low"] <= rows.loc["einsum", "speedup"]


def test_when_the_baseline_fails_the_rows_keep_their_times_and_say_why(tmp_path):
    df = attnbench.run(impl=["weight_split", "einsum", f"{LATE}:RaisesLater"], out=tmp_path,
                       settings={**FAST, "baseline": f"{LATE}:RaisesLater"}, **TINY)
    rows = df.set_index("impl")
    assert rows.loc[f"{LATE}:RaisesLater", "status"] == "error"
    for name in ("weight_split", "einsum"):
        assert rows.loc[name, "status"] == "ok" and rows.loc[name, "median_s"] > 0
        assert math.isnan(rows.loc[name, "speedup"]) and "no speed-up: the baseline" in rows.loc[name, "notes"]


def test_an_unknown_baseline_is_a_one_line_error(tmp_path):
    with pytest.raises(attnbench.SweepError, match="--baseline 'flash' is not one of the sweep's implementations"):
        attnbench.run(impl=["weight_split", "einsum"], out=tmp_path, settings={**FAST, "baseline": "flash"}, **TINY)
