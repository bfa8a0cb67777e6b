"""Issue 37: packed variable-length batches (the lengths axis, five implementations, the varlen cases, FLOPs of the real
lengths) and the setup cost measured apart (prepare / prepared=, setup_s, setup_policy)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import attnbench
from attnbench import registry
from attnbench.correctness.matrix import cases, run_case
from attnbench.errors import SweepError
from attnbench.measure.flops import analytic_flops
from attnbench.results.schema import Cell
from attnbench.runner import setup, varlen
from attnbench.runner.sweep import Sweep, load_preset, sweep_from_dict
from attnbench.runner.workload import build_workload

pytestmark = pytest.mark.usefixtures("single_thread")

PLUGIN = "tests/plugins/buggy_varlen.py"
IMPLS = ["varlen_padded", "varlen_packed", "varlen_loop", "varlen_nested", "varlen_flex"]
FAST = {"budget_s": 0.05, "warmup_s": 0.0, "warmup_calls": 1, "min_samples": 3, "threads": 1}
TINY = dict(batch=[4], seq_len=[8], num_heads=[2], d_model=[16], mode=["inference"])


# ---------------------------------------------------------------- lengths


@pytest.mark.parametrize("dist", ["constant", "uniform:2-14", "longtail", "bimodal"])
def test_every_distribution_holds_the_token_count_and_is_seeded(dist):
    lengths = varlen.draw_lengths(dist, 16, 32, seed=3)
    assert len(lengths) == 16 and sum(lengths) == 16 * 32 and min(lengths) >= 1
    assert lengths == varlen.draw_lengths(dist, 16, 32, seed=3)
    if dist != "constant":
        assert lengths != varlen.draw_lengths(dist, 16, 32, seed=4) and len(set(lengths)) > 1


def test_longtail_and_bimodal_have_the_shapes_the_docs_say():
    tail = np.array(varlen.draw_lengths("longtail", 64, 100, seed=0))
    assert np.median(tail) < 100 < tail.max() and tail.max() > 3 * 100  # most short, a few several times the mean
    bi = np.sort(varlen.draw_lengths("bimodal", 10, 100, seed=0))
    assert bi[-2] > 2.5 * bi[-3]  # two long ones (20% of 10), far above the short ones
    assert varlen.draw_lengths("constant", 3, 7) == (7, 7, 7)


def test_a_file_of_lengths_is_used_in_order_or_drawn_from(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("3, 5\n8 4")
    assert varlen.draw_lengths(str(f), 4, 5) == (3, 5, 8, 4)  # exactly batch lengths, mean 5: as given
    drawn = varlen.draw_lengths(str(f), 6, 5, seed=1)
    assert sum(drawn) == 30 and len(drawn) == 6


@pytest.mark.parametrize("bad", ["gaussian", "uniform:9-3", "uniform:0-4"])
def test_an_unknown_distribution_is_a_one_line_error(bad):
    with pytest.raises(SweepError, match="--lengths"):
        varlen.parse_lengths(bad)


def test_the_lengths_axis_is_part_of_the_cell_and_the_group():
    sweep = sweep_from_dict({"sweep": {"impl": ["varlen_padded", "varlen_packed"], "lengths": ["none", "longtail"]}})
    cells = sweep.cells()
    assert sorted({c.lengths for c in cells}) == ["", "longtail"]
    long = [c for c in cells if c.lengths]
    assert len({c.group_id for c in long}) == 1 and long[0].group_id.endswith("|lengths=longtail")
    assert "lengths" not in Cell("sdpa").group_id  # rectangular cells keep the keys they had


# ---------------------------------------------------------------- implementations, skips, FLOPs


def test_varlen_and_rectangular_implementations_skip_each_others_cells():
    cell = Cell("sdpa", lengths="longtail")
    assert "does not support variable-length batches" in registry.resolve("sdpa", cell).reason
    assert "runs cells with --lengths" in registry.resolve("varlen_packed", Cell("varlen_packed")).reason
    assert registry.resolve("varlen_packed", Cell("varlen_packed", lengths="longtail")).reason is None
    assert "varlen_packed" in registry.available("cpu")


def test_every_layout_computes_the_same_real_tokens():
    cell = Cell("varlen_loop", batch=3, seq_len=6, num_heads=2, d_model=16, mode="inference", lengths="longtail")
    outs = []
    for impl in ["varlen_padded", "varlen_packed", "varlen_loop", "varlen_flex"]:
        w = build_workload(Cell(**{**cell.as_dict(), "impl": impl}), seed=5)
        out = w.step()
        assert w.check_output(out) is None
        outs.append(w.real_tokens(out))
    assert outs[0].shape == (18, 16)
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], rtol=1e-5, atol=1e-5)


def test_flops_count_the_real_lengths_not_the_padding():
    cell = Cell("varlen_padded", batch=4, seq_len=16, num_heads=2, d_model=16, mode="inference", lengths="longtail")
    w = build_workload(cell, seed=0)
    lengths = w.parts.lengths
    want = sum(analytic_flops(1, n, 16, 16, "inference", num_heads=2) for n in lengths)
    assert w.analytic_flops() == want < analytic_flops(4, max(lengths), 16, 16, "inference", num_heads=2)
    cols = w.extra_columns(1e-3)
    assert cols["tokens"] == 64 and cols["lengths_max"] == max(lengths) and cols["flops_count"] == "real-lengths"
    assert 0 < cols["padding_frac"] < 1


def test_nested_causal_is_skipped_with_pytorchs_reason():
    result = run_case("varlen_nested", next(c for c in cases(["varlen"]) if c.shape.id == "varlen_causal"))
    assert result.status == "skip" and "PyTorch's nested-tensor SDPA" in result.message
    assert "is_causal" in result.message  # PyTorch's own words on why no kernel runs it


# ---------------------------------------------------------------- correctness


def test_every_builtin_passes_or_skips_the_varlen_cases_and_rectangular_ones_skip_them():
    for impl in IMPLS + ["sdpa"]:
        for case in cases(["varlen"]):
            r = run_case(impl, case)
            assert r.status in ("pass", "skip"), (impl, case.shape.id, case.dtype, r.message)
            if impl == "sdpa":
                assert r.status == "skip"
            elif impl != "varlen_nested":
                assert r.status == "pass"


@pytest.mark.usefixtures("plugins_on_path")
@pytest.mark.parametrize("cls, shape, words", [
    ("LeakyDocumentMask", "varlen_causal", "document 1 sees document 0: its token 0"),
    ("PaddingLeaks", "varlen_noncausal", "padding rows leak into the output: sequence 0"),
])
def test_planted_bugs_are_flagged_by_the_case_they_break(cls, shape, words):
    case = next(c for c in cases(["varlen"]) if c.shape.id == shape and c.dtype == "float64")
    result = run_case(f"{PLUGIN}:{cls}", case)
    assert result.status == "fail" and words in result.message
    base = "PaddedBaseline" if cls == "PaddingLeaks" else "PackedBaseline"
    assert run_case(f"{PLUGIN}:{base}", case).status == "pass"


# ---------------------------------------------------------------- setup cost


def test_setup_policy_decides_whether_the_timed_call_prepares():
    calls = []

    class Counting(torch.nn.Module):
        def prepare(self, x, **ctx):
            calls.append("prepare")
            return "state"

        def forward(self, x, prepared=None, **ctx):
            calls.append(prepared or self.prepare(x))
            return x

    call, prep = setup.bind(Counting(), torch.ones(1), "once")
    assert calls == ["prepare"]  # once: before timing
    call()
    assert calls == ["prepare", "state"]  # the timed call only attends
    calls.clear()
    call, prep = setup.bind(Counting(), torch.ones(1), "per-call")
    call()
    assert calls == ["prepare", "state"] and prep is not None  # per-call: the forward prepares itself
    with pytest.raises(SweepError, match="per-call nor once"):
        setup.check_policy("twice")
    assert math.isnan(setup.columns(None, torch.device("cpu"), "once")["setup_s"])


def test_a_run_records_setup_apart_and_the_packed_speedup_over_padded(tmp_path):
    df = attnbench.run(impl=["varlen_padded", "varlen_packed", "varlen_loop", "varlen_nested"], out=tmp_path,
                       settings={**FAST, "baseline": "varlen_padded", "setup": "once"},
                       **{**TINY, "lengths": ["longtail"]})
    rows = df.set_index("impl")
    assert rows.loc["varlen_nested", "status"] == "skipped" and "nested-tensor SDPA" in rows.loc["varlen_nested", "error"]
    ok = rows[rows.status == "ok"]
    assert len(ok) == 3 and (ok.tokens == 32).all() and (ok.setup_policy == "once").all()
    assert ok.loc[["varlen_padded", "varlen_packed"], "setup_s"].gt(0).all() and math.isnan(ok.loc["varlen_loop", "setup_s"])
    assert ok.flops.nunique() == 1  # equal work credited to every layout
    assert rows.loc["varlen_padded", "speedup"] == 1.0 and rows.loc["varlen_packed", "speedup_ci_low"] > 0
    assert (ok.error_rel < 1e-4).all()  # each sequence against its own float64 reference


def test_lengths_without_impl_picks_the_varlen_implementations():
    from attnbench.runner.engine import make_sweep

    sweep = make_sweep(lengths="bimodal", batch="2", seq_len="8", d_model="16", num_heads="2")
    assert set(sweep.impl) == set(IMPLS)


def test_the_preset_holds_equal_tokens_and_names_its_baseline():
    data = load_preset("varlen-longtail")
    sweep = sweep_from_dict(data, "varlen-longtail")
    assert isinstance(sweep, Sweep) and sweep.settings.baseline == "varlen_padded"
    assert {"varlen_padded", "varlen_packed", "varlen_loop"} <= set(sweep.impl) and "longtail" in sweep.lengths
