"""The between-run term of every CI (measure/drift.py): its arithmetic, its estimate from several runs, where
a run gets it (option, calibration file, default), and that run, compare, the report and the reproducibility
tool all apply it."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from sample_runs import ok_row

import attnbench
from attnbench.errors import SweepError
from attnbench.measure import drift
from attnbench.measure.stats import LOG_SPAN, summarize_groups
from attnbench.results.compare import compare_runs
from attnbench.results.schema import Cell

TINY = dict(batch=[1], seq_len=[16], num_heads=[2], d_model=[16], mode=["forward"])
FAST = {"budget_s": 0.05, "warmup_s": 0.0, "min_samples": 3, "flop_check": False}


def lognormal(median: float, n: int, sigma: float = 0.02, seed: int = 0) -> np.ndarray:
    return median * np.exp(np.random.default_rng(seed).normal(0.0, sigma, n))


# ---------------------------------------------------------------- arithmetic


def test_widen_adds_the_term_in_quadrature_on_the_log_scale():
    assert drift.widen(1.0, 0.9, 1.2, 0.0) == (0.9, 1.2)
    lo, hi = drift.widen(1.0, 0.98, 1.03, 0.02)
    z = drift.z_value(0.95)
    assert math.log(1 / lo) == pytest.approx(math.hypot(math.log(1 / 0.98), z * 0.02))
    assert math.log(hi) == pytest.approx(math.hypot(math.log(1.03), z * 0.02))
    lo, hi = drift.widen(2.0, 2.0, 2.0, 0.01)  # a zero-width CI becomes +-z*rel
    assert math.log(2.0 / lo) == pytest.approx(z * 0.01) and math.log(hi / 2.0) == pytest.approx(z * 0.01)


def test_summarize_groups_keeps_the_within_run_ci_and_widens_the_reported_one():
    groups = [lognormal(1e-3, 50, seed=s) for s in range(3)]
    plain, _ = summarize_groups(groups)
    wide, _ = summarize_groups(groups, drift=0.03)
    assert wide["ci_within_rel"] == pytest.approx(plain["ci_rel"]) and wide["drift_rel"] == 0.03
    assert wide["ci_low_s"] < plain["ci_low_s"] and wide["ci_high_s"] > plain["ci_high_s"]
    assert wide["ci_rel"] > 1.96 * 0.03 * 0.95  # at least the between-run term itself
    assert plain["drift_rel"] == 0.0 and plain["ci_within_rel"] == plain["ci_rel"]


def _runs(per_run_sd: float, within_rel: float, runs: int = 6, cells: int = 300, seed: int = 0) -> list[pd.DataFrame]:
    """Synthetic runs whose log-medians move by N(0, per_run_sd) each run around a per-cell centre."""
    rng = np.random.default_rng(seed)
    centres = rng.uniform(1e-3, 1e-2, cells)
    frames = []
    for _ in range(runs):
        med = centres * np.exp(rng.normal(0, per_run_sd, cells))
        frames.append(pd.DataFrame({"cell_id": [f"c{i}" for i in range(cells)], "status": "ok", "median_s": med,
                                    "ci_rel": within_rel, "ci_within_rel": within_rel}))
    return frames


def test_the_estimate_recovers_the_spread_of_a_rerun_beyond_the_within_run_cis():
    # two runs differ by sqrt(2) * per_run_sd; the within-run CIs here explain none of it (they are tiny)
    est = drift.estimate(_runs(0.03, 1e-6))
    assert est["rel"] == pytest.approx(math.sqrt(2) * 0.03, rel=0.1)
    assert est["cells"] == 300 and est["pairs"] == 300 * 30 and est["covered_within"] < 0.01
    # when the within-run CIs already cover the reruns, nothing is left for the term
    quiet = drift.estimate(_runs(0.0, 0.05))
    assert quiet["rel"] == 0.0 and quiet["covered_within"] == 1.0
    # older runs without ci_within_rel fall back to ci_rel
    legacy = [f.drop(columns="ci_within_rel") for f in _runs(0.03, 1e-6)]
    assert drift.estimate(legacy)["rel"] == pytest.approx(est["rel"])
    with pytest.raises(SweepError, match="at least two runs"):
        drift.estimate(_runs(0.03, 0.01, runs=1))


def test_a_calibrated_term_covers_reruns_as_often_as_it_says():
    """Calibrated on one set of runs, the widened CIs of another set cover a rerun's median about 95% of the time;
    the within-run CIs alone cover far fewer."""
    rel = drift.estimate(_runs(0.03, 0.005, seed=1))["rel"]
    test = _runs(0.03, 0.005, seed=2)
    z = drift.z_value()
    hits_wide, hits_within = [], []
    for a in test:
        for b in test:
            if a is b:
                continue
            d = np.abs(np.log(b.median_s / a.median_s))
            h = np.log1p(a.ci_within_rel)
            hits_within.append(d <= h)
            hits_wide.append(d <= np.sqrt(h ** 2 + (z * rel) ** 2))
    assert np.mean(hits_wide) > 0.9 and np.mean(hits_within) < 0.5


# ---------------------------------------------------------------- where a run's term comes from


def test_resolve_prefers_the_option_then_the_calibration_then_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv(drift.ENV_FILE, str(tmp_path / "drift.json"))
    assert drift.term_for(0.0, "cpu", "pinned") == drift.Drift(0.0, "--drift")
    default = drift.term_for(None, "cpu", "pinned")
    assert default.rel == drift.DEFAULT_CPU and "default" in default.source and "--calibrate" in default.source
    cuda = drift.term_for(None, "cuda", "pinned")
    assert cuda.rel == 0.0 and "uncalibrated on cuda" in cuda.source
    drift.save_calibration(drift.machine_key("cpu", "pinned"), {"rel": 0.011, "runs": 6, "date": "2026-11-30"})
    got = drift.term_for(None, "cpu", "pinned")
    assert got.rel == 0.011 and "calibrated on this machine 2026-11-30 from 6 runs" in got.source
    assert drift.term_for(None, "cpu", "system").rel == drift.DEFAULT_CPU  # calibrated per allocator
    assert drift.term_for(0.05, "cpu", "pinned").rel == 0.05
    (tmp_path / "drift.json").write_text("{not json")
    with pytest.raises(SweepError, match="cannot read the drift calibration"):
        drift.term_for(None, "cpu", "pinned")


@pytest.mark.parametrize("bad", [-0.01, 1.5, float("nan"), "2%", True])
def test_bad_drift_settings_are_errors(bad):
    with pytest.raises(SweepError, match="--drift"):
        drift.check_setting(bad)


@pytest.mark.parametrize("text, fragment", [("abc", "neither auto nor a fraction"), ("150%", "fraction in [0, 1)")])
def test_bad_drift_option_is_a_one_line_error(text, fragment, capsys, tmp_path):
    from attnbench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--impl", "sdpa", "--seq", "16", "--out", str(tmp_path), "--drift", text])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and fragment in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())


def test_a_run_records_and_applies_its_term(tmp_path):
    df = attnbench.run(impl=["sdpa"], out=tmp_path / "a", settings={**FAST, "drift": 0.04}, **TINY)
    meta = json.loads((tmp_path / "a" / df.attrs["run_id"] / "meta.json").read_text())
    d = meta["drift"]["cpu"]
    assert (d["rel"], d["source"], d["calibrated_rel"]) == (0.04, "--drift", 0.04)  # given: never rescaled
    row = df.iloc[0]
    assert row.drift_rel == 0.04 and row.ci_rel > row.ci_within_rel
    assert row.ci_low_s < row.median_s < row.ci_high_s
    assert math.log(row.ci_high_s / row.median_s) >= drift.z_value() * 0.04
    # the default: the documented CPU term, said where it came from; rounds are widened the same way
    df = attnbench.run(impl=["sdpa"], out=tmp_path / "b", settings={**FAST, "rounds": 2}, **TINY)
    meta = json.loads((tmp_path / "b" / df.attrs["run_id"] / "meta.json").read_text())
    d = meta["drift"]["cpu"]
    assert d["calibrated_rel"] == drift.DEFAULT_CPU and d["round_sd"] == drift.DEFAULT_CPU_ROUND_SD
    assert d["rel"] >= drift.DEFAULT_CPU and df.iloc[0].drift_rel == pytest.approx(d["rel"])  # scaled if noisier
    assert df.iloc[0].ci_rel > df.iloc[0].ci_within_rel


def test_the_console_and_the_report_say_which_term_the_cis_include(tmp_path):
    from click.testing import CliRunner

    from attnbench.cli import cli

    result = CliRunner().invoke(cli, ["run", "--impl", "sdpa", "--seq", "16", "--batch", "1", "--heads", "2",
                                      "--d-model", "16", "--mode", "forward", "--budget", "0.05", "--drift", "3%",
                                      "--out", str(tmp_path / "r"), "--report-dir", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    assert "CIs on cpu include a between-run term of ±3.0% (1 SD): --drift" in result.output
    html = (tmp_path / "rep" / "report.html").read_text()
    assert "between-run term in CIs" in html and "cpu: ±3.0% (--drift)" in html


# ---------------------------------------------------------------- compare


def _pair(shift: float, rel: float | None) -> pd.Series:
    cell = Cell("sdpa", seq_len=256, mode="inference")
    extra = {} if rel is None else {"drift_rel": rel}
    a = ok_row(cell, lognormal(1e-3, 400, 0.01, seed=1), **extra)
    b = ok_row(cell, lognormal(1e-3 * shift, 400, 0.01, seed=2), **extra)
    return compare_runs(pd.DataFrame([a]), pd.DataFrame([b]), threshold=0.0).cells.iloc[0]


def test_compare_adds_the_between_run_term_to_the_ratio():
    plain, wide = _pair(1.03, None), _pair(1.03, 0.04)
    assert plain["p_value"] < 0.01 and plain["change"] == "slower"  # 3% on 400 tight samples: "significant"
    assert wide["p_value"] > 0.05 and wide["change"] == "no significant change"  # inside what reruns differ by
    assert (wide["ci_high"] - wide["ci_low"]) > 3 * (plain["ci_high"] - plain["ci_low"])
    assert _pair(1.5, 0.04)["change"] == "slower"  # a real slowdown still is one


def test_reproducibility_reports_coverage_with_and_without_the_term():
    from attnbench.tools.reproducibility import agreement

    def run(m: float) -> pd.DataFrame:
        r = ok_row(Cell("a", seq_len=256, mode="inference"), lognormal(m, 40))
        r.update(median_s=m, ci_within_rel=0.01, drift_rel=0.03, ci_rel=0.06,
                 ci_low_s=m * math.exp(-0.06), ci_high_s=m * math.exp(0.06), stability="stable")
        return pd.DataFrame([r])

    cells, summary = agreement([run(1.0), run(1.04)])
    assert summary["coverage_pct"] == 100.0 and summary["coverage_within_pct"] == 0.0
    assert summary["drift_used"] == 0.03


def test_a_disturbed_round_with_many_samples_does_not_decide_the_median():
    """The sampler keeps sampling a noisy round, so a disturbed round can hold most of the samples: the
    cell's median weighs every round once (seen on the VM: rounds of 10, 12 and 120 samples)."""
    from attnbench.measure.stats import group_median

    quiet = [lognormal(1e-3, 10, 0.01, seed=1), lognormal(1e-3, 12, 0.01, seed=2)]
    disturbed = lognormal(1.25e-3, 120, 0.05, seed=3)
    groups = [*quiet, disturbed]
    pooled = float(np.median(np.concatenate(groups)))
    stats, _ = summarize_groups(groups)
    assert pooled > 1.15e-3  # pooled as they are, the disturbed round wins
    assert stats["median_s"] == group_median(groups) and stats["median_s"] < 1.05e-3
    assert stats["ci_low_s"] <= stats["median_s"] <= stats["ci_high_s"]
    assert stats["ci_high_s"] > 1.1e-3  # the disturbed round still widens the interval
    assert group_median([[1.0, 2.0, 3.0]]) == 2.0 and group_median([[1.0], [3.0]]) == 2.0


