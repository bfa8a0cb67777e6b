"""Issue 37, paged KV caches: paged_sdpa and flex_paged (implementations/paged.py), the paged-decode check, the page-size
axis and its columns, the preset, and the rope caches trimmed to the window."""

from __future__ import annotations

import math

import pytest
import torch

from attnbench import registry
from attnbench.correctness import paged as paged_check
from attnbench.correctness.matrix import cases, run_case
from attnbench.errors import SweepError, UnavailableError
from attnbench.measure import kv_cache_bytes_analytic
from attnbench.results.schema import AXES, COLUMNS, Cell
from attnbench.runner.sweep import Sweep, load_preset, parse_page_sizes, sweep_from_dict
from attnbench.runner.workload import build_workload
from attnbench.spec import AttnSpec

PAGED = ["paged_sdpa", "flex_paged"]
PLUGIN = "tests/plugins/buggy_paged.py:BlockTableOnePageLate"
BAD = ("fail", "error")


def _module(name: str, page_size: int, window=None, kv=2):
    m = registry.get(name).build(AttnSpec(16, 16, 40, 0.0, 4, num_kv_heads=kv, window=window)).double().eval()
    m.set_page_size(page_size)
    return m


@pytest.mark.slow
def test_flex_paged_passes_a_paged_decode_case():
    """The fast set's check of flex_paged (eager FlexAttention takes ~0.1 s a call here: its whole matrix, the paged
    cases included, is in the slow set, as flex's is: tests/test_check.py)."""
    case = next(c for c in cases(["paged_decode"]) if c.dtype == "float64" and c.shape.id == "paged_mqa_window")
    result = run_case("flex_paged", case)
    assert result.status == "pass", result.message
    assert "pages scattered in 3 of 3 sequences" in result.message


@pytest.mark.parametrize("impl", ["paged_sdpa"])  # flex_paged: its whole matrix in tests/test_check.py (slow set)
def test_paged_decode_check_passes_with_shuffled_pages_and_different_lengths(impl, matrix_results):
    df = matrix_results([impl], kinds=["paged_decode", "decode"])
    paged = df[df.kind == "paged_decode"]
    assert len(paged) == 2 * len(paged_check.PAGED_SHAPES) and (paged.status == "pass").all(), paged.message.tolist()
    assert paged.message.str.contains("pages scattered in 3 of 3 sequences").all(), paged.message.tolist()
    ran = df[(df.kind == "decode") & (df.status != "skip")]
    assert not ran.empty and (ran.status == "pass").all(), ran.message.tolist()


def test_contiguous_caches_skip_the_paged_case(matrix_results):
    df = matrix_results(["kv_prealloc"], kinds=["paged_decode"])
    assert (df.status == "skip").all()
    assert df.message.str.contains("not a paged cache|sliding windows").all(), df.message.tolist()


def test_block_table_read_one_page_late_is_flagged_by_the_paged_case_only(repo_cwd, matrix_results):
    df = matrix_results([PLUGIN], kinds=["paged_decode", "decode"])
    bad = df[df.status.isin(BAD)]
    assert not bad.empty and set(bad.kind) == {"paged_decode"}, df[["kind", "status", "message"]].to_string()
    assert bad.message.str.startswith("paged decode (page size 4, prompts 5/11/2").all(), bad.message.tolist()
    assert bad.message.str.contains(r"sequence \d, (?:prefill|decoded token|chunk)").all(), bad.message.tolist()
    assert (df[df.kind == "decode"].status != "fail").all()


@pytest.mark.parametrize("impl", PAGED)
def test_pages_are_shuffled_in_one_pool_and_the_cache_is_the_pool(impl):
    m = _module(impl, 4)
    with torch.no_grad():
        m(torch.randn(3, 10, 16, dtype=torch.float64), use_cache=True, lengths=[10, 7, 3])
    s = m.page_stats()
    assert [len(t) for t in s["block_tables"]] == [3, 2, 1]
    assert (s["pages"], s["slots"], s["tokens"]) == (6, 24, 20)
    flat = [p for t in s["block_tables"] for p in t]
    assert sorted(flat) == list(range(6)) and flat != sorted(flat)  # every pool page used once, not in order
    assert sum(t.untyped_storage().nbytes() for t in m.cache_tensors()) == 2 * 6 * 4 * 2 * 4 * 8


