"""The fidelity tool's interleaved check (issue 30): a pair's paired speed-up against blocked_autorange's ratio."""

from __future__ import annotations

import math

from attnbench.results.schema import Cell
from attnbench.tools import fidelity

TINY = dict(batch=1, seq_len=16, num_heads=2, d_model=16, mode="inference")


def test_a_pair_is_measured_both_ways_and_compared(single_thread):
    r = fidelity.measure_pair(Cell("sdpa", **TINY), Cell("einsum", **TINY), budget_s=0.02, repeats=2)
    assert r["pair"].startswith("einsum vs sdpa ")
    assert r["paired"] > 0 and r["tub_ratio"] > 0 and r["ratio"] == r["ratio"]
    assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"]
    assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("base_median_ratio", "member_median_ratio"))