# ---------------------------------------------------------------- a run noisier than its calibration


def test_rewiden_swaps_one_term_for_another():
    lo, hi = drift.widen(1.0, 0.97, 1.05, 0.02)
    assert drift.rewiden(1.0, lo, hi, 0.02, 0.05) == pytest.approx(drift.widen(1.0, 0.97, 1.05, 0.05))
    assert drift.rewiden(1.0, 0.97, 1.05, 0.0, 0.0) == pytest.approx((0.97, 1.05))


def test_round_spread_pools_the_rounds_of_every_cell():
    def row(medians, status="ok"):
        samples = [m for m in medians for _ in range(5)]
        return {"samples_s": samples, "sample_groups": [5] * len(medians), "status": status}

    rows = pd.DataFrame([row([1.0, 1.1]), row([2.0, 2.0, 2.0]), row([9.0, 1.0], "error"), row([3.0])])
    expected = math.sqrt((np.var(np.log([1.0, 1.1]), ddof=1) + 0.0) / 2)
    assert drift.round_spread(rows) == pytest.approx(expected)
    assert drift.round_spread(pd.DataFrame([row([3.0])])) is None  # one round: no spread to see


def test_a_noisier_run_scales_the_term_up_never_down():
    base = drift.Drift(0.02, "calibrated", round_sd=0.03)
    assert base.for_run(None) is base and base.for_run(0.01) is base
    scaled = base.for_run(0.06)
    assert scaled.rel == pytest.approx(0.04) and "scaled x2.00" in scaled.source and "6.0%" in scaled.source
    assert drift.Drift(0.02, "--drift").for_run(0.5).rel == 0.02  # an explicit term is used as given


