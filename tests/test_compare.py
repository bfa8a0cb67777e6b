"""``attnbench compare``: matching, the decision rule on real and synthetic samples, the page and the exit code."""

from __future__ import annotations

import base64
import time
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sample_runs import failed_row, ok_row, synthetic_run

from attnbench.cli import main
from attnbench.report.page import ENV_DPI, ENV_FORMATS
from attnbench.results.compare import bootstrap_ratio, compare_runs, speedup_ratio, write_compare_html
from attnbench.results.schema import Cell
from attnbench.results.store import RunStore

META = {"command": "test", "torch_version": "2.5.0", "cpu_model": "test CPU"}


@pytest.fixture(autouse=True, scope="module")
def _small_figures():
    """Compare pages here are read, not looked at: low-resolution PNG only (one test checks the SVG default)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_DPI, "40")
        mp.setenv(ENV_FORMATS, "png")
        yield


def write_run(root: Path, run_id: str, rows: list[dict], meta: dict | None = None) -> Path:
    store = RunStore(root, run_id=run_id, meta={**META, **(meta or {})})
    for r in rows:
        store.append(r)
    store.finalize()
    return store.path


def lognormal(median: float, n: int = 40, sigma: float = 0.05, seed: int = 0) -> np.ndarray:
    return median * np.exp(np.random.default_rng(seed).normal(0.0, sigma, n))


# ---------------------------------------------------------------- real timing samples


def work(n: int) -> int:
    """A tiny pure-Python workload (tens to hundreds of microseconds)."""
    total = 0
    for i in range(n):
        total += i * i
    return total


def slowed_work(n: int) -> int:
    """The same result with the work done twice: a 2x regression."""
    work(n)
    return work(n)


def timed_runs(root: Path, slow: set[str], samples: int = 30) -> tuple[Path, Path]:
    """Two runs of real timings; in B, the implementations in ``slow`` run :func:`slowed_work`.

    A's and B's calls alternate sample by sample, so load on a busy machine hits both runs alike:
    what differs between them is the code, which is what a comparison should detect.
    """
    cells = [Cell(impl=impl, seq_len=t, num_heads=2, d_model=32) for impl in ("steady", "victim") for t in (1000, 3000)]
    sa = {c: [] for c in cells}
    sb = {c: [] for c in cells}
    for c in cells:
        work(c.seq_len)  # warm-up
    for _ in range(samples):
        for c in cells:
            fb = slowed_work if c.impl in slow else work
            t0 = time.perf_counter()
            work(c.seq_len)
            t1 = time.perf_counter()
            fb(c.seq_len)
            t2 = time.perf_counter()
            sa[c].append(t1 - t0)
            sb[c].append(t2 - t1)
    a = write_run(root, "run-a", [ok_row(c, sa[c]) for c in cells])
    b = write_run(root, "run-b" if slow else "rerun", [ok_row(c, sb[c]) for c in cells])
    return a, b


def test_a_deliberately_slowed_implementation_is_flagged(tmp_path):
    a, b = timed_runs(tmp_path, slow={"victim"})
    res = compare_runs(a, b)
    flagged = res.regressions
    assert set(flagged["impl"]) == {"victim"} and len(flagged) == 2, res.cells
    assert flagged["ratio"].between(1.5, 3.0).all()
    assert (flagged["ci_low"] > 1.1).all() and (flagged["p_value"] < 1e-3).all()  # the bootstrap resolves p to 1/2001
    assert res.has_regression
    assert list(res.cells["impl"][:2]) == ["victim", "victim"]  # sorted by effect, slowdowns first
    steady = res.cells[res.cells["impl"] == "steady"]
    assert not steady["regression"].any()


def test_a_rerun_of_the_same_code_is_not_flagged(tmp_path):
    a, b = timed_runs(tmp_path, slow=set())
    res = compare_runs(a, b)
    assert not res.has_regression, res.cells[["impl", "seq_len", "ratio", "ci_low", "ci_high", "p_value"]]
    assert len(res.cells) == 4 and res.only_in_a == [] and res.only_in_b == [] and res.axis_mismatch == {}
    # a loose bound only (a shared 2-vCPU machine drifts 1.4x between two timings of the same loop): what this test
    # asserts is the verdict above, that a rerun is not flagged, not the timer's precision
    assert res.cells["ratio"].between(0.5, 2.0).all()


# ---------------------------------------------------------------- the decision rule on synthetic samples


def _pair(ratio: float, n: int = 40, sigma: float = 0.05, seed: int = 1) -> tuple[pd.DataFrame, pd.DataFrame]:
    cell = Cell(impl="sdpa", seq_len=256)
    da = pd.DataFrame([ok_row(cell, lognormal(1e-3, n, sigma, seed))])
    db = pd.DataFrame([ok_row(cell, lognormal(1e-3 * ratio, n, sigma, seed + 100))])
    return da, db


def test_decision_rule():
    same = compare_runs(*_pair(1.0)).cells.iloc[0]
    assert not same["regression"] and not same["improvement"] and same["change"] == "no significant change"
    assert same["ci_low"] < 1 < same["ci_high"]

    slow = compare_runs(*_pair(1.5)).cells.iloc[0]
    assert slow["regression"] and slow["change"] == "slower" and slow["p_value"] < 1e-3
    assert 1.3 < slow["ci_low"] < slow["ratio"] < slow["ci_high"] < 1.7

    # a real but small slowdown: significant, CI above 1, yet within the 10% threshold
    small = compare_runs(*_pair(1.05, n=400, sigma=0.02)).cells.iloc[0]
    assert small["ci_low"] > 1 and small["p_value"] < 0.05
    assert not small["regression"] and small["change"] == "slower, within threshold"
    assert compare_runs(*_pair(1.05, n=400, sigma=0.02), threshold=0.02).has_regression

    fast = compare_runs(*_pair(0.5)).cells.iloc[0]
    assert fast["improvement"] and not fast["regression"] and fast["change"] == "faster"

    # noisy and few samples: a large ratio is not enough without significance
    noisy = compare_runs(*_pair(1.3, n=5, sigma=0.6, seed=3)).cells.iloc[0]
    assert not noisy["regression"]


def test_bootstrap_is_seeded_and_brackets_the_ratio():
    a, b = lognormal(1.0, 50, 0.1, 1), lognormal(2.0, 50, 0.1, 2)
    assert bootstrap_ratio(a, b, seed=7) == bootstrap_ratio(a, b, seed=7)
    lo, hi = bootstrap_ratio(a, b, seed=7)
    assert lo < np.median(b) / np.median(a) < hi and 1.8 < lo and hi < 2.2
    da, db = _pair(1.2)
    r1, r2 = compare_runs(da, db).cells, compare_runs(da, db).cells
    pd.testing.assert_frame_equal(r1, r2)


def test_cells_without_samples_are_compared_by_median_but_never_flagged():
    da, db = _pair(3.0)
    da.at[0, "samples_s"], db.at[0, "samples_s"] = [], []
    row = compare_runs(da, db).cells.iloc[0]
    assert row["change"] == "untested" and not row["regression"] and row["ratio"] == pytest.approx(3.0, rel=0.1)


def test_unmatched_cells_status_changes_and_axes_are_reported(tmp_path):
    def rows(ts, impls, oom=()):
        out = []
        for impl in impls:
            for t in ts:
                c = Cell(impl=impl, seq_len=t)
                out.append(failed_row(c, "oom", "out of memory") if (impl, t) in oom
                           else ok_row(c, lognormal(1e-4 * t / 64, seed=t)))
        return out

    a = write_run(tmp_path, "a", rows((64, 128), ("weight_split", "sdpa")))
    b = write_run(tmp_path, "b", rows((64, 128, 256), ("weight_split", "flex"), oom={("weight_split", 128)}),
                  meta={"torch_version": "2.6.0"})
    res = compare_runs(a, b)
    assert len(res.cells) == 1  # weight_split T=64
    assert {(c["impl"], c["seq_len"]) for c in res.only_in_a} == {("sdpa", 64), ("sdpa", 128)}
    assert {(c["impl"], c["seq_len"]) for c in res.only_in_b} == {("flex", 64), ("flex", 128), ("flex", 256),
                                                                   ("weight_split", 256)}
    assert res.axis_mismatch == {"impl": {"only_in_a": ["sdpa"], "only_in_b": ["flex"]},
                                 "seq_len": {"only_in_a": [], "only_in_b": [256]}}
    changed = res.status_changed.iloc[0]
    got = (changed["impl"], changed["seq_len"], changed["status_a"], changed["status_b"])
    assert got == ("weight_split", 128, "ok", "oom")
    assert ("torch_version", "2.5.0", "2.6.0") in res.env_diff
    assert "only in A" in res.summary() and "impl, seq_len" in res.summary()


# ---------------------------------------------------------------- the page and the CLI


class _Imgs(HTMLParser):
    def __init__(self, text):
        super().__init__()
        self.imgs, self.tags, self.text = [], [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "img":
            self.imgs.append(dict(attrs))

    def handle_data(self, data):
        self.text.append(data)


def test_cli_exit_codes_console_table_and_page(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(ENV_FORMATS, "png,svg")  # the default output: PNG and SVG
    monkeypatch.setenv(ENV_DPI, "150")
    evil = "evil<script>.py:X"
    cells = [Cell(impl=i, seq_len=t) for i in ("weight_split", evil) for t in (64, 128, 256)]
    a = write_run(tmp_path, "a", [ok_row(c, lognormal(1e-4 * c.seq_len / 64, seed=c.seq_len)) for c in cells])
    b = write_run(tmp_path, "b", [ok_row(c, lognormal(1e-4 * c.seq_len / 64 * (2.0 if c.impl == evil else 1.0),
                                                      seed=c.seq_len + 1)) for c in cells])
    out = tmp_path / "cmp"
    with pytest.raises(SystemExit) as exc:
        main(["compare", str(a), str(b), "-o", str(out)])
    assert exc.value.code == 1
    printed = capsys.readouterr().out
    assert "FAIL" in printed and "evil<script>.py:X" in printed and "slower" in printed

    page = (out / "compare.html").read_text()
    assert "<script" not in page and "evil&lt;script&gt;.py:X" in page
    parsed = _Imgs(page)
    assert "script" not in parsed.tags and len(parsed.imgs) == 1
    png = base64.b64decode(parsed.imgs[0]["src"].split(",", 1)[1])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert (out / "figures" / "latency_overlay.svg").is_file() and (out / "tables" / "compare.csv").is_file()
    text = " ".join("".join(parsed.text).split())
    assert "3 cells are significantly slower in B by more than 10%" in text

    main(["compare", str(a), str(a), "-o", str(tmp_path / "same")])  # returns: exit status 0
    assert "OK: no significant slowdown" in capsys.readouterr().out
    main(["compare", str(a), str(b), "--threshold", "1.5", "-o", str(tmp_path / "loose")])
    assert "OK" in capsys.readouterr().out

    with pytest.raises(SystemExit) as exc:
        main(["compare", str(a), str(tmp_path / "missing")])
    assert exc.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_compare_page_with_nothing_in_common(tmp_path):
    a = write_run(tmp_path, "a", [ok_row(Cell(impl="sdpa", seq_len=64), lognormal(1e-4))])
    b = write_run(tmp_path, "b", [failed_row(Cell(impl="sdpa", seq_len=128), "error", "boom")])
    res = compare_runs(a, b)
    assert res.cells.empty and not res.has_regression
    page = write_compare_html(res, tmp_path / "out").read_text()
    assert "No cell was timed successfully in both runs" in page


# ---------------------------------------------------------------- real runs with a slowed plug-in

PLUGIN = '''
from attnbench.implementations.book import MultiHeadAttention


class Attn(MultiHeadAttention):
    """weight_split, plus EXTRA throw-away forward passes (a deliberate regression when EXTRA > 0)."""

    EXTRA = {extra}

    def forward(self, x):
        out = super().forward(x)
        for _ in range(self.EXTRA):
            out = out + 0.0 * super().forward(x)
        return out
'''


@pytest.mark.slow  # a real process start or two (15-25 s): the slow set
def test_real_runs_flag_a_slowed_plugin(tmp_path, monkeypatch, isolated_registry):
    attnbench = pytest.importorskip("attnbench")
    pytest.importorskip("attnbench.runner.engine")
    runs = {}
    for label, extra in (("before", 0), ("after", 4)):
        src = tmp_path / label
        src.mkdir()
        (src / "plug.py").write_text(PLUGIN.format(extra=extra))
        monkeypatch.chdir(src)  # the same plug-in name, "plug.py:Attn", resolves to this version's file
        isolated_registry._RESOLVED.clear()
        df = attnbench.run(impl=["weight_split", "plug.py:Attn"], seq_len=[64], batch=[1], num_heads=[2],
                           d_model=[32], mode=["forward"], out=tmp_path / "results", run_id=label,
                           settings={"budget_s": 0.15, "threads": 1})
        assert (df["status"] == "ok").all(), df[["impl", "status", "error"]]
        runs[label] = Path(df.attrs["run_dir"])
    res = compare_runs(runs["before"], runs["after"])
    cells = res.cells.set_index("impl")
    slowed = cells.loc["plug.py:Attn"]
    assert slowed["ratio"] > 2
    # flagged, unless a run timed it while other load took the CPUs (another xdist worker): then inconclusive, as on
    # any machine (tests/test_compare.py::test_a_difference_timed_under_other_load_is_inconclusive...)
    assert slowed["regression"] or (slowed["change"].startswith("inconclusive") and slowed["contended"]), slowed
    # weight_split did not change; sequential runs on a busy machine can drift, so only a gross change would count
    assert not compare_runs(runs["before"], runs["after"], threshold=1.0).cells.set_index("impl").loc[
        "weight_split", "regression"]


# ---------------------------------------------------------------- compare --speedups

PAIRED_IMPLS = ("weight_split", "sdpa", "fused_qkv")


def paired_run(root: Path, run_id: str, seed: int, slow: dict[str, float] | None = None) -> Path:
    """A synthetic run with paired speed-ups against sdpa; the machine drifts ±10% from cycle to cycle."""
    return synthetic_run(root, impls=PAIRED_IMPLS, seq_lens=(64, 256), failures=False, noisy=False, paired="sdpa",
                         drift_sigma=0.10, run_id=run_id, seed=seed, slow=slow)


@pytest.fixture(scope="module")
def paired_runs(tmp_path_factory):
    """A run, the same with every time 1.3x (the machine drifted), and the same with fused_qkv 1.3x slower."""
    root = tmp_path_factory.mktemp("paired")
    return (paired_run(root, "a", seed=1), paired_run(root, "drifted", seed=2, slow=dict.fromkeys(PAIRED_IMPLS, 1.3)),
            paired_run(root, "changed", seed=3, slow={"fused_qkv": 1.3}))


def test_speedups_ignore_a_uniform_drift_and_flag_a_real_change(paired_runs):
    a, drifted, changed = paired_runs

    assert compare_runs(a, drifted, run_shift=False).has_regression  # the medians all moved: tested against 1
    shifted = compare_runs(a, drifted)  # against the runs' common shift: the machine's speed, not a regression
    assert not shifted.has_regression and any("alike" in n and "--no-run-shift" in n for n in shifted.notes)
    res = compare_runs(a, drifted, speedups=True)
    assert res.kind == "speedups" and not res.has_regression and not len(res.improvements)
    assert set(res.cells["impl"]) == {"weight_split", "fused_qkv"}  # the baseline's speed-up is 1: not compared
    assert np.allclose(res.cells["ratio"], 1.0, atol=0.03)

    res = compare_runs(a, changed, speedups=True)
    cells = res.cells.set_index(["impl", "seq_len"])
    for t in (64, 256):
        assert cells.loc[("fused_qkv", t), "regression"] and cells.loc[("fused_qkv", t), "change"] == "slower"
        assert cells.loc[("fused_qkv", t), "ci_high"] < 1 / 1.2
        assert not cells.loc[("weight_split", t), "regression"]
    assert res.cells.iloc[0]["impl"] == "fused_qkv"  # largest loss first


def test_speedup_ratio_combines_the_two_cis_on_the_log_scale():
    z = 1.959963984540054
    ratio, lo, hi, p = speedup_ratio((2.0, 2.0 / np.exp(0.03 * z), 2.0 * np.exp(0.03 * z)),
                                     (1.5, 1.5 / np.exp(0.04 * z), 1.5 * np.exp(0.04 * z)))
    assert ratio == pytest.approx(0.75)
    assert np.log(hi / ratio) == pytest.approx(0.05 * z)  # sqrt(0.03² + 0.04²) = 0.05
    assert np.log(ratio / lo) == pytest.approx(0.05 * z)
    assert p < 1e-6
    assert speedup_ratio((2.0, 1.9, 2.1), (2.0, 1.9, 2.1))[3] == pytest.approx(1.0)


def test_speedups_of_a_run_without_paired_columns_are_untested(paired_runs, tmp_path, capsys):
    a, _, changed = paired_runs
    old = synthetic_run(tmp_path, impls=PAIRED_IMPLS, seq_lens=(64, 256), failures=False, run_id="old")
    res = compare_runs(old, a, speedups=True)
    assert not res.has_regression and (res.cells["change"] == "untested").all()
    assert res.cells["note"].str.contains("no paired speed-up with a CI in A").all()
    assert any("without --speedups" in n for n in res.notes)

    out = tmp_path / "page"
    with pytest.raises(SystemExit) as exc:
        main(["compare", str(a), str(changed), "--speedups", "-o", str(out)])
    assert exc.value.code == 1
    printed = capsys.readouterr().out
    assert "FAIL" in printed and "relative to the baselines" in printed and "fused_qkv" in printed
    page = (out / "compare.html").read_text()
    assert "paired speed-up" in page and (out / "tables" / "compare_speedups.csv").is_file()
    assert not (out / "figures" / "latency_overlay.svg").exists()  # PNG only under ATTNBENCH_REPORT_FORMATS=png
    main(["compare", str(a), str(a), "--speedups", "-o", str(tmp_path / "same")])
    assert "OK: no significant slowdown beyond 10% relative to the baselines" in capsys.readouterr().out


def test_identical_pairs_count_what_compare_calls_changed_in_unchanged_code():
    """The evidence tool of issue 39 (item 3): runs compared 1 with 2, 3 with 4, as `attnbench compare` would."""
    from attnbench.tools.identical_pairs import pair_verdicts, summarise_pairs

    same_a, same_b = _pair(1.0)
    slow_a, slow_b = _pair(1.5, seed=7)
    verdicts = pair_verdicts([same_a, same_b, slow_a, slow_b])
    assert list(verdicts["pair"]) == [1, 2] and list(verdicts["false_alarm"]) == [False, True]
    summary = summarise_pairs(verdicts)
    assert summary["pairs"] == 2 and summary["false_alarms"] == 1 and summary["pairs_with_alarm"] == 1
    assert summary["gate_failures"] == 1 and 0.4 < summary["max_ratio_dev"] < 0.6


def _runs(factors: dict[int, float], shift: float = 1.0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Eight cells; run B is the machine ``shift`` times slower on every cell, and ``factors[t]`` more on cell ``t``."""
    cells = [Cell(impl=i, seq_len=t) for i in ("sdpa", "weight_split") for t in (32, 64, 128, 256)]
    da = pd.DataFrame([ok_row(c, lognormal(1e-3, seed=k), drift_rel=0.022) for k, c in enumerate(cells)])
    db = pd.DataFrame([ok_row(c, lognormal(1e-3 * shift * (factors.get(c.seq_len, 1.0) if c.impl == "sdpa" else 1.0),
                                           seed=100 + k), drift_rel=0.022) for k, c in enumerate(cells)])
    return da, db


