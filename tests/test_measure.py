"""The measurement primitives: statistics, timing loop, memory, FLOPs (no assertions on speed)."""

import math

import numpy as np
import pytest
import torch

from attnbench.measure import analytic_flops, counted_flops, dense_flops, median_ci, peak_memory, summarize, time_fn
from attnbench.results.schema import Cell
from attnbench.runner.workload import build_workload


def test_median_ci_brackets_the_median_and_shrinks_with_n():
    rng = np.random.default_rng(0)
    small = rng.lognormal(size=20)
    large = rng.lognormal(size=2000)
    lo_s, hi_s = median_ci(small)
    lo_l, hi_l = median_ci(large)
    assert lo_s <= np.median(small) <= hi_s
    assert lo_l <= np.median(large) <= hi_l
    assert (hi_l - lo_l) < (hi_s - lo_s)


def test_median_ci_coverage_is_about_95_percent():
    rng = np.random.default_rng(1)
    true_median = math.exp(0)  # lognormal(0, 1)
    hits = sum(lo <= true_median <= hi for lo, hi in (median_ci(rng.lognormal(size=30)) for _ in range(400)))
    assert 0.92 <= hits / 400 <= 0.995


def test_summarize_fields():
    s = summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s["median_s"] == 3.0 and s["min_s"] == 1.0 and s["max_s"] == 100.0 and s["n"] == 5
    assert s["iqr_s"] == 2.0
    assert s["ci_low_s"] <= 3.0 <= s["ci_high_s"]
    assert math.isnan(summarize([])["median_s"])


def test_time_fn_keeps_raw_samples_warms_up_and_respects_budget():
    calls = {"n": 0}

    def fn():
        calls["n"] += 1
        torch.randn(64, 64) @ torch.randn(64, 64)

    t = time_fn(fn, "cpu", warmup_calls=5, warmup_s=0.0, budget_s=0.2, target_rel_ci=0.0, min_samples=5)
    assert t.warmup_calls >= 5
    assert len(t.samples_s) >= 3 and all(s > 0 for s in t.samples_s)
    assert t.stopped_by == "budget"
    assert calls["n"] == t.warmup_calls + len(t.samples_s) * t.calls_per_sample
    assert t.timer == "perf_counter_ns"


def test_time_fn_stops_on_confidence_interval():
    t = time_fn(lambda: sum(range(2000)), "cpu", budget_s=30.0, target_rel_ci=0.5, min_samples=10)
    assert t.stopped_by == "ci" and len(t.samples_s) >= 10


def test_time_fn_blocks_tiny_calls():
    t = time_fn(lambda: None, "cpu", budget_s=0.1, min_block_s=1e-3)
    assert t.calls_per_sample > 10  # a no-op is far below the clock's useful resolution per call


def test_peak_memory_counts_temporaries_not_inputs():
    a = torch.randn(256, 256)  # allocated before: not counted

    def fn():
        b = a @ a  # 256 KiB
        c = b @ b  # another 256 KiB, both alive at once
        del b, c

    m = peak_memory(fn, "cpu")
    assert m.method == "profiler_memory_events"
    assert 2 * 256 * 256 * 4 <= m.peak_bytes < 4 * 256 * 256 * 4


def _peak(impl, seq_len, batch=1, heads=4, d_model=64, mode="forward"):
    w = build_workload(Cell(impl, batch=batch, seq_len=seq_len, num_heads=heads, d_model=d_model, mode=mode))
    return peak_memory(w.step, "cpu").peak_bytes


def test_memory_grows_like_T_squared_for_math_but_not_for_fused_sdpa():
    # weight_split materialises (b, h, T, T) scores: 8x longer sequences cost ~64x the memory.
    m_short, m_long = _peak("weight_split", 256), _peak("weight_split", 2048)
    assert m_long / m_short > 40
    # The score matrix alone at T=2048 is b*h*T^2*4 bytes = 64 MiB; the peak must include it.
    assert m_long >= 1 * 4 * 2048 * 2048 * 4
    # The fused CPU flash kernel works in tiles: its memory grows about linearly in T (8x, not 64x).
    f_short, f_long = _peak("sdpa_flash", 256), _peak("sdpa_flash", 2048)
    assert f_long / f_short < 12
    assert f_long < m_long / 20
    # b*h scaling: doubling the heads (same width) doubles the score memory of the math path.
    assert 1.6 < _peak("weight_split", 2048, heads=8) / m_long < 2.2
    assert 1.6 < _peak("weight_split", 2048, batch=2) / m_long < 2.2


def test_analytic_flops_model():
    b, T, d = 2, 8, 16
    proj = 2 * b * T * d * d * 4
    assert analytic_flops(b, T, d, d) == proj + 4 * b * d * T * (T + 1) / 2
    assert dense_flops(b, T, d, d) == proj + 4 * b * d * T * T
    assert analytic_flops(b, T, d, d, "forward+backward") == 3 * analytic_flops(b, T, d, d)
    assert analytic_flops(b, T, d, d, "inference") == analytic_flops(b, T, d, d, "forward")


@pytest.mark.parametrize("impl", ["weight_split", "fused_qkv", "wrapper", "per_head_linear"])
def test_flop_counter_agrees_with_dense_model_for_math_implementations(impl):
    cell = Cell(impl, batch=2, seq_len=32, num_heads=4, d_model=64, mode="forward")
    w = build_workload(cell)
    assert counted_flops(w.step) == dense_flops(2, 32, 64, 64)


def test_flop_counter_backward_factor_is_two():
    cell = Cell("weight_split", batch=2, seq_len=32, num_heads=4, d_model=64, mode="forward+backward")
    w = build_workload(cell)
    assert counted_flops(w.step) == pytest.approx(3 * dense_flops(2, 32, 64, 64), rel=0.02)


def test_cpu_peak_memory_without_the_profilers_private_events(monkeypatch):
    """``kineto_results`` is private: without it the peak is NaN with the reason, never a zero."""
    from attnbench.measure import memory

    assert memory._memory_events(object()) is None
    monkeypatch.setattr(memory, "_memory_events", lambda prof: None)
    result = memory.peak_memory(lambda: torch.ones(1000) * 2, "cpu")
    assert math.isnan(result.peak_bytes) and result.method.startswith("unavailable")


def test_native_stderr_silences_or_captures_fd2(capfd):
    import os

    from attnbench.measure.memory import native_stderr

    with native_stderr():
        os.write(2, b"USDT: silenced\n")
    with native_stderr(capture=True) as native:
        os.write(2, b"[W sdp_utils.cpp:1] Warning: captured\n")
    os.write(2, b"after\n")
    assert native.text() == "[W sdp_utils.cpp:1] Warning: captured\n"
    assert capfd.readouterr().err == "after\n"
