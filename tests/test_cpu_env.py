"""The controlled CPU measuring environment (measure/cpu_env.py, the worker executor) and honest uncertainty
(hierarchical CI, the unstable flag) as ``attnbench run``, ``compare`` and the reproducibility tool use them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sample_runs import ok_row

import attnbench
from attnbench.measure import cpu_env
from attnbench.measure.stats import find_modes, hierarchical_median_ci, median_ci
from attnbench.results.compare import compare_runs
from attnbench.results.schema import Cell
from attnbench.runner.cell import merge_rounds
from attnbench.runner.executors.local import WorkerProcess
from tests.refusal_text import refusal_text  # a refusal: an error: headline, a few short indented lines

TINY = dict(batch=[1], seq_len=[16], num_heads=[2], d_model=[16], mode=["forward"])
FAST = {"budget_s": 0.05, "warmup_s": 0.0, "min_samples": 3, "flop_check": False}
glibc_linux = pytest.mark.skipif(not cpu_env.is_glibc_linux(), reason="the malloc settings need Linux with glibc")


def lognormal(median: float, n: int, sigma: float = 0.02, seed: int = 0) -> np.ndarray:
    return median * np.exp(np.random.default_rng(seed).normal(0.0, sigma, n))


# ---------------------------------------------------------------- the measuring process


@glibc_linux
@pytest.mark.slow  # issue 45: the README's test command stays under 5 minutes (processes measured)
def test_a_measuring_process_really_runs_with_the_pinned_settings():
    worker = WorkerProcess(cpu_env.process_env(cpu_env.CpuEnv("pinned")), "test")
    try:
        probe = worker.probe()
    finally:
        worker.close()
    assert probe["large_malloc_mmapped"] is False  # a 64 MiB malloc stays on the heap: the threshold is fixed
    assert probe["cpu_allocator"] == "pinned"
    assert {k: probe["env"][k] for k in cpu_env.OMP_BINDING} == cpu_env.OMP_BINDING
    assert probe["cpu_binding"] == "close/cores/active"
    if len(os.sched_getaffinity(0)) > 1:  # OpenMP holds each thread to one core
        assert probe["threads"] > 1 and all("-" not in c and "," not in c for c in probe["thread_cpus"])


@glibc_linux
@pytest.mark.slow  # issue 45: the README's test command stays under 5 minutes (processes measured)
def test_system_allocator_and_no_binding_leave_glibc_and_threads_alone():
    env = cpu_env.process_env(cpu_env.CpuEnv("system", bind=False))
    for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", *cpu_env.OMP_BINDING):
        env.pop(key, None)
    worker = WorkerProcess(env, "test")
    try:
        probe = worker.probe()
    finally:
        worker.close()
    assert probe["large_malloc_mmapped"] is True  # glibc's own 128 KiB threshold in a fresh process
    assert probe["cpu_allocator"] == "system" and probe["cpu_binding"] == cpu_env.UNPINNED
    if len(os.sched_getaffinity(0)) > 1:
        assert any("-" in c or "," in c for c in probe["thread_cpus"])


@pytest.mark.parametrize("allocator", ["jemalloc", "tcmalloc"])
def test_preloaded_allocators_are_mapped_in_the_worker(allocator):
    try:
        env = cpu_env.process_env(cpu_env.CpuEnv(allocator))
    except cpu_env.CpuEnvError as exc:
        pytest.skip(f"{allocator} is not installed here: {exc}")
    worker = WorkerProcess(env, "test")
    try:
        assert worker.probe()["cpu_allocator"] == allocator  # checked in /proc/self/maps, not assumed
    finally:
        worker.close()


@pytest.mark.slow  # issue 45: the README's test command stays under 5 minutes (processes measured)
def test_settings_are_recorded_in_meta_and_rows(tmp_path):
    df = attnbench.run(impl=["sdpa"], out=tmp_path, settings=FAST, **TINY)
    row = df.iloc[0]
    assert row.status == "ok", row.error
    assert row.cpu_binding == "close/cores/active" and row.cpu_affinity
    assert row.cpu_allocator == ("pinned" if cpu_env.is_glibc_linux() else cpu_env.UNPINNED)
    assert row.stability in ("stable", "unstable") and list(row.sample_groups) == [row.n]
    meta = json.loads((Path(df.attrs["run_dir"]) / "meta.json").read_text())
    assert meta["cpu_env"]["allocator"] == "pinned" and meta["cpu_env"]["omp"] == cpu_env.OMP_BINDING
    assert meta["cpu_env"]["processes"] == 1
    assert meta["cpu_env"]["measured"][0]["cpu_allocator"] == row.cpu_allocator
    # no --threads: the controlled environment measures with every usable core but one
    assert row.threads == cpu_env.default_threads() and meta["sweep"]["settings"]["threads"] == row.threads


@pytest.mark.parametrize(("cpus", "threads"), [({0}, 1), ({0, 1}, 1), (set(range(16)), 15)])
def test_default_threads_leave_one_core(monkeypatch, cpus, threads):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cpus, raising=False)
    assert cpu_env.default_threads() == threads


@pytest.mark.slow  # a real process start or two (15-25 s): the slow set
def test_given_threads_and_unbound_runs_keep_their_thread_count(tmp_path):
    given = attnbench.run(impl=["sdpa"], out=tmp_path / "given", settings={**FAST, "threads": 2}, **TINY)
    assert given.iloc[0].threads == 2
    unbound = attnbench.run(impl=["sdpa"], out=tmp_path / "unbound", settings={**FAST, "cpu_bind": False}, **TINY)
    meta = json.loads((Path(unbound.attrs["run_dir"]) / "meta.json").read_text())
    assert meta["sweep"]["settings"]["threads"] is None  # torch's own default, whatever it is here


@pytest.mark.slow  # issue 45: the README's test command stays under 5 minutes (processes measured)
def test_two_processes_are_interleaved_and_grouped(tmp_path):
    df = attnbench.run(impl=["weight_split", "sdpa"], out=tmp_path, settings={**FAST, "processes": 2}, **TINY)
    assert set(df.status) == {"ok"} and len(df) == 2
    for r in df.itertuples():
        assert len(r.sample_groups) == 2 and sum(r.sample_groups) == r.n == len(r.samples_s)
        pids = {w.split()[-1] for w in r.worker.split(", ")}
        assert "process0" in r.worker and "process1" in r.worker and len(pids) == 2
        assert "1 rounds x 2 processes" in r.notes


def test_an_implementation_registered_in_this_process_is_measured_here_and_says_so(tmp_path, isolated_registry):
    base = isolated_registry.get("sdpa")
    isolated_registry.register("only_here", base.factory, description="registered in this process only")
    df = attnbench.run(impl=["only_here"], out=tmp_path, settings=FAST, **TINY)
    row = df.iloc[0]
    assert row.status == "ok", row.error
    assert "measured in the calling process" in row.notes and row.cpu_binding == cpu_env.UNPINNED


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("args, fragment", [
    (["--cpu-allocator", "mimalloc"], "unknown --cpu-allocator 'mimalloc'"),
    (["--processes", "0"], "--processes must be a whole number >= 1"),
])
def test_bad_environment_options_are_one_line_errors(args, fragment, capsys, tmp_path):
    from attnbench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--impl", "sdpa", "--seq", "16", "--out", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and fragment in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # nothing was started


def test_a_missing_allocator_library_names_the_package(capsys, tmp_path, monkeypatch):
    from attnbench.cli import main

    monkeypatch.setattr(cpu_env, "_LIB_DIRS", (str(tmp_path / "nowhere"),))
    monkeypatch.setattr(cpu_env.ctypes.util, "find_library", lambda name: None)
    cpu_env.find_library.cache_clear()
    try:
        with pytest.raises(SystemExit) as exit_info:
            main(["run", "--impl", "sdpa", "--seq", "16", "--out", str(tmp_path), "--cpu-allocator", "tcmalloc"])
    finally:
        cpu_env.find_library.cache_clear()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "apt-get install libtcmalloc-minimal4" in refusal_text(err)


# ---------------------------------------------------------------- honest uncertainty


def test_the_hierarchical_ci_widens_when_round_medians_disagree():
    agree = [lognormal(2.45e-3, 60, seed=s) for s in range(3)]
    disagree = [lognormal(2.45e-3, 60, seed=0), lognormal(2.8e-3, 60, seed=1), lognormal(2.45e-3, 60, seed=2)]
    lo_a, hi_a = hierarchical_median_ci(agree)
    lo_d, hi_d = hierarchical_median_ci(disagree)
    pooled_lo, pooled_hi = median_ci(np.concatenate(disagree))
    assert hi_d - lo_d > 3 * (hi_a - lo_a)
    assert hi_d - lo_d > 3 * (pooled_hi - pooled_lo)  # what treating pooled samples as independent would claim
    assert hi_d > 2.7e-3  # the slow round's level is inside the interval
    merged = merge_rounds([ok_row(Cell("sdpa"), g) for g in disagree])
    assert (merged["ci_low_s"], merged["ci_high_s"]) == pytest.approx(hierarchical_median_ci(
        disagree, seed=merged_seed(merged)), rel=1e-12)


def merged_seed(row: dict) -> int:
    import zlib

    return zlib.crc32(str(row["cell_id"]).encode())


def test_a_bimodal_sample_set_is_flagged_with_both_modes():
    rng = np.random.default_rng(3)
    bimodal = np.concatenate([lognormal(2.43e-3, 120, seed=1), lognormal(4.22e-3, 80, seed=2)])
    rng.shuffle(bimodal)
    modes = find_modes([bimodal])
    assert modes is not None and modes.low_s == pytest.approx(2.43e-3, rel=0.03)
    assert modes.high_s == pytest.approx(4.22e-3, rel=0.03) and modes.frac_low == pytest.approx(0.6, abs=0.05)
    row = merge_rounds([ok_row(Cell("fused_qkv"), bimodal)])
    assert row["status"] == "ok" and row["stability"] == "unstable"
    assert "2.4" in row["notes"] and "4.2" in row["notes"] and row["notes"].startswith("unstable: bimodal")


def test_one_mode_with_noise_or_a_tail_is_stable():
    for sigma in (0.02, 0.1, 0.2):
        assert find_modes([lognormal(1e-3, 300, sigma, seed=4)]) is None
    tail = np.concatenate([lognormal(1e-3, 270, 0.02, seed=5), 1e-3 * (1.5 + np.random.default_rng(6).exponential(1.0, 30))])
    assert find_modes([tail]) is None  # 10% outliers spread out: a tail, not a second mode
    rounds = [lognormal(1e-3, 50, seed=s) for s in range(3)]
    assert find_modes(rounds) is None and merge_rounds([ok_row(Cell("sdpa"), g) for g in rounds])["stability"] == "stable"


def test_rounds_in_two_modes_are_flagged():
    rounds = [lognormal(4.22e-3, 50, seed=1), lognormal(2.43e-3, 50, seed=2), lognormal(2.46e-3, 50, seed=3),
              lognormal(4.72e-3, 50, seed=4)]
    modes = find_modes(rounds)
    assert modes is not None and modes.reason.startswith("round medians disagree")
    assert modes.low_s < 2.6e-3 < 4e-3 < modes.high_s


def _compare_rounds(medians_a: list[float], medians_b: list[float], grouped: bool) -> pd.Series:
    cell = Cell("sdpa", seq_len=256)
    ga = [lognormal(m, 100, seed=i) for i, m in enumerate(medians_a)]
    gb = [lognormal(m, 100, seed=10 + i) for i, m in enumerate(medians_b)]
    if grouped:
        a, b = merge_rounds([ok_row(cell, g) for g in ga]), merge_rounds([ok_row(cell, g) for g in gb])
    else:
        a, b = ok_row(cell, np.concatenate(ga)), ok_row(cell, np.concatenate(gb))
    return compare_runs(pd.DataFrame([a]), pd.DataFrame([b])).cells.iloc[0]


def test_compare_counts_drift_between_rounds_as_uncertainty():
    a, b = [1e-3] * 4, [1.06e-3, 0.98e-3, 1.08e-3, 1.0e-3]  # B's rounds drift; its code did not change
    pooled, grouped = _compare_rounds(a, b, grouped=False), _compare_rounds(a, b, grouped=True)
    assert pooled["p_value"] < 0.01  # samples treated as independent: a "significant" slowdown
    assert grouped["p_value"] > 0.05 and grouped["change"] == "no significant change"
    assert grouped["ci_high"] - grouped["ci_low"] > 2 * (pooled["ci_high"] - pooled["ci_low"])
    assert grouped["unstable"] and "B: unstable: round medians disagree" in grouped["note"]


def test_compare_says_when_a_significant_difference_is_on_an_unstable_cell():
    row = _compare_rounds([1e-3] * 4, [1.08e-3, 1.0e-3, 1.1e-3, 1.02e-3], grouped=True)
    assert row["p_value"] < 0.05 and row["unstable"]
    assert row["change"].endswith("(unstable cell: the difference may be a change of mode)")


def test_reproducibility_agreement_figures():
    from attnbench.tools.reproducibility import agreement

    def run(medians: dict[str, float]) -> pd.DataFrame:
        rows = []
        for impl, m in medians.items():
            r = ok_row(Cell(impl, seq_len=256, mode="inference"), lognormal(m, 40))
            r.update(median_s=m, ci_low_s=0.98 * m, ci_high_s=1.02 * m, ci_rel=0.02, stability="stable")
            rows.append(r)
        return pd.DataFrame(rows)

    cells, summary = agreement([run({"a": 1.0, "b": 2.0}), run({"a": 1.01, "b": 2.4}), run({"a": 1.0, "b": 1.9})])
    by = cells.set_index("impl")
    assert by.loc["a", "max_min"] == pytest.approx(1.01) and by.loc["b", "max_min"] == pytest.approx(2.4 / 1.9)
    assert by.loc["a", "coverage"] == 1.0 and by.loc["b", "coverage"] == 0.0
    assert summary["worst_max_min"] == pytest.approx(2.4 / 1.9) and summary["coverage_pct"] == 50.0
    assert summary["ranking_agreement_pct"] == 100.0 and summary["pairs"] == 1
    _, flipped = agreement([run({"a": 1.0, "b": 1.1}), run({"a": 1.2, "b": 1.1})])
    assert flipped["ranking_agreement_pct"] == 0.0


def test_unstable_cells_are_listed_with_their_modes_in_the_report_and_console(tmp_path):
    from attnbench.cli.run import summary_table
    from attnbench.report import build_report
    from attnbench.results.store import RunStore

    bimodal = np.concatenate([lognormal(2.43e-3, 60, seed=1), lognormal(4.22e-3, 60, seed=2)])
    rows = [merge_rounds([ok_row(Cell("fused_qkv", seq_len=256), bimodal)]),
            merge_rounds([ok_row(Cell("weight_split", seq_len=256), lognormal(2.4e-3, 60, seed=3))])]
    store = RunStore(tmp_path / "results", run_id="unstable", meta={"command": "test"})
    for r in rows:
        store.append(r)
    store.finalize()
    build_report(store.path, out_dir=tmp_path / "report")
    listed = pd.read_csv(tmp_path / "report" / "tables" / "noisy.csv")
    assert listed["cell"].str.startswith("fused_qkv").tolist() == [True]
    assert listed["unstable"].str.startswith("unstable: bimodal samples: modes 2.4").all()
    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(summary_table(pd.DataFrame(rows), "t"))
    lines = console.export_text().splitlines()
    assert any("fused_qkv" in line and "unstable" in line for line in lines)
    assert not any("weight_split" in line and "unstable" in line for line in lines)


def test_the_compare_page_names_unstable_cells(tmp_path):
    from attnbench.results.compare import write_compare_html

    cell = Cell("sdpa", seq_len=256)
    a = merge_rounds([ok_row(cell, lognormal(1e-3, 100, seed=i)) for i in range(2)])
    b = merge_rounds([ok_row(cell, lognormal(m, 100, seed=9 + i)) for i, m in enumerate([1e-3, 1.3e-3])])
    result = compare_runs(pd.DataFrame([a]), pd.DataFrame([b]))
    page = write_compare_html(result, tmp_path).read_text()
    assert "B: unstable: round medians disagree" in page
