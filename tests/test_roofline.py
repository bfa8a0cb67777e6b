"""Issue 49: each cell's roofline coordinates, the cached ceilings (CPU and, mocked, CUDA), the plausibility guard and
the report's roofline figure and headroom table. Rows are synthetic and ceilings mocked: nothing here depends on timing."""

from __future__ import annotations

import json
import math
import types

import pandas as pd
import pytest
import torch
from sample_runs import ok_row, synthetic_run

from attnbench.measure import bandwidth, flops, roofline
from attnbench.measure.flops import analytic_flops, decode_bytes
from attnbench.results.schema import Cell, check_row
from attnbench.results.store import RunStore, load_run

CEILING = {"ceiling_gflops_per_s": 100.0, "ceiling_gflops_rel": 0.05, "ceiling_gbytes_per_s": 10.0,
           "ceiling_gbytes_rel": 0.05, "ceiling_cache_bytes": 32.0 * 2**20}


def _row(cell: Cell, median_s: float, flops: float | None = None, **extra) -> dict:
    """An ok row of ``cell`` timed at ``median_s`` with the analytic FLOPs (or ``flops``) and :data:`CEILING`."""
    row = ok_row(cell, [median_s] * 5, **CEILING, **extra)
    f = analytic_flops(cell.batch, cell.seq_len, cell.d_model, cell.d_model, cell.mode, num_heads=cell.num_heads,
                       num_kv_heads=cell.num_kv_heads, window=cell.window) if flops is None else flops
    row.update(flops=f, gflops_per_s=f / median_s / 1e9, peak_gflops_per_s=float("nan"))
    return row


# ---------------------------------------------------------------- minimal bytes


