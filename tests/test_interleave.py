"""Comparison groups: interleaved bursts, paired speed-ups, a group's rows with failing members, merging rounds."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import time
from pathlib import Path

import numpy as np
import pytest
from sample_runs import failed_row, ok_row

from attnbench.errors import SweepError
from attnbench.measure.interleave import time_interleaved
from attnbench.measure.memory import MemoryResult
from attnbench.measure.stats import bootstrap_medians, paired_speedup
from attnbench.results.schema import COLUMNS, Cell, fill_added_columns
from attnbench.runner.cell import add_speedups, merge_rounds, run_cell
from attnbench.runner.group import run_group
from attnbench.runner.sweep import Settings, Sweep, default_baseline, sweep_from_dict

PLUGINS = Path(__file__).parent / "plugins"
TINY = dict(batch=1, seq_len=16, num_heads=2, d_model=16, mode="forward")
FAST = Settings(budget_s=0.05, warmup_s=0.0, min_samples=3, flop_check=False, threads=1)


def counting(log: list[str], name: str, fail_at: int | None = None):
    """A member that logs each call (and raises on call ``fail_at``)."""
    calls = {"n": 0}

    def fn() -> None:
        calls["n"] += 1
        if fail_at is not None and calls["n"] >= fail_at:
            raise RuntimeError(f"{name} broke")
        log.append(name)

    return fn


# ---------------------------------------------------------------- time_interleaved


def test_bursts_alternate_in_a_shuffled_order_and_the_recorded_order_shows_it():
    log: list[str] = []
    bursts: list[str] = []
    fns = {n: counting(log, n) for n in "abc"}
    t = time_interleaved(fns, warmup_calls=2, warmup_s=0.0, min_cycles=12, max_cycles=12, budget_s=60,
                         burst_s=1e-3, min_block_s=0.0, seed=3, baseline="a", on_burst=bursts.append, target_rel_ci=0.0)
    assert t.cycles == 12 and t.stopped_by == "max_cycles" and not t.failures
    assert all(sorted(order) == ["a", "b", "c"] for order in t.orders)  # every cycle runs each member once
    assert len(set(t.orders)) > 1  # and the order is shuffled from cycle to cycle
    # on_burst saw each member's warm-up, then exactly the recorded bursts
    assert bursts[:3] == ["a", "b", "c"] and bursts[3:] == [n for order in t.orders for n in order]
    # the calls themselves ran in those bursts: runs of one member's calls, in the recorded order
    timed = log[sum(t.warmup_calls.values()):]
    runs = [name for i, name in enumerate(timed) if i == 0 or timed[i - 1] != name]
    assert runs == _merged_neighbours(bursts[3:])
    for name in "abc":
        assert len(t.cycle_s[name]) == 12 and all(c > 0 for c in t.cycle_s[name])
        assert len(t.samples_s[name]) == 12 * t.calls_per_burst[name] // t.calls_per_sample[name]
        assert timed.count(name) == 12 * t.calls_per_burst[name]


def _merged_neighbours(bursts: list[str]) -> list[str]:
    """The bursts with consecutive ones of the same member (the end of one cycle, the start of the next) as one."""
    return [n for i, n in enumerate(bursts) if i == 0 or bursts[i - 1] != n]


def test_the_same_seed_gives_the_same_order_and_another_seed_another():
    def orders(seed):
        fns = {n: counting([], n) for n in "abcd"}
        return time_interleaved(fns, warmup_calls=1, warmup_s=0.0, min_cycles=8, max_cycles=8, burst_s=1e-4,
                                min_block_s=0.0, seed=seed, target_rel_ci=0.0).orders

    assert orders(1) == orders(1) != orders(2)


def test_a_member_that_raises_is_dropped_and_the_others_carry_on():
    fns = {"a": counting([], "a"), "b": counting([], "b", fail_at=30), "c": counting([], "c")}
    t = time_interleaved(fns, warmup_calls=2, warmup_s=0.0, min_cycles=10, max_cycles=10, burst_s=1e-3,
                         min_block_s=0.0, baseline="a", target_rel_ci=0.0)
    assert set(t.failures) == {"b"} and "b broke" in str(t.failures["b"])
    assert t.cycles == 10 and all(np.isfinite(t.cycle_s[n]).all() for n in "ac")
    b = np.asarray(t.cycle_s["b"])
    assert np.isnan(b[-1]) and np.isnan(b).sum() >= 1  # NaN from the cycle it failed in on
    later = [order for order in t.orders if "b" not in order]
    assert later and all(sorted(order) == ["a", "c"] for order in later)


def test_a_guard_that_raises_drops_that_member():
    """``guard`` is the per-member deadline of run_group: a member whose burst overruns is out, the rest go on."""
    bursts = {"n": 0}

    @contextlib.contextmanager
    def guard(name):
        if name == "slow":
            bursts["n"] += 1
            if bursts["n"] == 4:  # its warm-up and two bursts, then the deadline fires in the third
                raise TimeoutError("slow exceeded its timeout")
        yield

    fns = {"fast": counting([], "fast"), "slow": counting([], "slow")}
    t = time_interleaved(fns, warmup_calls=1, warmup_s=0.0, min_cycles=6, max_cycles=6, burst_s=1e-4,
                         min_block_s=0.0, guard=guard, target_rel_ci=0.0)
    assert isinstance(t.failures["slow"], TimeoutError)
    assert np.isfinite(t.cycle_s["slow"][:2]).all() and np.isnan(t.cycle_s["slow"][2:]).all()
    assert np.isfinite(t.cycle_s["fast"]).all()


def test_sampling_stops_on_the_ci_when_the_members_are_steady(synthetic_bursts):
    # steady members: bursts report fixed per-call times (real 1-ms bursts of a no-op can be 20x apart on a loaded
    # machine, and then even a ±1000% target is not met at 6 cycles)
    fns = {"a": lambda: 2e-3, "b": lambda: 1e-3}
    t = time_interleaved(fns, warmup_calls=1, warmup_s=0.0, min_cycles=6, max_cycles=10_000, budget_s=30,
                         burst_s=1e-3, min_samples=1, baseline="a", target_rel_ci=10.0)
    assert t.stopped_by == "ci" and t.cycles == 6


# ---------------------------------------------------------------- paired speed-ups


def test_paired_ci_is_narrow_under_shared_drift_while_the_unpaired_ratio_is_wide():
    rng = np.random.default_rng(7)
    base_groups, member_groups = [], []
    for level in (1.0, 1.25, 0.85):  # three rounds at different machine speeds ...
        drift = level * np.exp(np.cumsum(rng.normal(0, 0.04, 40)))  # ... drifting within each round
        base_groups.append(2e-3 * drift * np.exp(rng.normal(0, 0.01, 40)))
        member_groups.append(1e-3 * drift * np.exp(rng.normal(0, 0.01, 40)))  # truly 2x faster
    s, lo, hi = paired_speedup(base_groups, member_groups)
    assert lo <= 2.0 <= hi and abs(s - 2.0) < 0.02
    # unpaired: each side's medians bootstrapped on their own (as two separately timed cells are), then the ratio
    ratio = bootstrap_medians(base_groups, rng=1) / bootstrap_medians(member_groups, rng=2)
    ulo, uhi = np.quantile(ratio, [0.025, 0.975])
    assert (hi - lo) / s < 0.03
    assert (uhi - ulo) / s > 5 * (hi - lo) / s


def test_paired_speedup_drops_missing_cycles_pairwise_and_rejects_misaligned_groups():
    base = [[2.0, 2.0, math.nan, 2.0, 2.0, 2.0, 2.0], [4.0, 4.0, 4.0, 4.0, 4.0, 4.0]]
    member = [[1.0, math.nan, 5.0, 1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]]
    assert paired_speedup(base, member) == pytest.approx((2.0, 2.0, 2.0))
    assert all(math.isnan(v) for v in paired_speedup([[1.0, math.nan]], [[math.nan, 1.0]]))
    with pytest.raises(ValueError):
        paired_speedup([[1.0, 2.0]], [[1.0]])


# ---------------------------------------------------------------- rows: merging rounds, add_speedups


def group_row(impl: str, cycles: list[float], seed: int = 0) -> dict:
    """An ok row of one round whose samples sit around its cycle times."""
    rng = np.random.default_rng(seed)
    row = ok_row(Cell(impl, **TINY), np.median(cycles) * np.exp(rng.normal(0, 0.01, 30)), peak_gflops_per_s=100.0)
    row.update(cycle_s=list(cycles), cycle_groups=[len(cycles)], duration_s=1.0, recompiles=math.nan)
    return row


def test_merging_rounds_concatenates_cycles_and_add_speedups_pairs_them_within_each_round():
    rng = np.random.default_rng(0)
    rounds = {"sdpa": [], "weight_split": [], "fused_qkv": []}
    for level in (1.0, 1.4):  # the second round on a slower machine: the ratios are unmoved
        drift = level * np.exp(rng.normal(0, 0.05, 12))
        for impl, factor in (("sdpa", 1.0), ("weight_split", 1.5), ("fused_qkv", 1.2)):
            rounds[impl].append(group_row(impl, list(1e-3 * factor * drift), seed=len(rounds[impl])))
    merged = [merge_rounds(rows) for rows in rounds.values()]
    for row in merged:
        assert len(row["cycle_s"]) == 24 and row["cycle_groups"] == [12, 12]
        assert math.isnan(row["speedup"])  # one round's speed-up is not the run's
    out = {r["impl"]: r for r in add_speedups(merged, "sdpa")}
    assert out["sdpa"]["speedup"] == 1.0 and out["sdpa"]["baseline"] == "sdpa"
    assert out["weight_split"]["speedup"] == pytest.approx(1 / 1.5)
    assert out["fused_qkv"]["speedup"] == pytest.approx(1 / 1.2)
    for r in out.values():
        assert r["speedup_ci_low"] <= r["speedup"] <= r["speedup_ci_high"]


def test_speedups_of_a_failed_baseline_are_empty_and_say_why():
    rows = [failed_row(Cell("sdpa", **TINY), "error", "RuntimeError: boom"),
            group_row("weight_split", [2e-3] * 8)]
    out = add_speedups(rows, "sdpa")
    assert math.isnan(out[1]["speedup"]) and math.isnan(out[1]["speedup_ci_low"])
    assert "no speed-up: the baseline sdpa failed (error: RuntimeError: boom)" in out[1]["notes"]
    assert all(r["baseline"] == "sdpa" for r in out)


def test_an_unstable_member_keeps_its_flag_and_its_speedup_says_so():
    base, member = group_row("sdpa", [1e-3] * 8), group_row("weight_split", [2e-3] * 8)
    member["stability"] = "unstable"
    out = add_speedups([base, member], "sdpa")[1]
    assert out["stability"] == "unstable" and out["speedup"] == pytest.approx(0.5)
    assert "speed-up of unstable timings (this implementation has two modes)" in out["notes"]


def test_misaligned_cycles_are_not_paired():
    base, member = group_row("sdpa", [1e-3] * 8), group_row("weight_split", [2e-3] * 6)
    out = add_speedups([base, member], "sdpa")[1]
    assert math.isnan(out["speedup"]) and "do not line up" in out["notes"]


# ---------------------------------------------------------------- run_group


@pytest.fixture(scope="module")
def memory_pass_ready():
    """The profiler behind the CPU memory pass started once, before any member's clock: its first start in a
    process takes seconds on a loaded machine (a measuring worker pays it before its first cell too)."""
    import torch

    from attnbench.measure import peak_memory

    peak_memory(lambda: torch.ones(8), torch.device("cpu"))


@pytest.mark.parametrize("fault, status, words", [
    ("late_faults.py:RaisesLater", "error", "deliberate failure while timed"),
    ("faulty.py:ReturnsNaN", "invalid", "non-finite"),
    ("late_faults.py:HangsLater", "timeout", "timeout"),
])
def test_a_failing_member_is_its_own_row_and_the_others_get_speedups(fault, status, words, memory_pass_ready):
    cells = [Cell("sdpa", **TINY), Cell(f"{PLUGINS / fault}", **TINY), Cell("weight_split", **TINY)]
    seen: list[str] = []
    # a budget of 0.3 s a member: enough cycles for the faulty member to reach its 40th call even on a loaded machine
    # (at 0.05 s, CI once stopped after 3 cycles, before it failed)
    settings = dataclasses.replace(FAST, cell_timeout_s=2.0, budget_s=0.3)
    rows = run_group(cells, settings, "run", baseline="sdpa", on_member=seen.append, peak_gflops_per_s=100.0)
    assert [r["cell_id"] for r in rows] == [c.cell_id for c in cells]
    assert [r["status"] for r in rows] == ["ok", status, "ok"], [r["error"] for r in rows]
    assert words in rows[1]["error"]
    assert math.isnan(rows[1]["median_s"]) and rows[1]["n"] == 0 and rows[1]["cycle_s"] == []
    assert math.isnan(rows[1]["speedup"])
    assert rows[0]["speedup"] == 1.0
    ws = rows[2]
    assert ws["speedup_ci_low"] <= ws["speedup"] <= ws["speedup_ci_high"] and ws["speedup"] > 0
    assert len(ws["cycle_s"]) == len(rows[0]["cycle_s"]) == ws["cycle_groups"][0] >= 3
    assert ws["n"] == len(ws["samples_s"]) > 0 and ws["peak_bytes"] > 0 and ws["gflops_per_s"] > 0
    assert {r["group_id"] for r in rows} == {cells[0].group_id} and {r["baseline"] for r in rows} == {"sdpa"}
    assert set(seen) == {c.cell_id for c in cells} and seen[0] == cells[0].cell_id
    assert set(rows[0]) == set(COLUMNS)


def test_a_failing_baseline_leaves_the_speedups_empty_and_says_why():
    raises = f"{PLUGINS / 'faulty.py'}:Raises"
    cells = [Cell(raises, **TINY), Cell("weight_split", **TINY), Cell("fused_qkv", **TINY)]
    rows = run_group(cells, FAST, "run", baseline=raises, peak_gflops_per_s=100.0)
    assert [r["status"] for r in rows] == ["error", "ok", "ok"]
    for r in rows[1:]:
        assert math.isnan(r["speedup"]) and math.isnan(r["speedup_ci_high"])
        assert f"no speed-up: the baseline {raises} failed (error: RuntimeError: deliberate failure" in r["notes"]
        assert len(r["cycle_s"]) >= 3  # still timed in alternation: the speed-up can be made later


def test_a_group_of_one_is_a_cell_with_the_new_columns():
    (row,) = run_group([Cell("weight_split", **TINY)], FAST, "run", baseline="weight_split", peak_gflops_per_s=100.0)
    assert row["status"] == "ok" and row["n"] == len(row["samples_s"]) >= 3 and row["timer"] == "perf_counter_ns"
    assert row["speedup"] == 1.0 and row["cycle_groups"] == [len(row["cycle_s"])]
    (other,) = run_group([Cell("weight_split", **TINY)], FAST, "run", baseline="sdpa", peak_gflops_per_s=100.0)
    assert math.isnan(other["speedup"]) and "the baseline sdpa is not in this group" in other["notes"]


# ---------------------------------------------------------------- settings and schema


def test_the_baseline_defaults_to_sdpa_and_is_a_toml_key():
    assert default_baseline(["weight_split", "sdpa"]) == "sdpa"
    assert default_baseline(["weight_split", "fused_qkv"]) == "weight_split"
    assert Sweep(impl=("weight_split", "sdpa")).baseline == "sdpa"
    sweep = sweep_from_dict({"sweep": {"impl": ["weight_split", "fused_qkv"]}, "measure": {"baseline": "fused_qkv"}})
    assert sweep.settings.baseline == "fused_qkv" and sweep.baseline == "fused_qkv"
    with pytest.raises(SweepError, match="--baseline 'einsum' is not one of the sweep's implementations"):
        Sweep(impl=("weight_split",), settings=Settings(baseline="einsum"))


def test_group_id_is_the_cell_id_without_the_implementation_and_older_runs_get_it():
    a, b = Cell("sdpa", seq_len=64, window=8), Cell("weight_split", seq_len=64, window=8)
    assert a.group_id == b.group_id != Cell("sdpa", seq_len=128).group_id
    assert a.cell_id == f"sdpa|{a.group_id}"
    import pandas as pd

    old = fill_added_columns(pd.DataFrame({"cell_id": [a.cell_id], "num_heads": [4]}))
    assert old.group_id[0] == a.group_id and math.isnan(old.speedup[0]) and list(old.cycle_s[0]) == []


def test_a_member_known_well_enough_leaves_the_cycles_while_the_baseline_stays(synthetic_bursts):
    # bursts report the members' per-call times (real sleeps jitter by more than the target on a loaded machine)
    rng = random.Random(0)

    def steady():
        return 5e-4

    burst = {"sleep": 2e-4}

    def draw(name: str) -> None:
        if name == "c":
            burst["sleep"] = rng.choice([2e-4, 4e-3])

    def erratic():  # two very different call times, drawn per burst: its speed-up stays unknown within 10%
        return burst["sleep"]

    t = time_interleaved({"a": steady, "b": steady, "c": erratic}, warmup_calls=1, warmup_s=0.0, min_samples=3,
                         min_cycles=6, max_cycles=40, budget_s=60, burst_s=2e-3, min_block_s=0.0, baseline="a",
                         target_rel_ci=0.1, on_burst=draw)
    assert all(sorted(order) == ["a", "b", "c"] for order in t.orders[:6])  # everyone until min_cycles
    assert any("b" not in order for order in t.orders[6:])  # b, known well enough, left the cycles
    assert all("a" in order and "c" in order for order in t.orders)  # the baseline stays while c is timed
    assert t.stopped_by in ("max_cycles", "ci") and not t.failures
    gone = next(i for i, order in enumerate(t.orders) if "b" not in order)
    assert all(math.isnan(v) for v in t.cycle_s["b"][gone:])  # its later cycles are empty, paired pairwise
    assert t.speedup("b")[0] > 0


# ---------------------------------------------------------------- long calls (issue 39, item 5)

def _sleeper(seconds_of_call):
    def call():
        time.sleep(0.02)  # the warm-up times real calls; the synthetic bursts report the returned figure
        return seconds_of_call()
    return call


def test_a_long_call_is_warmed_once_and_leaves_when_two_calls_agree(synthetic_bursts, monkeypatch):
    from attnbench.measure import long_call

    monkeypatch.setattr(long_call, "LONG_CALL_S", 0.015)
    monkeypatch.setattr(long_call, "LONG_CALL_AGREE", 0.9)  # the warm-up's real sleep wanders on a loaded machine
    fns = {"short": lambda: 1e-3, "long": _sleeper(lambda: 0.0201)}
    t = time_interleaved(fns, warmup_calls=3, warmup_s=0.0, min_cycles=6, max_cycles=40, budget_s=60,
                         burst_s=1e-3, min_block_s=0.0, min_samples=1, baseline="short", target_rel_ci=10.0)
    assert t.warmup_calls["long"] == 1 and t.warmup_calls["short"] == 3
    assert t.member_stopped_by["long"] == "long_call" and t.member_cycles["long"] == 1
    assert t.member_stopped_by["short"] == "target" and t.cycles == 6  # the short member keeps the usual rule


def test_long_calls_that_disagree_stop_after_two_timed_calls_all_the_same(synthetic_bursts, monkeypatch):
    from attnbench.measure import long_call

    monkeypatch.setattr(long_call, "LONG_CALL_S", 0.015)
    calls = iter([0.040, 0.020, 0.0202, 0.0202])  # 2x off the first call's 0.02 s, then 2x off that: stop there
    t = time_interleaved({"long": lambda: next(calls)}, warmup_calls=3, warmup_s=0.0, min_cycles=6,
                         max_cycles=40, budget_s=60, burst_s=1e-3, min_block_s=0.0, target_rel_ci=0.0,
                         warmed={"long": 0.0200})
    assert t.stopped_by == "long_call" and t.cycles == long_call.LONG_CALL_TIMED == 2
    assert t.samples_s["long"] == (0.040, 0.020)
    note = long_call.note(0.0200, t.samples_s["long"])
    assert "2 timed call(s), the last 100.0% from the timed call before it" in note and "all the same" in note
    assert "within 1.0% of" not in long_call.note(0.0200, [0.0202]) and "known" in long_call.note(0.0200, [0.0202])


def test_a_long_baseline_runs_once_per_cycle_even_with_adjacent_pairs(synthetic_bursts, monkeypatch):
    from attnbench.measure import long_call

    monkeypatch.setattr(long_call, "LONG_CALL_S", 0.015)
    t = time_interleaved({"base": lambda: 0.020, "m": lambda: 0.0201}, warmup_calls=1, warmup_s=0.0, min_cycles=6,
                         max_cycles=40, budget_s=60, burst_s=1e-3, min_block_s=0.0, baseline="base",
                         pairing="adjacent", warmed={"base": 0.020, "m": 0.020})
    assert [sorted(o) for o in t.orders] == [["base", "m"]]  # not base, m, base: one call each
    assert t.stopped_by == "long_call" and t.samples_s["base"] == (0.020,)
    assert t.pair_base_s["m"] == (0.020,)  # still paired with the baseline's burst next to it


def test_a_member_whose_first_call_was_long_gets_no_more_warm_up(synthetic_bursts, monkeypatch):
    from attnbench.measure import long_call

    monkeypatch.setattr(long_call, "LONG_CALL_S", 0.015)
    calls = []
    t = time_interleaved({"long": lambda: calls.append(1) or 0.0202}, warmup_calls=3, warmup_s=0.0, min_cycles=6,
                         max_cycles=40, budget_s=60, burst_s=1e-3, min_block_s=0.0, warmed={"long": 0.0200})
    assert t.warmup_calls["long"] == 0 and len(calls) == 1  # the one timed call, agreeing with the first within 5%
    assert t.stopped_by == "long_call"


def test_a_group_row_says_its_long_call_stopped_it(monkeypatch):
    from attnbench.measure import long_call

    monkeypatch.setattr(long_call, "LONG_CALL_S", 0.04)
    monkeypatch.setattr(long_call, "LONG_CALL_AGREE", 0.5)  # a sleep's call time wanders more on a loaded machine
    cells = [Cell("sdpa", **TINY), Cell(f"{PLUGINS / 'long_call.py'}:SleepsPerCall", **TINY)]
    rows = run_group(cells, dataclasses.replace(FAST, warmup_calls=3), "run", baseline="sdpa",
                     peak_gflops_per_s=100.0)
    long = rows[1]
    assert long["status"] == "ok" and long["stopped_by"] == "long_call", (long["stopped_by"], long["error"])
    assert long["warmup_calls"] == 1 and long["n"] in (1, 2)  # its first call was its warm-up; at most two timed
    assert "a long call" in long["notes"] and rows[0]["stopped_by"] != "long_call"
    if long["cycles"] == 1:  # one paired ratio is no interval: the row says so instead of a zero-width one
        assert math.isfinite(long["speedup"]) and math.isnan(long["speedup_ci_low"]), long["speedup_ci_low"]
        assert "speed-up from one paired cycle" in long["notes"]


def test_a_cell_timed_alone_follows_the_long_call_rule(monkeypatch):
    """``time_fn`` (a cell alone, ``run_cell``): a long first call stands for the warm-up, and sampling stops by the
    rule, at most :data:`~attnbench.measure.long_call.LONG_CALL_TIMED` calls, where the budget would take three."""
    from attnbench.measure import long_call
    from attnbench.measure.timing import time_fn

    monkeypatch.setattr(long_call, "LONG_CALL_S", 0.015)
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.02)

    t = time_fn(fn, warmup_calls=3, warmup_s=0.0, min_samples=10, budget_s=0.0, warmed_s=0.02)
    assert t.stopped_by == "long_call" and t.warmup_calls == 0 and 1 <= len(calls) == len(t.samples_s) <= 2
    calls.clear()
    t = time_fn(fn, warmup_calls=3, warmup_s=0.0, min_samples=10, budget_s=0.0)  # no call made before: one warms up
    assert t.stopped_by == "long_call" and t.warmup_calls == 1 and len(calls) == 1 + len(t.samples_s) <= 3
    assert t.warm_call_s >= 0.02
    t = time_fn(lambda: None, warmup_calls=3, warmup_s=0.0, min_samples=3, budget_s=0.0)  # a short call: as before
    assert t.stopped_by != "long_call" and t.warmup_calls == 3 and len(t.samples_s) >= 3


def test_a_single_long_cell_row_says_why_it_stopped(monkeypatch):
    from attnbench.measure import long_call

    monkeypatch.setattr(long_call, "LONG_CALL_S", 0.04)
    monkeypatch.setattr(long_call, "LONG_CALL_AGREE", 0.5)
    row = run_cell(Cell(f"{PLUGINS / 'long_call.py'}:SleepsPerCall", **TINY),
                   dataclasses.replace(FAST, warmup_calls=3, flop_check=True), "run", peak_gflops_per_s=100.0)
    assert row["status"] == "ok" and row["stopped_by"] == "long_call", (row["stopped_by"], row["error"])
    assert row["warmup_calls"] == 1 and row["n"] in (1, 2) and "a long call" in row["notes"]
    assert "FLOPs not counted: a long call" in row["notes"] and not row.get("flops_counted") == row.get("flops_counted")


def test_a_predicted_long_call_measures_peak_memory_in_its_first_call(monkeypatch):
    """The memory pass would repeat a long call: the first call of a cell the plan predicts long is profiled instead,
    and the memory pass takes its figure without another call."""
    from attnbench.measure import long_call
    from attnbench.runner import budget, group

    monkeypatch.setattr(long_call, "LONG_CALL_S", 0.04)
    monkeypatch.setattr(long_call, "LONG_CALL_AGREE", 0.5)
    real_plan = budget.plan_cell

    def plan(cell, *a, **k):
        p = real_plan(cell, *a, **k)
        return dataclasses.replace(p, call_s=0.06 if "SleepsPerCall" in cell.impl else p.call_s)

    monkeypatch.setattr(budget, "plan_cell", plan)
    cells = [Cell("sdpa", **TINY), Cell(f"{PLUGINS / 'long_call.py'}:SleepsPerCall", **TINY)]
    _, settings = group.plan_unit(cells, FAST, 100.0)
    assert settings.first_call_memory == (cells[1].cell_id,)
    assert group.plan_unit(cells, dataclasses.replace(FAST, work_pass=False), 100.0)[1].first_call_memory == ()
    calls = []
    monkeypatch.setattr("attnbench.runner.cell.peak_memory",
                        lambda fn, device: calls.append(1) or (fn(), MemoryResult(123.0, math.nan, "test"))[1])
    rows = group.measure_unit(cells, FAST, "run", peak_gflops_per_s=100.0)
    assert rows[1]["status"] == "ok" and rows[1]["peak_bytes"] == 123.0, rows[1]["error"]
    assert "peak memory from the first call" in rows[1]["notes"] and "peak memory from" not in rows[0]["notes"]
    assert len(calls) == 2  # the long member's first call and the short member's own memory pass