def test_a_machine_that_got_faster_between_identical_runs_is_not_a_change():
    """Issue 39: two identical runs 11 s apart read `weight_split T=128: 0.837x, p=0.0005, faster`."""
    res = compare_runs(*_runs({}, shift=0.837))
    assert not res.has_regression and not len(res.improvements), res.cells[["impl", "seq_len", "ratio", "change"]]
    assert (res.cells["change"] == "no significant change").all()
    assert any("8 cells moved by -1" in n and "alike" in n for n in res.notes), res.notes  # about -16%, drawn
    assert len(compare_runs(*_runs({}, shift=0.837), run_shift=False).improvements) == 8  # tested against 1


def test_a_cell_that_moved_apart_from_the_shift_is_still_caught_and_disagreeing_cells_have_no_shift():
    res = compare_runs(*_runs({128: 1.6}, shift=0.85))
    assert list(res.regressions["impl"]) == ["sdpa"] and list(res.regressions["seq_len"]) == [128]
    assert res.regressions["ratio"].iloc[0] == pytest.approx(1.6 * 0.85, rel=0.1)  # the ratio shown is B/A itself
    half = compare_runs(*_runs({32: 2.0, 64: 2.0, 128: 2.0, 256: 2.0}))  # half the cells changed: no common shift
    assert len(half.regressions) == 4 and not any("alike" in n for n in half.notes)