def test_min_bytes_counts_each_tensor_once_per_mode_dtype_and_variant():
    cell = Cell("sdpa", batch=2, seq_len=64, num_heads=4, d_model=32)
    tokens, d = 2 * 64, 32
    forward = (2 * tokens * d + 4 * d * d + d) * 4  # x and out, W_q W_k W_v W_o and the output bias, float32
    assert roofline.min_bytes(_row(cell, 1e-3)) == forward
    assert roofline.min_bytes(_row(Cell("sdpa", batch=2, seq_len=64, num_heads=4, d_model=32, mode="forward+backward"),
                                   1e-3)) == 2 * forward
    assert roofline.min_bytes(_row(Cell("sdpa", batch=2, seq_len=64, num_heads=4, d_model=32, dtype="bfloat16"),
                                   1e-3)) == forward / 2
    gqa = Cell("sdpa", batch=2, seq_len=64, num_heads=4, d_model=32, num_kv_heads=1)  # K and V weights a quarter
    assert roofline.min_bytes(_row(gqa, 1e-3)) == forward - 2 * (d * d - d // 4 * d) * 4
    dec = Cell("sdpa", batch=2, seq_len=64, num_heads=4, d_model=32, mode="decode", window=16)
    assert roofline.min_bytes(_row(dec, 1e-3)) == decode_bytes(2, 64, 32, 32, num_heads=4, window=16) + 2 * 2 * d * 4
    assert math.isnan(roofline.min_bytes(_row(Cell("sdpa", scope="block"), 1e-3)))


def test_a_variable_length_batch_moves_its_real_tokens_only():
    cell = Cell("packed", batch=4, seq_len=64, num_heads=4, d_model=32, lengths="longtail")
    row = _row(cell, 1e-3, tokens=100)
    assert roofline.min_bytes(row) == (2 * 100 * 32 + 4 * 32 * 32 + 32) * 4


# ---------------------------------------------------------------- coordinates and the guard


def test_coordinates_of_a_compute_bound_and_a_memory_bound_cell():
    big = _row(Cell("sdpa", batch=4, seq_len=512, num_heads=8, d_model=512), 0.2)  # ~27 GFLOP/s
    c = roofline.coordinates(big)
    t_compute, t_memory = big["flops"] / 100e9, c["min_bytes"] / 10e9
    assert c["bound"] == "compute" and t_compute > t_memory
    assert c["attainable_s"] == pytest.approx(t_compute) and c["headroom"] == pytest.approx(0.2 / t_compute)
    assert c["intensity"] == pytest.approx(big["flops"] / c["min_bytes"]) and c["plausibility"] == "plausible"
    dec = _row(Cell("sdpa", batch=1, seq_len=4096, num_heads=8, d_model=512, mode="decode"), 1e-3)
    d = roofline.coordinates(dec)
    assert d["bound"] == "memory" and d["attainable_s"] == pytest.approx(d["min_bytes"] / 10e9)
    assert d["intensity"] < 1  # a decode step does about one multiply-add per element it reads


def test_a_flop_count_planted_ten_times_too_high_reads_implausible_and_is_named():
    cell = Cell("sdpa", batch=4, seq_len=512, num_heads=8, d_model=512)
    honest = _row(cell, 1.0)
    honest.update(median_s=honest["flops"] / 40e9)  # 40 GFLOP/s against a ceiling of 100
    honest["gflops_per_s"] = 40.0
    assert roofline.coordinates(honest)["plausibility"] == "plausible"
    planted = {**honest, "flops": 10 * honest["flops"], "gflops_per_s": 400.0}
    assert roofline.coordinates(planted)["plausibility"] == "implausible"
    within = {**honest, "flops": 2.6 * honest["flops"]}  # 104 GFLOP/s: above 100, inside its ±5%
    assert roofline.coordinates(within)["plausibility"] == "plausible"
    planted.update(roofline.coordinates(planted))
    text = roofline.implausible_text(planted)
    assert planted["cell_id"] in text and "400 GFLOP/s above the measured ceiling of 100" in text
    flagged = roofline.implausible_rows(pd.DataFrame([honest, planted]))
    assert flagged["cell_id"].tolist() == [planted["cell_id"]] and len(flagged) == 1


def test_the_run_s_own_peak_raises_the_compute_ceiling():
    cell = Cell("sdpa", batch=4, seq_len=512, num_heads=8, d_model=512)
    row = _row(cell, 1.0)
    row["median_s"] = row["flops"] / 150e9  # 150 GFLOP/s: above the cached 100, below the run's own 200
    assert roofline.coordinates(row)["plausibility"] == "implausible"
    row["peak_gflops_per_s"] = 200.0
    assert roofline.coordinates(row)["plausibility"] == "plausible"


def test_bytes_faster_than_dram_are_implausible_only_when_they_cannot_stay_in_a_cache():
    small = _row(Cell("sdpa", batch=1, seq_len=64, num_heads=2, d_model=64, mode="decode"), 1e-9)
    small["peak_gflops_per_s"] = 1e12  # isolate the memory term
    assert roofline.coordinates(small)["plausibility"] == "plausible"  # KBs: from the cache, faster than DRAM
    big = {**small, "ceiling_cache_bytes": 1.0}  # now the same bytes exceed 4x the cache
    assert roofline.coordinates(big)["plausibility"] == "implausible"
    assert "GB/s above the measured bandwidth of 10" in roofline.implausible_text({**big, **roofline.coordinates(big)})


def test_a_row_without_ceilings_or_not_ok_is_not_judged():
    cell = Cell("sdpa")
    bare = {k: v for k, v in _row(cell, 1e-3).items() if not k.startswith("ceiling_")}
    c = roofline.coordinates(bare)
    assert c["plausibility"] == "" and c["bound"] == "" and math.isnan(c["headroom"]) and c["min_bytes"] > 0
    failed = {**_row(cell, 1e-3), "status": "error"}
    assert roofline.coordinates(failed)["plausibility"] == ""
    check_row({**_row(cell, 1e-3), **roofline.coordinates(_row(cell, 1e-3))})  # every column is in the schema


def test_a_block_cell_is_judged_on_compute_without_bytes():
    row = _row(Cell("sdpa", scope="block"), 1.0, flops=500e9)  # 500 GFLOP/s against 100
    c = roofline.coordinates(row)
    assert math.isnan(c["intensity"]) and c["bound"] == "" and c["plausibility"] == "implausible"


# ---------------------------------------------------------------- the ceilings, cached per machine


@pytest.fixture
def ceilings_file(tmp_path, monkeypatch):
    """A ceilings file of the test's own, nothing remembered in the process, GEMM and STREAM tries mocked."""
    path = tmp_path / "ceilings.json"
    monkeypatch.setenv(roofline.ENV_FILE, str(path))
    monkeypatch.setattr(roofline, "_ceilings", {})
    monkeypatch.setattr(roofline, "_stream", {})
    calls = []
    monkeypatch.setattr(flops, "gemm_rates", lambda device, dtype, budget_s, n=None, min_samples=10:
                        calls.append(("gemm", device, dtype, n)) or [90.0, 100.0, 95.0])
    monkeypatch.setattr(bandwidth, "stream_rates", lambda device, budget_s: calls.append(("stream", device)) or [10.0, 9.0, 8.0])
    monkeypatch.setattr(roofline, "gemm_side", lambda device, dtype: 256)
    return path, calls


def test_ceilings_are_measured_once_then_read_from_the_file_with_their_date_and_conditions(ceilings_file):
    path, calls = ceilings_file
    c = roofline.ceiling_for("cpu", "float32")
    assert (c.gflops_per_s, c.gflops_rel, c.gbytes_per_s) == (100.0, 0.1, 10.0) and c.gbytes_rel == pytest.approx(0.2)
    assert calls == [("gemm", "cpu", "float32", 256), ("stream", "cpu")]
    entry = json.loads(path.read_text())[roofline.machine_key("cpu", "float32", torch.get_num_threads())]
    assert entry["date"] and entry["conditions"]["threads"] == torch.get_num_threads()
    assert entry["conditions"]["gemm_n"] == 256 and entry["conditions"]["gemm_gflops_per_s"] == [90.0, 100.0, 95.0]
    roofline.ceiling_for("cpu", "bfloat16")  # another dtype: its own GEMM, the bandwidth reused
    assert calls[2:] == [("gemm", "cpu", "bfloat16", 256)]
    roofline._ceilings.clear()  # a new process: the file answers
    assert roofline.ceiling_for("cpu", "float32") == c and len(calls) == 3
    roofline.ceiling_for("cpu", "float32", again=True)
    assert calls[3] == ("gemm", "cpu", "float32", 256)


def test_the_run_peak_is_a_quick_check_against_the_cached_ceiling(ceilings_file, monkeypatch):
    """Issue 49: a measuring process's warm-up takes the machine's ceiling first, then times its peak GEMM with three
    calls per try and keeps the better of the two; without a floor the peak times ten calls per try, as before."""
    from attnbench.runner.executors import warmup

    asked = []
    monkeypatch.setattr(flops, "gemm_rates", lambda device, dtype, budget_s, n=None, min_samples=10:
                        asked.append(min_samples) or [40.0, 50.0])
    assert flops._measure_peak_gflops("cpu", "float32", 1.0) == 50.0 and asked == [10]
    assert flops._measure_peak_gflops("cpu", "float32", 1.0, floor=80.0) == 80.0 and asked[-1] == flops.QUICK_SAMPLES
    assert flops._measure_peak_gflops("cpu", "float32", 1.0, floor=30.0) == 50.0  # today's GEMM beat the cached one
    monkeypatch.setattr(flops, "_best_peaks", {})
    monkeypatch.setattr(roofline, "ceiling_for", lambda device, dtype: roofline.Ceiling(80.0, 0.02, 10.0, 0.02, 1e6))
    asked.clear()
    warmup.warm_cells([Cell(impl="sdpa", batch=1, seq_len=8, num_heads=2, d_model=16)])
    assert flops.peak_gflops("cpu", "float32") == 80.0 and asked == [flops.QUICK_SAMPLES]


def test_a_corrupt_ceilings_file_is_an_error_naming_it_and_a_row_says_it_has_no_roofline(ceilings_file):
    path, _ = ceilings_file
    path.write_text("{not json")
    from attnbench.errors import ResultsError

    with pytest.raises(ResultsError, match="ceilings.json"):
        roofline.load_ceilings()
    row = _row(Cell("sdpa"), 1e-3)
    row = {k: v for k, v in row.items() if not k.startswith("ceiling_")}
    roofline.record(row, "cpu")
    assert "no roofline: cannot read the roofline ceilings" in row["notes"] and "ceiling_gflops_per_s" not in row


def test_record_adds_the_ceilings_and_coordinates_to_a_row(ceilings_file):
    row = {k: v for k, v in _row(Cell("sdpa", batch=4, seq_len=512, num_heads=8, d_model=512), 0.2).items()
           if not k.startswith("ceiling_")}
    roofline.record(row, "cpu")
    assert row["ceiling_gflops_per_s"] == 100.0 and row["bound"] == "compute" and row["headroom"] > 1


def test_cuda_ceilings_record_the_device_properties_beside_the_measured_gemm_and_copy(ceilings_file, monkeypatch):
    path, calls = ceilings_file
    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
                                  total_memory=80 * 2**30, L2_cache_size=50 * 2**20, memory_clock_rate=2_619_000,
                                  memory_bus_width=5120)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: props.name)
    c = roofline.ceiling_for("cuda", "bfloat16")
    assert calls == [("gemm", "cuda", "bfloat16", 256), ("stream", "cuda")]
    assert c.cache_bytes == 50 * 2**20 and c.conditions["threads"] == 0
    assert c.conditions["device"]["multi_processor_count"] == 132
    assert c.conditions["device"]["nominal_gbytes_per_s"] == pytest.approx(3352.32)  # H100 SXM's 3.35 TB/s
    assert c.conditions["stream_array_bytes"] == bandwidth.CUDA_ARRAY_BYTES
    key = roofline.machine_key("cuda", "bfloat16", 0)
    assert "cuda:NVIDIA H100 80GB HBM3|bfloat16|threads=0" in key and key in json.loads(path.read_text())


