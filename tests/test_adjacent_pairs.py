"""Issue 30: adjacent pairs (a baseline burst between every two members) and the speed-ups' between-round term."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnbench.measure import speedup_spread
from attnbench.measure.interleave import time_interleaved
from attnbench.runner.cell import add_speedups, paired_base


def _machine():
    """A machine whose speed drifts smoothly from burst to burst (log-speed a sine over 12 bursts, +-30%): burst k of
    whichever member sees the level of k."""
    state = {"k": 0}

    def tick(name: str) -> None:
        state["k"] += 1

    def member(t: float):
        return lambda: t * math.exp(0.3 * math.sin(2 * math.pi * state["k"] / 12))

    return tick, member


def test_adjacent_pairs_put_the_baseline_between_every_two_members_and_pair_each_with_its_neighbours(synthetic_bursts):
    calls = {"base": 2e-3, "a": 1e-3, "b": 4e-3}
    t = time_interleaved({n: (lambda v=v: v) for n, v in calls.items()}, warmup_calls=1, warmup_s=0.0, min_cycles=6,
                         max_cycles=6, budget_s=60, burst_s=4e-3, min_block_s=0.0, baseline="base", target_rel_ci=0.0,
                         pairing="adjacent")
    assert t.pairing == "adjacent" and t.cycles == 6
    for order in t.orders:  # B x B y B: the baseline at both ends and between the two others
        assert order[::2] == ("base", "base", "base") and sorted(order[1::2]) == ["a", "b"]
    assert t.pair_base_s["a"] == pytest.approx([2e-3] * 6) and t.paired_base("a") == t.pair_base_s["a"]
    assert t.speedup("a")[0] == pytest.approx(2.0) and t.speedup("b")[0] == pytest.approx(0.5)
    assert t.member_cycles == {"base": 6, "a": 6, "b": 6}


def test_adjacent_pairs_cancel_a_drift_that_a_cycle_of_members_does_not(synthetic_bursts):
    """The machine's speed drifts from burst to burst: an adjacent pair's neighbours straddle the member's burst, so
    their geometric mean nearly cancels the drift; in a cycle of seven the baseline's burst is up to six bursts away."""
    spread = {}
    for pairing in ("cycle", "adjacent"):
        tick, member = _machine()
        fns = {"base": member(2e-3), "m": member(1e-3)}
        fns.update({f"o{i}": member(1e-3) for i in range(5)})
        t = time_interleaved(fns, warmup_calls=1, warmup_s=0.0, min_cycles=30, max_cycles=30, budget_s=60, burst_s=4e-3,
                             min_block_s=0.0, baseline="base", target_rel_ci=0.0, on_burst=tick, pairing=pairing)
        ratios = np.log(np.asarray(t.paired_base("m")) / np.asarray(t.cycle_s["m"]))
        spread[pairing] = float(np.std(ratios))
        assert t.speedup("m")[0] == pytest.approx(2.0, rel=0.1)
    assert spread["adjacent"] < spread["cycle"] / 3


def test_an_unknown_pairing_is_refused():
    with pytest.raises(ValueError, match="pairing 'pairs'"):
        time_interleaved({"a": lambda: None}, pairing="pairs")


def _row(impl: str, cycles: list[float], sizes: list[int], base: list[float] | None = None) -> dict:
    return {"cell_id": f"{impl}|g", "group_id": "g", "impl": impl, "status": "ok", "cycle_s": cycles,
            "cycle_groups": sizes, "pair_base_s": base or [], "notes": ""}


def test_add_speedups_pairs_a_member_with_its_adjacent_baseline_bursts():
    base = _row("sdpa", [2e-3] * 8, [4, 4])
    member = _row("einsum", [1e-3] * 8, [4, 4], base=[3e-3] * 8)  # its neighbours were slower than the cycle mean
    rows = add_speedups([base, member], "sdpa")
    assert rows[1]["speedup"] == pytest.approx(3.0)
    rows = add_speedups([base, {**member, "pair_base_s": []}], "sdpa")  # cycle pairs: the baseline's cycle times
    assert rows[1]["speedup"] == pytest.approx(2.0)