def _loaded(df: pd.DataFrame, other: float, steal: float = 0.0) -> pd.DataFrame:
    """``df`` as if timed while other processes took ``other`` of the CPU time (and steal ``steal``)."""
    df = df.copy()
    df["contended"], df["other_cpu_frac"], df["steal_frac"] = "yes", other, steal
    return df


def test_a_slowdown_the_load_can_explain_is_inconclusive_never_a_pass():
    """Issue 45: inconclusive is its own verdict (exit 3), not a pass and not a regression."""
    da, db = _pair(1.5)
    res = compare_runs(da, _loaded(db, 0.6))
    cell = res.cells.iloc[0]
    # u = 0.6 + the resolution of a 40 x 1.5 ms region (2 / (100 x 0.06 s) = 0.33): (1 + u) / (1 - u), about 28x
    assert cell["change"].startswith("inconclusive: read slower while other load took the CPUs in B")
    assert cell["inconclusive"] and not cell["regression"] and 20 < cell["load_bound"] < 40
    assert not res.has_regression and len(res.inconclusive) == 1
    assert "1 cell(s) read slower beyond the threshold while other load took the CPUs" in res.summary()
    assert compare_runs(*_pair(1.5)).has_regression  # the same samples, timed on a quiet machine


def test_a_slowdown_too_large_for_the_measured_load_is_a_regression_whatever_the_load():
    """Issue 45: 321 us -> 4.1 ms, 12.8x, with the other core of two busy read "inconclusive" and exited 0."""
    da, db = _pair(12.8)
    cell = compare_runs(da, _loaded(db, 0.5)).cells.iloc[0]
    # u = 0.5 + 2 / (100 x 40 x 12.8 ms) = 0.539: the load explains at most 1.539 / 0.461 = 3.34x
    assert cell["load_bound"] == pytest.approx(3.34, abs=0.02)
    assert cell["regression"] and not cell["inconclusive"] and cell["ci_low"] > cell["load_bound"]
    assert cell["change"] == "slower, beyond the 3.34x the load in B can explain"
    # the same slowdown under a load that could explain it (others took 90%) stays inconclusive
    assert compare_runs(da, _loaded(db, 0.9)).cells.iloc[0]["inconclusive"]