def test_the_gemm_side_halves_for_a_dtype_too_slow_at_the_default(monkeypatch):
    clock = iter(range(0, 100))
    monkeypatch.setattr(roofline.time, "perf_counter", lambda: next(clock) * 0.2)  # every call "takes" 0.2 s
    assert roofline.gemm_side("cpu", "float32") == 1024  # 0.2 s <= MAX_CALL_S
    clock = iter(range(0, 100))
    monkeypatch.setattr(roofline.time, "perf_counter", lambda: next(clock) * 1.0)  # 1 s a call: halved to the least
    monkeypatch.setattr(flops, "gemm_size", lambda kind, dt: 256)
    assert roofline.gemm_side("cpu", "float32") == 128


# ---------------------------------------------------------------- runs and the report


def test_a_cell_run_here_gets_every_roofline_column(single_thread):
    from attnbench.runner.cell import run_cell
    from attnbench.runner.sweep import Settings

    row = run_cell(Cell("sdpa", seq_len=16, num_heads=2, d_model=16, mode="inference"),
                   Settings(budget_s=0.02, min_samples=3, warmup_calls=1, accuracy="off", flop_check=False))
    assert row["status"] == "ok", row["error"]
    assert row["ceiling_gflops_per_s"] == 1e6  # the session's mock ceilings (conftest), never measured in tests
    assert row["bound"] == "compute" and row["plausibility"] == "plausible" and row["headroom"] > 1
    assert row["attainable_s"] == pytest.approx(row["flops"] / (row["ceiling_gflops_per_s"] * 1e9))