def test_flex_paged_reads_the_pages_as_the_gather_does():
    """Fast: a varlen prefill, a chunk and decode steps at different positions through both paged caches agree (the
    float64 reference of each is the paged-decode check's, in the slow set for flex_paged)."""
    sdpa, flex = _module("paged_sdpa", 3, window=6), _module("flex_paged", 3, window=6)
    flex.load_state_dict(sdpa.state_dict())
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    calls = [(x[:, :5], [5, 2]), (x[:, 5:8], [3, 1]), (x[:, 8:9], [1, 1]), (x[:, 9:10], [1, 0])]
    with torch.no_grad():
        for part, lengths in calls:
            a, b = sdpa(part, use_cache=True, lengths=lengths), flex(part, use_cache=True, lengths=lengths)
            torch.testing.assert_close(b, a)
    assert flex.page_stats()["tokens"] == sdpa.page_stats()["tokens"]


def test_a_windowed_paged_cache_gives_back_the_pages_that_left_the_window():
    m = _module("paged_sdpa", 4, window=5)
    with torch.no_grad():
        m(torch.randn(2, 30, 16, dtype=torch.float64), use_cache=True)
    s = m.page_stats()
    assert s["pages"] <= 2 * (math.ceil(5 / 4) + 1), s  # the window rounded up to pages, per sequence
    assert s["pool_pages"] <= 2 * (math.ceil((2 * 5 - 1) / 4) + 1), s  # chunks of the window: never the whole prefill
    m.rewind_cache(1)
    with pytest.raises(ValueError, match="left the window"):
        m.rewind_cache(10)


def test_outputs_past_a_rows_length_are_zero_and_bad_lengths_are_refused():
    m = _module("paged_sdpa", 3)
    with torch.no_grad():
        out = m(torch.randn(2, 4, 16, dtype=torch.float64), use_cache=True, lengths=[4, 1])
    assert out[1, 1:].abs().max() == 0 and out[1, 0].abs().max() > 0
    with pytest.raises(Exception, match="lengths"):
        m(torch.randn(2, 2, 16, dtype=torch.float64), use_cache=True, lengths=[3, 1])


def test_page_size_is_a_decode_axis_of_the_cell_and_its_group():
    assert "page_size" in AXES and {"page_size", "pages", "page_fragmentation"} <= set(COLUMNS)
    sweep = Sweep(impl=("sdpa_cache", "paged_sdpa"), mode=("decode", "inference"), page_size=(16, 64))
    cells = sweep.cells()
    decode = [c for c in cells if c.mode == "decode"]
    assert sorted({c.page_size for c in decode}) == [16, 64] and len(decode) == 4
    assert all(c.page_size == 0 for c in cells if c.mode == "inference") and len(cells) == 6
    assert {c.group_id.endswith("|page16") for c in decode} == {True, False}
    assert parse_page_sizes("none,16") == (0, 16) and parse_page_sizes([16, 64]) == (16, 64)
    with pytest.raises(SweepError, match="page-size"):
        parse_page_sizes("sixteen")
    with pytest.raises(SweepError, match="add decode to --mode"):
        Sweep(impl=("paged_sdpa",), mode=("inference",), page_size=(16,))


def test_a_paged_decode_cell_records_pages_and_fragmentation():
    cell = Cell("paged_sdpa", batch=2, seq_len=10, num_heads=2, d_model=16, mode="decode", page_size=4)
    w = build_workload(cell)
    assert w.columns == {"pages": 6.0, "page_fragmentation": 2 / 12}
    assert w.kv_cache_bytes == 2 * 6 * 4 * 2 * 8 * 4  # the pool: k and v, 6 pages of 4 slots, 2 heads of 8, float32
    assert any("4-token pages" in n for n in w.notes)
    assert w.check_output(w.step()) is None
    contiguous = build_workload(Cell("sdpa_cache", batch=2, seq_len=10, num_heads=2, d_model=16, mode="decode",
                                     page_size=4))
    assert contiguous.columns == {} and any("names the comparison group only" in n for n in contiguous.notes)


def test_a_paged_cache_without_a_page_size_is_skipped_with_the_reason():
    with pytest.raises(UnavailableError, match="--page-size"):
        build_workload(Cell("paged_sdpa", batch=1, seq_len=8, num_heads=2, d_model=16, mode="decode"))


