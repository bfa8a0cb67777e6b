"""Contention arithmetic on synthetic /proc/stat snapshots, the merge over rounds, and the row columns."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from attnbench.measure import contention
from attnbench.measure.contention import CONTENDED_FRAC, compute, parse_proc_stat
from attnbench.results.schema import Cell


def _stat(user=0, nice=0, system=0, idle=0, iowait=0, irq=0, softirq=0, steal=0, guest=0, cpus=2) -> str:
    """A /proc/stat text; per-CPU lines only count the CPUs (their numbers are not used)."""
    lines = [f"cpu  {user} {nice} {system} {idle} {iowait} {irq} {softirq} {steal} {guest} 0"]
    lines += [f"cpu{i} 1 0 1 1 0 0 0 0 0 0" for i in range(cpus)]
    lines += ["intr 12345 0 0", "ctxt 999", "btime 1700000000", "processes 10", "procs_running 1"]
    return "\n".join(lines) + "\n"


def test_parse_sums_the_fields_and_counts_cpus_without_guest_twice():
    s = parse_proc_stat(_stat(user=100, nice=5, system=20, idle=300, iowait=7, irq=2, softirq=3, steal=11, guest=50, cpus=4))
    assert (s.busy, s.idle, s.steal, s.cpus) == (130, 307, 11, 4)  # guest is inside user already
    assert s.total == 448
    old_kernel = parse_proc_stat("cpu  10 0 5 100\ncpu0 10 0 5 100\n")  # no iowait..steal columns
    assert (old_kernel.busy, old_kernel.idle, old_kernel.steal) == (15, 100, 0)
    with pytest.raises(ValueError):
        parse_proc_stat("intr 1 2 3\n")


def test_quiet_machine_one_second_on_two_cpus():
    # 1 s on 2 CPUs at 100 ticks/s = 200 ticks; this process used 0.98 CPU-s (98 ticks), others 2 ticks
    before = parse_proc_stat(_stat(user=1000, system=100, idle=5000))
    after = parse_proc_stat(_stat(user=1090, system=110, idle=5100))
    c = compute(before, after, own_s=0.98, ticks_per_s=100)
    assert c.other_cpu_frac == pytest.approx(2 / 200)
    assert c.steal_frac == 0.0
    assert c.resolution == pytest.approx(2 * 2 / 200)
    assert c.contended == "no" and c.note == ""


def test_a_hog_on_every_core_is_flagged():
    # 2 CPUs, 1 s: this process got 2/3 of one core's worth (66 ticks), the hogs the remaining 134 busy ticks
    before = parse_proc_stat(_stat(user=0, idle=0))
    after = parse_proc_stat(_stat(user=200, idle=0))
    c = compute(before, after, own_s=0.66, ticks_per_s=100)
    assert c.other_cpu_frac == pytest.approx(134 / 200)
    assert c.contended == "yes" and "other processes took 67%" in c.note


def test_steal_counts_towards_the_flag():
    before = parse_proc_stat(_stat())
    after = parse_proc_stat(_stat(user=100, idle=70, steal=30))  # 30 of 200 ticks went to the hypervisor
    c = compute(before, after, own_s=1.0, ticks_per_s=100)
    assert c.other_cpu_frac == 0.0 and c.steal_frac == pytest.approx(0.15)
    assert c.contended == "yes"


def test_the_threshold_has_a_margin_of_the_resolution():
    # other = 12% of 200 ticks: over 10%, but not by more than the 2% resolution of a 1 s region on 2 CPUs
    before = parse_proc_stat(_stat())
    after = parse_proc_stat(_stat(user=124, idle=76))
    assert compute(before, after, own_s=1.0, ticks_per_s=100).contended == "no"
    after = parse_proc_stat(_stat(user=126, idle=74))  # 13%: over threshold + resolution
    assert compute(before, after, own_s=1.0, ticks_per_s=100).contended == "yes"
    # the same 13% over a region of 20 ticks is within the rounding of the counters
    short = compute(parse_proc_stat(_stat()), parse_proc_stat(_stat(user=13, idle=7)), own_s=0.1, ticks_per_s=100)
    assert short.other_cpu_frac == pytest.approx(0.15) and short.contended == "no"
    assert CONTENDED_FRAC == 0.10


def test_own_time_above_the_counted_busy_time_clamps_at_zero():
    c = compute(parse_proc_stat(_stat()), parse_proc_stat(_stat(user=100, idle=100)), own_s=1.2, ticks_per_s=100)
    assert c.other_cpu_frac == 0.0 and c.contended == "no"


def test_without_proc_stat_the_measure_is_unknown(tmp_path):
    assert contention.read_proc_stat(str(tmp_path / "nope")) is None
    c = compute(None, None, own_s=1.0)
    assert math.isnan(c.other_cpu_frac) and math.isnan(c.steal_frac) and c.contended == "unknown"
    assert "not measured" in c.note
    with contention.sampled(str(tmp_path / "nope")) as s:
        pass
    assert s.result.contended == "unknown"
    assert compute(parse_proc_stat(_stat()), parse_proc_stat(_stat()), 0.0).contended == "unknown"  # no tick passed


def test_sampled_brackets_a_region_on_this_machine():
    with contention.sampled() as s:
        sum(i * i for i in range(200_000))
    if contention.read_proc_stat() is None:
        assert s.result.contended == "unknown"
    else:
        assert s.result.contended in ("yes", "no", "unknown")
        assert s.result.contended == "unknown" or 0.0 <= s.result.other_cpu_frac <= 1.0


def test_merge_over_rounds_takes_the_worst_round():
    rows = [{"other_cpu_frac": 0.02, "steal_frac": 0.0, "contended": "no"},
            {"other_cpu_frac": 0.55, "steal_frac": 0.01, "contended": "yes"},
            {"other_cpu_frac": math.nan, "steal_frac": math.nan, "contended": "unknown"}]
    assert contention.merge(rows) == {"other_cpu_frac": 0.55, "steal_frac": 0.01, "contended": "yes"}
    assert contention.merge_note(rows) == "contended in 1 of 3 rounds"
    assert contention.merge(rows[:1])["contended"] == "no" and contention.merge_note(rows[:1]) == ""
    assert contention.merge(rows[2:])["contended"] == "unknown"


def test_summary_counts_contended_ok_cells():
    df = pd.DataFrame({"status": ["ok", "ok", "ok", "error"], "contended": ["yes", "no", "unknown", "yes"]})
    assert contention.contended_mask(df).tolist() == [True, False, False, False]
    assert contention.summary(df).startswith("1 of 3 timed cell(s) (33%) were contended")
    assert contention.summary(df.assign(contended="no")) is None


def test_older_runs_read_back_with_the_measure_unknown():
    from attnbench.results.schema import fill_added_columns

    old = fill_added_columns(pd.DataFrame({"num_heads": [2], "status": ["ok"]}))
    assert math.isnan(old.other_cpu_frac[0]) and math.isnan(old.steal_frac[0]) and old.contended[0] is None


@pytest.mark.slow
def test_a_measured_cell_row_carries_the_columns():
    from attnbench.runner.cell import run_cell
    from attnbench.runner.sweep import Settings

    row = run_cell(Cell("sdpa", seq_len=16, num_heads=2, d_model=16, mode="inference"),
                   Settings(budget_s=0.02, min_samples=3, warmup_calls=1, warmup_s=0.0, flop_check=False))
    assert row["status"] == "ok" and row["contended"] in ("yes", "no", "unknown")
    assert ("contended:" in row["notes"]) == (row["contended"] == "yes")
    if row["contended"] != "unknown":
        assert 0.0 <= row["other_cpu_frac"] <= 1.0 and 0.0 <= row["steal_frac"] <= 1.0


def test_compare_and_the_report_say_which_cells_were_contended(tmp_path):
    import numpy as np
    from sample_runs import ok_row

    from attnbench.report import analysis
    from attnbench.results.compare import compare_runs
    from attnbench.results.store import RunStore, load_run

    cell = Cell("sdpa", seq_len=64)
    rng = np.random.default_rng(0)
    quiet = ok_row(cell, 1e-3 * np.exp(rng.normal(0, 0.02, 40)), other_cpu_frac=0.01, steal_frac=0.0, contended="no")
    loaded = ok_row(cell, 1.6e-3 * np.exp(rng.normal(0, 0.02, 40)), other_cpu_frac=0.52, steal_frac=0.03,
                    contended="yes")
    paths = []
    for run_id, row in (("a", quiet), ("b", loaded)):
        store = RunStore(tmp_path, run_id=run_id, meta={"command": "test"})
        store.append(row)
        store.finalize()
        store.close()
        paths.append(store.path)
    cells = compare_runs(*paths).cells
    assert cells["contended"].tolist() == ["B: contended (others 52%, steal 3%)"]
    assert cells["change"].iloc[0].startswith("inconclusive: read slower while other load took the CPUs in B (contended)")
    assert cells["inconclusive"].iloc[0] and not cells["regression"].iloc[0]  # 1.6x: within what 52% + 3% explain
    noisy = analysis.noisy(analysis.prepare(load_run(paths[1])[0]))
    assert noisy["contended"].tolist() == ["contended (others 52%, steal 3%)"]
    assert analysis.noisy(analysis.prepare(load_run(paths[0])[0])).empty


def test_the_slowdown_a_load_can_explain():
    """Issue 45: (1 + u) / (1 - u), u the others' and steal's share plus the measure's resolution."""
    assert contention.explainable_slowdown(0.5, 0.0) == pytest.approx(3.0)
    assert contention.explainable_slowdown(0.4, 0.1, region_s=1.0, ticks_per_s=100) == pytest.approx(1.52 / 0.48)
    assert contention.explainable_slowdown(0.0, 0.0) == 1.0
    assert contention.explainable_slowdown(0.95, 0.05) == math.inf
    assert contention.explainable_slowdown(0.5, 0.0, region_s=0.04, ticks_per_s=100) == math.inf  # resolution 0.5
    assert contention.explainable_slowdown(math.nan, 0.0) == math.inf  # not measured: nothing is beyond it


@pytest.mark.parametrize("seed", range(6))
def test_the_bound_holds_for_a_fair_scheduler_under_bursty_load(seed):
    """A simulated machine: n CPUs, one CPU-bound cell thread, others' runnable threads changing every tick (bursts
    of 0 to 12); each runnable thread gets min(1, n / runnable) of a CPU. The median call's slowdown stays within
    the bound of the others' measured share (on one CPU it is 1 / (1 - u), half the way to the bound)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n, ticks, work = int(rng.integers(1, 9)), 20_000, 7.3  # a call: 7.3 ticks of one CPU
    others = rng.integers(0, 13, ticks) * (rng.random(ticks) < rng.uniform(0.1, 0.9))
    runnable = others + 1
    rate = np.minimum(1.0, n / runnable)  # the cell's thread's speed
    taken = np.minimum(others, others * n / runnable)  # CPUs the others ran on
    u = float(taken.sum() / (n * ticks))
    done = np.cumsum(rate)
    ends = np.searchsorted(done, np.arange(1, int(done[-1] / work)) * work)
    slowdowns = np.diff(ends) / work
    assert np.median(slowdowns) <= contention.explainable_slowdown(u, 0.0) + 1 / work