def test_merging_rounds_remakes_the_headroom_from_the_pooled_median():
    from attnbench.runner.cell import merge_rounds

    cell = Cell("sdpa", batch=4, seq_len=512, num_heads=8, d_model=512)
    rows = []
    for median in (0.04, 0.06):
        r = _row(cell, median, samples_s=[median] * 5, sample_groups=[5], peak_gflops_per_s=50.0, frac_peak=0.0,
                 duration_s=1.0, recompiles=float("nan"))
        r.update(roofline.coordinates(r))
        rows.append(r)
    merged = merge_rounds(rows)
    assert merged["headroom"] == pytest.approx(merged["median_s"] / merged["attainable_s"])
    assert rows[0]["headroom"] < merged["headroom"] < rows[1]["headroom"]


def _roofline_run(tmp_path, plant: bool):
    """A synthetic run whose rows carry :data:`CEILING` (with a compute ceiling of 10 TFLOP/s, above every synthetic
    row) and their coordinates; ``plant``: one row's FLOPs x10^4."""
    src, _ = load_run(synthetic_run(tmp_path / "src", impls=("weight_split", "sdpa"), seq_lens=(64, 256),
                                    failures=False, noisy=False))
    store = RunStore(tmp_path / "runs", run_id="roof")
    for i, row in enumerate(src.to_dict("records")):
        row.update(CEILING, ceiling_gflops_per_s=1e4, peak_gflops_per_s=float("nan"))
        if plant and i == 0:
            row["flops"] *= 1e4
            row["gflops_per_s"] *= 1e4
        row.update(roofline.coordinates(row))
        store.append(row)
    store.finalize()
    return store.path


def test_the_report_draws_the_roofline_lists_headroom_and_names_an_implausible_row(tmp_path):
    from attnbench.report import build_report

    run = _roofline_run(tmp_path, plant=True)
    df, _ = load_run(run)
    flagged = df[df["plausibility"] == "implausible"]
    assert len(flagged) == 1
    html = build_report(run, out_dir=tmp_path / "report", formats="png", dpi=40).read_text()
    assert (tmp_path / "report" / "figures" / "roofline.png").is_file() and 'id="roofline"' in html
    headroom = pd.read_csv(tmp_path / "report" / "tables" / "headroom.csv")
    ok = df[df["plausibility"] == "plausible"]
    assert headroom["headroom"].iloc[0] == pytest.approx(ok["headroom"].max())  # the furthest from its roof first
    assert list(headroom["headroom"]) == sorted(headroom["headroom"], reverse=True)
    assert "1 row implausible" in html and flagged["cell_id"].iloc[0] in html


def test_a_run_before_the_roofline_reports_without_it(tmp_path):
    from attnbench.report import build_report

    run = synthetic_run(tmp_path / "old", impls=("sdpa",), seq_lens=(64,), failures=False, noisy=False)
    html = build_report(run, out_dir=tmp_path / "report", formats="png", dpi=40).read_text()
    assert 'id="roofline"' not in html and "implausible" not in html


def test_the_console_names_an_implausible_row(tmp_path, capsys):
    from attnbench.cli.run import _print_over_peak

    df, _ = load_run(_roofline_run(tmp_path, plant=True))
    _print_over_peak(df)
    out = capsys.readouterr().out
    flagged = df[df["plausibility"] == "implausible"]["cell_id"].iloc[0]
    assert "warning: implausible row" in out and flagged in out