@pytest.mark.parametrize("impl", ["rope_sdpa", "rope_math"])
def test_rope_caches_hold_the_window_not_every_token(impl):
    cell = Cell(impl, batch=1, seq_len=32, num_heads=4, d_model=32, mode="decode", num_kv_heads=2, window=8)
    w = build_workload(cell)
    assert w.kv_cache_bytes == kv_cache_bytes_analytic(1, 32, 2, 8, 8, 4)
    full = build_workload(Cell(impl, batch=1, seq_len=32, num_heads=4, d_model=32, mode="decode", num_kv_heads=2))
    assert full.kv_cache_bytes >= 4 * w.kv_cache_bytes


def test_paged_decode_preset_has_paged_and_contiguous_in_every_page_size():
    sweep = sweep_from_dict(load_preset("paged-decode"), "paged-decode")
    cells = sweep.cells()
    assert sorted({c.page_size for c in cells}) == [16, 64, 256]
    for page in (16, 64, 256):
        assert {c.impl for c in cells if c.page_size == page} == {"sdpa_cache", "kv_prealloc", "paged_sdpa", "flex_paged"}
    assert sweep.baseline == "sdpa_cache"


def _row(impl: str, page_size: int, median: float, pages=float("nan"), speedup=float("nan"), lo=float("nan"),
         hi=float("nan")) -> dict:
    from attnbench.results.schema import empty_row

    cell = Cell(impl, batch=2, seq_len=300, num_heads=4, d_model=64, mode="decode", page_size=page_size)
    return {**empty_row(cell, "r"), "status": "ok", "median_s": median, "baseline": "sdpa_cache", "speedup": speedup,
            "speedup_ci_low": lo, "speedup_ci_high": hi, "pages": pages, "page_fragmentation": 0.25,
            "kv_cache_bytes": 1000.0 if pages != pages else 1200.0}


def test_report_sets_each_paged_row_against_the_contiguous_baseline_of_its_page_size():
    import pandas as pd

    from attnbench.report import analysis as an
    from attnbench.report import paged as paged_view
    from attnbench.report import variants

    df = an.prepare(pd.DataFrame([_row("sdpa_cache", 16, 1e-3, speedup=1.0, lo=1.0, hi=1.0),
                       _row("paged_sdpa", 16, 2e-3, pages=8.0, speedup=0.5, lo=0.4, hi=0.625),
                       _row("sdpa_cache", 64, 1.1e-3, speedup=1.0, lo=1.0, hi=1.0),
                       _row("paged_sdpa", 64, 3e-3, pages=2.0, speedup=0.25, lo=0.2, hi=0.5)]))
    t = paged_view.table(df).set_index("page_size")
    assert t.loc[16, "cost"] == pytest.approx(2.0) and (t.loc[16, "cost_low"], t.loc[16, "cost_high"]) == (1.6, 2.5)
    assert t.loc[64, "cost"] == pytest.approx(4.0) and t.loc[64, "contiguous"] == "sdpa_cache"
    shown = paged_view.display(paged_view.table(df))
    assert shown["paged / contiguous"].tolist() == ["2.00× (1.60–2.50)", "4.00× (2.00–5.00)"]
    lines = variants._decode(df)  # a line per page size for the paged cache, one line for the contiguous one
    assert sorted(lines["variant"]) == ["MHA", "MHA p16", "MHA p64"]


def test_asv_suite_times_a_paged_decode_cell(single_thread, repo_cwd, monkeypatch):
    import importlib

    monkeypatch.syspath_prepend(str(repo_cwd))
    suite = importlib.import_module("benchmarks.bench_attention")
    monkeypatch.setattr(suite, "_lock_machine", lambda: None)  # not timed here: no need to wait for the machine's lock
    bench = suite.PagedDecode()
    bench.setup("paged_sdpa", 16, 512)
    try:
        bench.time_step("paged_sdpa", 16, 512)
        assert bench.workload.cell.page_size == 16 and bench.workload.columns["pages"] == 2 * 32
        assert bench.track_kv_cache_bytes("paged_sdpa", 16, 512) == 2 * 2 * 32 * 16 * 2 * 64 * 4
    finally:
        bench.teardown("paged_sdpa", 16, 512)
