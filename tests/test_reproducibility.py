"""The reproducibility tool's speed-up agreement, its contention generator and what it passes to ``attnbench run``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
from sample_runs import ok_row, paired_columns

from attnbench.results.schema import Cell
from attnbench.tools import load as contention
from attnbench.tools import reproducibility


def paired_frame(speedups: dict[tuple[str, int], tuple[float, float, float]], base_s: float = 1e-4,
                 medians: dict[tuple[str, int], float] | None = None) -> pd.DataFrame:
    """One run: sdpa (the baseline) and the given (impl, T) -> (speed-up, CI low, CI high)."""
    rows = []
    for t in sorted({t for _, t in speedups}):
        base = Cell(impl="sdpa", seq_len=t)
        rows.append(ok_row(base, [base_s] * 5, **paired_columns(base, "sdpa", 1.0)))
    for (impl, t), (s, lo, hi) in speedups.items():
        cell = Cell(impl=impl, seq_len=t)
        median = (medians or {}).get((impl, t), base_s / s)
        rows.append(ok_row(cell, [median] * 5, **paired_columns(cell, "sdpa", s, (lo, hi))))
    return pd.DataFrame(rows)


def test_speedup_agreement_movement_coverage_and_reversals():
    runs = [paired_frame({("a", 64): (1.20, 1.15, 1.25), ("b", 64): (1.05, 1.02, 1.08), ("c", 64): (0.98, 0.95, 1.01)},
                         medians={("a", 64): 0.9e-4}),
            paired_frame({("a", 64): (1.22, 1.17, 1.27), ("b", 64): (0.97, 0.94, 0.995), ("c", 64): (1.0, 0.97, 1.03)},
                         medians={("a", 64): 0.7e-4})]
    cells, summary = reproducibility.speedup_agreement(runs)
    cells = cells.set_index("impl")
    assert set(cells.index) == {"a", "b", "c"}  # the baseline is not a speed-up
    assert cells.loc["a", "max_min"] == pytest.approx(1.22 / 1.20)
    assert cells.loc["a", "max_min_medians"] == pytest.approx(0.9 / 0.7)  # unpaired: baseline median / median
    assert cells.loc["a", "coverage"] == 1.0 and not cells.loc["a", "reversed"]
    # b: faster with a CI above 1 in run 1, slower in run 2: a reversal; neither CI holds the other's estimate
    assert cells.loc["b", "reversed"] and cells.loc["b", "coverage"] == 0.0
    # c: both CIs include 1, so landing on either side of 1 is not a reversal
    assert not cells.loc["c", "reversed"] and not cells.loc["c", "excludes_1"]
    assert summary["reversals"] == 1 and summary["excluding_1"] == 2 and summary["paired_cells"] == 3
    assert summary["speedup_coverage_pct"] == pytest.approx(100 * (1.0 + 0.0 + 1.0) / 3)
    assert summary["speedup_worst_max_min"] == pytest.approx(1.05 / 0.97)
    # a's paired CI (1.15-1.25 around 1.20) against the unpaired one from the two medians' CIs
    assert cells.loc["a", "paired_rel"] == pytest.approx(np.median([0.05 / 1.20, 0.05 / 1.22]))
    assert summary["paired_half_width"] > 0 and np.isfinite(summary["unpaired_half_width"])


def test_speedup_agreement_of_runs_without_paired_speedups_uses_the_medians():
    cells = [Cell(impl=i, seq_len=64) for i in ("sdpa", "a")]
    runs = [pd.DataFrame([ok_row(cells[0], [1e-4] * 5), ok_row(cells[1], [m] * 5)]) for m in (0.5e-4, 0.4e-4)]
    table, summary = reproducibility.speedup_agreement(runs)
    assert summary["paired_cells"] == 0 and np.isnan(summary["speedup_worst_max_min"])
    assert table.set_index("impl").loc["a", "baseline"] == "sdpa"  # sdpa is in the sweep: the default baseline
    assert summary["medians_worst_max_min"] == pytest.approx(2.5 / 2.0)


def test_runs_get_the_baseline_and_the_options_after_the_double_dash(monkeypatch, tmp_path):
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, json.dumps({"run_dir": str(tmp_path)}), "")

    monkeypatch.setattr(reproducibility.subprocess, "run", fake_run)
    own, extra = reproducibility._split_run_args(["--runs", "2", "--", "--target-ci", "0.01", "--cell-timeout", "30"])
    assert own == ["--runs", "2"] and extra == ["--target-ci", "0.01", "--cell-timeout", "30"]
    args = argparse.Namespace(impl="sdpa,weight_split", seq="256", batch="2", heads="4", d_model="256",
                              mode="inference", rounds=3, processes=1, budget=1.0, device="cpu", drift=None,
                              threads=None, baseline="weight_split", run_args=extra)
    reproducibility.run_once(args, "pinned", tmp_path)
    cmd = seen[0]
    assert cmd[cmd.index("--baseline") + 1] == "weight_split"
    assert cmd[-4:] == ["--target-ci", "0.01", "--cell-timeout", "30"]


# ---------------------------------------------------------------- the contention generator


@pytest.mark.parametrize("kind", contention.KINDS)
def test_the_load_stops_by_itself_within_its_bound(kind):
    start = time.monotonic()
    load = contention.Load(kind, seconds=1.0, buffer_mib=8).start()
    try:
        assert load.running
        load.process.wait(timeout=10)  # 1 s of load, start-up and a loaded machine's slack
    finally:
        load.stop()
    elapsed = time.monotonic() - start
    assert load.process.returncode == 0 and 1.0 <= elapsed < 6.0  # ran its second, then stopped by itself


def test_the_load_dies_with_its_parent():
    # a parent that starts a long load and is then killed: the load must not outlive it
    here = os.path.dirname(contention.__file__)  # imported by path: the parent need not import torch either
    script = (f"import sys, time; sys.path.insert(0, {here!r}); from load import Load; "
              "l = Load('cpu', seconds=120).start(); print(l.process.pid, flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def test_the_load_is_stopped_by_the_context_and_pinned_to_the_spare_core():
    with contention.Load("cpu", seconds=60) as load:
        assert load.running
        if load.cpu is not None:
            assert load.cpu == max(os.sched_getaffinity(0))
        assert "busy loop" in load.describe() and "at most 60 s" in load.describe()
    assert not load.running and load.process.returncode in (0, -signal.SIGTERM)