def test_the_between_round_term_widens_an_interval_narrower_than_the_rounds_spread():
    rng = np.random.default_rng(0)
    rows = [_row("sdpa", [2e-3] * 20, [10, 10])]
    for i in range(6):  # members whose two rounds differ by about 5%, each round internally steady
        shift = math.exp(rng.normal(0, 0.05))
        rows.append(_row(f"m{i}", [1e-3] * 10 + [1e-3 * shift] * 10, [10, 10]))
    rows = add_speedups(rows, "sdpa")
    per_round = speedup_spread.per_round(rows, paired_base)
    assert set(per_round) == {f"m{i}|g" for i in range(6)} and all(len(x) == 2 for x in per_round.values())
    sd, cells = speedup_spread.pooled(per_round.values())
    assert cells == 6 and 0.01 < sd < 0.15
    row = rows[1]
    own = speedup_spread.moderated_sd(per_round[row["cell_id"]], sd)
    lo, hi = speedup_spread.widened(row, own, 2)
    z = 1.959963984540054
    assert math.log(hi / row["speedup"]) >= z * own - 1e-12 and math.log(row["speedup"] / lo) >= z * own - 1e-12
    assert lo <= row["speedup_ci_low"] and hi >= row["speedup_ci_high"]
    wide = {**row, "speedup_ci_low": row["speedup"] / 2, "speedup_ci_high": row["speedup"] * 2}
    assert speedup_spread.widened(wide, own, 2) == (wide["speedup_ci_low"], wide["speedup_ci_high"])  # kept


def test_too_few_cells_give_no_pooled_term():
    assert speedup_spread.pooled([[0.0, 0.1], [0.0, 0.05]]) == (None, 2)
    assert speedup_spread.pooled([[0.0], [0.1], [0.2]]) == (None, 0)


def test_the_garbage_collector_is_paused_while_samples_are_taken_and_restored_after():
    import gc

    from attnbench.measure.timing import time_fn

    seen = []

    def fn():
        seen.append(gc.isenabled())

    assert gc.isenabled()
    time_fn(fn, warmup_calls=2, warmup_s=0.0, budget_s=0.01, min_samples=3)
    assert seen[:2] == [True, True] and not any(seen[2:])  # warm-up as it is, samples with the collector off
    assert gc.isenabled()
    seen.clear()
    time_interleaved({"a": fn, "b": fn}, warmup_calls=1, warmup_s=0.0, min_cycles=3, max_cycles=3, burst_s=1e-4,
                     min_block_s=0.0, baseline="a", target_rel_ci=0.0, pairing="adjacent")
    assert seen[:2] == [True, True] and seen[2:] and not any(seen[2:]) and gc.isenabled()


def test_the_run_level_term_is_what_reruns_move_beyond_their_rounds_spread():
    import pandas as pd

    def frame(speedups, spread):
        return pd.DataFrame([{"cell_id": f"m{i}|g", "impl": f"m{i}", "baseline": "sdpa", "status": "ok", "speedup": s,
                              "speedup_spread_rel": spread, "cycle_groups": np.array([10, 10])} for i, s in enumerate(speedups)])

    runs = [frame([1.0, 2.0], 0.0), frame([1.02, 2.04], 0.0), frame([0.98, 1.96], 0.0)]  # lists read back as arrays
    expected = np.std(np.log([1.0, 1.02, 0.98]), ddof=1)
    assert speedup_spread.estimate_run_sd(runs) == pytest.approx(expected, rel=0.05)
    # rounds that spread enough to explain the reruns leave no run-level term
    assert speedup_spread.estimate_run_sd([frame([1.0, 2.0], 0.2), frame([1.02, 2.04], 0.2)]) == 0.0
    row = {"speedup": 2.0, "speedup_ci_low": 1.99, "speedup_ci_high": 2.01}
    lo, hi = speedup_spread.widened(row, 0.0, 2, run=0.01)
    assert math.log(hi / 2.0) == pytest.approx(1.959963984540054 * math.sqrt(2) * 0.01)


def test_the_run_level_term_comes_from_the_calibration_else_the_cpu_default(tmp_path, monkeypatch):
    from attnbench.measure import drift

    monkeypatch.setenv(drift.ENV_FILE, str(tmp_path / "drift.json"))
    assert speedup_spread.run_sd("cpu", "pinned")[0] == speedup_spread.DEFAULT_CPU_RUN_SD
    assert speedup_spread.run_sd("cuda", "pinned")[0] == 0.0
    drift.save_calibration(drift.machine_key("cpu", "pinned"), {"rel": 0.02, speedup_spread.CALIBRATION_KEY: 0.004})
    value, source = speedup_spread.run_sd("cpu", "pinned")
    assert value == 0.004 and "calibrated" in source