def test_load_in_a_cannot_make_b_slower_and_a_faster_reading_under_load_is_no_verdict():
    da, db = _pair(1.5)
    slower = compare_runs(_loaded(da, 0.6), db).cells.iloc[0]
    assert slower["regression"] and slower["load_bound"] == 1.0 and slower["change"] == "slower"
    faster = compare_runs(*(_loaded(d, 0.6) for d in _pair(0.6))).cells.iloc[0]  # A's load may have made it
    assert not faster["improvement"] and not faster["inconclusive"] and not faster["regression"]
    assert faster["change"] == "read faster while other load took the CPUs in A and B (contended): no verdict"


def test_identical_runs_both_loaded_are_not_inconclusive():
    """Two runs of the same code, both timed under load: the noise is neither a regression nor inconclusive."""
    verdicts = [compare_runs(*(_loaded(d, 0.5) for d in _pair(1.0, sigma=0.15, seed=seed))).cells.iloc[0]
                for seed in range(10)]
    assert not any(v["regression"] or v["inconclusive"] for v in verdicts), [v["change"] for v in verdicts]


def test_cli_exit_status_3_for_inconclusive_1_beyond_the_load_0_for_identical_loaded_runs(tmp_path, capsys):
    from attnbench.results.compare import EXIT_INCONCLUSIVE

    cell = Cell(impl="sdpa", seq_len=256)
    quiet = ok_row(cell, lognormal(1e-3, seed=1), contended="no", other_cpu_frac=0.02, steal_frac=0.0)
    a = write_run(tmp_path, "a", [quiet])
    codes = {}
    for name, factor, other in (("inconclusive", 1.5, 0.6), ("beyond", 12.8, 0.5), ("same", 1.0, 0.5)):
        row = ok_row(cell, lognormal(1e-3 * factor, seed=2), contended="yes", other_cpu_frac=other, steal_frac=0.0)
        b = write_run(tmp_path, name, [row])
        try:
            main(["compare", str(a), str(b), "-o", str(tmp_path / f"cmp-{name}")])
            code = 0
        except SystemExit as exc:
            code = exc.code
        codes[name] = (code, capsys.readouterr())
    assert EXIT_INCONCLUSIVE == 3 and codes["inconclusive"][0] == 3
    assert "INCONCLUSIVE (exit 3)" in codes["inconclusive"][1].err and "OK" not in codes["inconclusive"][1].out
    assert codes["beyond"][0] == 1 and "FAIL" in codes["beyond"][1].out
    assert codes["same"][0] == 0 and "OK: no significant slowdown" in codes["same"][1].out