def test_a_run_noisier_than_its_calibration_remakes_its_cis(tmp_path):
    # a calibration far quieter than any real run (round spread 1e-5: 0.001%; once a run had only 0.097% against 1e-3)
    drift.save_calibration(drift.machine_key("cpu", "pinned"), {"rel": 0.01, "runs": 4, "round_sd": 1e-5})
    df = attnbench.run(impl=["sdpa", "weight_split"], out=tmp_path, settings={**FAST, "rounds": 2}, **TINY)
    meta = json.loads((tmp_path / df.attrs["run_id"] / "meta.json").read_text())
    d = meta["drift"]["cpu"]
    assert d["calibrated_rel"] == 0.01 and d["round_spread"] > 0 and d["rel"] > 0.01 and "scaled x" in d["source"]
    for row in df.itertuples():
        assert row.drift_rel == pytest.approx(d["rel"])
        assert row.ci_low_s <= row.median_s <= row.ci_high_s
        # (a loaded machine once scaled the term by 38,389x, to 383: the log half-width is capped, never an OverflowError)
        assert math.log(row.ci_high_s / row.median_s) >= min(drift.z_value() * d["rel"], LOG_SPAN) * 0.999


def test_a_between_run_term_too_large_for_exp_gives_the_widest_interval_not_an_overflow():
    lo, hi = drift.rewiden(7.1e-05, 6.6e-05, 7.6e-05, 0.01, 383.9)
    assert 0 < lo < 7.1e-05 * 1e-300 and hi > 7.1e-05 * 1e300 and math.isfinite(hi)


def test_a_machine_slower_than_when_calibrated_is_said_so(tmp_path):
    ref = drift.Drift(0.02, "calibrated", 0.03, peak_gflops=100.0)
    assert ref.speed_warning(95.0) is None and ref.speed_warning(None) is None
    assert "ran 30% slower than when calibrated (peak GEMM 70 against 100 GFLOP/s)" in ref.speed_warning(70.0)
    assert drift.Drift(0.02, "default").speed_warning(1.0) is None  # no reference, no claim
    # a run on a machine far slower than its calibration (here: a calibration no CPU reaches)
    drift.save_calibration(drift.machine_key("cpu", "pinned"), {"rel": 0.01, "runs": 4, "peak_gflops": 1e9})
    df = attnbench.run(impl=["sdpa"], out=tmp_path, settings=FAST, **TINY)
    meta = json.loads((tmp_path / df.attrs["run_id"] / "meta.json").read_text())
    assert "slower than when calibrated" in meta["drift"]["cpu"]["warning"]
    assert meta["drift"]["cpu"]["peak_gflops"] == 1e9
