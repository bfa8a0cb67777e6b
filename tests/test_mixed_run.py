"""Issue 48: the mixed serving step as a run axis (``--batch-spec``, a sweep file's ``batch_spec``), its FLOPs over real
tokens and prefill/decode split, the serving preset, and the report's properties and mixed-step tables."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from sample_runs import ok_row

import attnbench
from attnbench.errors import SweepError
from attnbench.report import properties as properties_view
from attnbench.results.schema import Cell
from attnbench.runner import mixed
from attnbench.runner.mixed_workload import build_mixed_workload
from attnbench.runner.sweep import load_preset, sweep_from_dict

pytestmark = pytest.mark.usefixtures("single_thread")

FAST = {"budget_s": 0.05, "warmup_s": 0.0, "warmup_calls": 1, "min_samples": 3, "threads": 1, "accuracy": "on"}
SPEC = "2q8_3q1kv12_q4kv10"  # 2 prefills of 8, 3 decodes over 12, a chunk of 4 over 10
TINY = dict(num_heads=[2], d_model=[16])


def test_the_axis_parses_and_makes_one_cell_per_spec():
    assert mixed.parse_batch_specs("2q1k+32q1s2k, none") == ("2q1k_32q1kv2k", "")
    sweep = sweep_from_dict({"sweep": {"impl": ["paged_sdpa", "sdpa"], "batch_spec": [SPEC], "page_size": 4}})
    cells = sweep.cells()
    assert [c.impl for c in cells] == ["paged_sdpa", "sdpa"]
    c = cells[0]
    assert (c.batch, c.seq_len, c.mode, c.page_size, c.batch_spec) == (6, 12, "inference", 4, SPEC)
    assert "|spec=" + SPEC in c.cell_id
    with pytest.raises(SweepError, match="is not"):
        sweep_from_dict({"sweep": {"impl": ["paged_sdpa"], "batch_spec": "2x5"}})


def test_flops_count_real_tokens_against_a_hand_count():
    d = 16
    # 2 prefills of 8 (causal pairs 8*9/2 = 36 each), 3 decodes over 12 (12 keys each), a chunk of 4 over 10
    # (6 cached: its tokens see 7, 8, 9, 10 keys). Projections: q, k, v, out for each of the 2*8 + 3 + 4 = 23 tokens.
    pairs = 2 * 36 + 3 * 12 + (7 + 8 + 9 + 10)
    hand = 2 * 23 * d * d * 4 + 4 * d * pairs
    requests = mixed.parse_batch_spec(SPEC)
    assert mixed.mixed_flops(requests, d) == hand
    # a window of 3: a prefill of 8 sees 1, 2, 3, 3, ...; a decode and each chunk token see 3
    windowed = 2 * (1 + 2 + 3 * 6) + 3 * 3 + 4 * 3
    assert mixed.mixed_flops(requests, d, window=3) == 2 * 23 * d * d * 4 + 4 * d * windowed
    work = build_mixed_workload(Cell("paged_sdpa", batch=6, seq_len=12, num_heads=2, d_model=d, mode="inference",
                                     page_size=4, batch_spec=SPEC))
    assert work.analytic_flops() == hand  # what a row's flops column holds
    assert [(p.name, p.rows) for p in work.parts] == [("prefill", [0, 1]), ("decode", [2, 3, 4, 5])]


def test_the_step_matches_its_reference_and_restores_its_caches():
    cell = Cell("paged_sdpa", batch=6, seq_len=12, num_heads=2, d_model=16, mode="inference", page_size=4,
                batch_spec=SPEC, dtype="float64")
    work = build_mixed_workload(cell)
    first, again = work.step(), work.step()  # the second step sees the caches the first found
    assert work.check_output(first) is None and torch.equal(first, again)
    out, ref64, _ = work.accuracy_parts(seed=0, output=first)
    assert out.shape == ref64.shape == (23, 16) and torch.allclose(out, ref64, atol=1e-10)
    varlen = build_mixed_workload(Cell("varlen_loop", **{k: getattr(cell, k) for k in (
        "batch", "seq_len", "num_heads", "d_model", "mode", "page_size", "batch_spec", "dtype")}))
    assert torch.allclose(varlen.step(), first, atol=1e-10)  # recomputed without a cache: the same outputs
    assert "recomputes its 39 cached tokens" in varlen.notes[-1]  # 3 decodes x 11 earlier tokens + the chunk's 6


def test_classes_that_cannot_run_the_step_are_skipped_with_the_reason():
    from attnbench.errors import UnavailableError
    from attnbench.registry import resolve
    from attnbench.resolve import Skip

    cell = Cell("sdpa", batch=6, seq_len=12, num_heads=2, d_model=16, mode="inference", page_size=4, batch_spec=SPEC)
    said = resolve("sdpa", cell)
    assert isinstance(said, Skip) and "runs no mixed serving step" in said.reason and "paged KV cache" in said.reason
    assert not isinstance(resolve("varlen_loop", cell), Skip)  # a varlen class takes a mixed cell (not a --lengths one)
    with pytest.raises(UnavailableError, match="contiguous KV cache holds one length"):
        build_mixed_workload(Cell("kv_concat", **{k: getattr(cell, k) for k in (
            "batch", "seq_len", "num_heads", "d_model", "mode", "page_size", "batch_spec")}))


@pytest.mark.slow
def test_run_batch_spec_gives_ok_split_rows_skipped_rows_with_reasons_and_the_report(tmp_path):
    from attnbench.report import build_report
    from attnbench.report.page import ENV_DPI, ENV_FORMATS

    df = attnbench.run(impl=["paged_sdpa", "varlen_padded", "sdpa"], out=tmp_path / "runs",
                       settings={**FAST, "baseline": "paged_sdpa"}, batch_spec=[SPEC, ""], page_size=[4], **TINY)
    rect = df[df.batch_spec.fillna("") == ""].set_index("impl")  # "" in the axis: the rectangular cells too
    assert rect.loc["sdpa", "deterministic"] == "bitwise" and rect.loc["varlen_padded", "status"] == "skipped"
    rows = df[df.batch_spec == SPEC].set_index("impl")
    assert list(rows.status) == ["ok", "ok", "skipped"]  # a row for every implementation asked for
    assert "runs no mixed serving step" in rows.loc["sdpa", "error"]
    ok = rows[rows.status == "ok"]
    assert (ok.batch_spec == SPEC).all() and (ok.tokens == 23).all() and (ok.flops_count == "real-tokens").all()
    assert ok.flops.nunique() == 1 and ok.prefill_s.gt(0).all() and ok.decode_s.gt(0).all()
    assert (ok.prefill_s + ok.decode_s).le(ok.max_s * 1.5).all()  # the parts are of the timed step
    assert (ok.error_rel < 1e-4).all()  # each request's new tokens against its own float64 reference
    assert rows.loc["paged_sdpa", "speedup"] == 1.0 and rows.loc["varlen_padded", "speedup_ci_low"] > 0
    assert ok.deterministic.fillna("").eq("").all()  # not measured on a mixed step: check states them
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_DPI, "72")
        mp.setenv(ENV_FORMATS, "png")
        html = build_report(df.attrs["run_dir"], out_dir=tmp_path / "report").read_text()
    assert 'id="properties"' in html and 'class="nw prop-bitwise">bitwise' in html
    assert 'id="mixed"' in html and SPEC in html and "prefill part" in html


def test_batch_spec_without_impl_picks_the_classes_that_run_it():
    from attnbench.runner.engine import make_sweep

    sweep = make_sweep(batch_spec=SPEC, d_model="16", num_heads="2")
    assert sweep.impl[0] == "paged_sdpa" == sweep.baseline
    assert {"flex_paged", "varlen_padded", "varlen_loop"} <= set(sweep.impl) and "sdpa" not in sweep.impl


def test_the_cli_takes_batch_spec():
    from attnbench.cli.app import cli

    result = CliRunner().invoke(cli, ["run", "--help"])
    assert "--batch-spec" in result.output


def test_the_serving_preset_parses_and_cites_its_lengths():
    data = load_preset("serving")
    sweep = sweep_from_dict(data, "serving")
    assert sweep.settings.baseline == "paged_sdpa" and len(sweep.batch_spec) == 3
    kinds = [{r.kind for r in mixed.parse_batch_spec(s)} for s in sweep.batch_spec]
    assert all(k == {"prefill", "decode"} for k in kinds)  # every step mixes prefills with decodes
    assert len(sweep.cells()) == 3 * len(sweep.impl)


@pytest.mark.slow
def test_every_spec_of_the_serving_preset_runs_at_a_tiny_width(tmp_path):
    specs = list(sweep_from_dict(load_preset("serving"), "serving").batch_spec)
    df = attnbench.run(impl=["paged_sdpa", "varlen_loop"], out=tmp_path, settings={**FAST, "accuracy": "off"},
                       batch_spec=specs, num_heads=[1], d_model=[8], page_size=[64])
    assert len(df) == 2 * len(specs) and (df.status == "ok").all(), df[["impl", "status", "error"]]
    assert (df.decode_s > 0).all() and (df.prefill_s > 0).all()


def test_the_properties_table_states_the_worst_and_colours_each_cell():
    rows = []
    for impl, det, inv in (("sdpa", "bitwise", "bitwise"), ("BatchVariant", "bitwise", "within 1 ulp"),
                           ("Nondeterministic", "differs by 3e-05", "within 2 ulps")):
        for t in (16, 32):
            rows.append(ok_row(Cell(impl, seq_len=t, d_model=32, num_heads=2, mode="inference"), [1e-3, 1.1e-3],
                               deterministic=det, batch_invariant=inv if t == 32 else "bitwise"))
    rows.append(ok_row(Cell("kv_concat", mode="decode"), [1e-3], deterministic="", batch_invariant=""))
    display, raw, classes = properties_view.table(pd.DataFrame(rows))
    assert list(display.columns) == ["implementation", "deterministic", "batch_invariant"]
    cells = {r[0][0]: r[1:] for r in properties_view.cells(display, classes)}
    assert cells["sdpa"] == [("bitwise (2 rows)", "prop-bitwise")] * 2
    assert cells["BatchVariant"][1] == ("within 1 ulp (1/2 rows bitwise)", "prop-ulps")
    assert cells["Nondeterministic"][0] == ("differs by 3e-05 (0/2 rows bitwise)", "prop-differs")
    assert cells["kv_concat"] == [("not measured", "prop-none")] * 2
    assert raw.set_index(["impl", "property"]).loc[("BatchVariant", "batch_invariant"), "rows_measured"] == 2
    assert properties_view.severity("within 2 ulps") > properties_view.severity("within 1 ulp")
    assert properties_view.severity("differs by 1e-06") > properties_view.severity("within 16 ulps")
    empty, _, _ = properties_view.table(pd.DataFrame(rows[-1:]))
    assert empty.empty  # no property measured: no table


@pytest.mark.slow  # torch's first switch to the mode imports Inductor's configuration: seconds
def test_deterministic_prefix_runs_the_base_under_the_deterministic_mode():
    from attnbench import registry
    from attnbench.errors import UnknownImplementationError
    from attnbench.spec import AttnSpec
    from attnbench.weights import random_weights

    spec = AttnSpec(16, 16, 8, 0.0, 2)
    w = random_weights(spec, seed=0)
    base = registry.get("paged_sdpa").build(spec, weights=w).eval()
    det = registry.get("deterministic:paged_sdpa").build(spec, weights=w).eval()
    seen = []
    det._orig_mod.register_forward_pre_hook(lambda m, a: seen.append(torch.are_deterministic_algorithms_enabled()))
    x = torch.randn(2, 8, 16)
    assert torch.equal(det(x), base(x)) and seen == [True]  # the same function, under the mode
    assert not torch.are_deterministic_algorithms_enabled()  # put back after the call
    det.set_page_size(4)  # the base's protocols through the wrapper
    det.reset_cache()
    assert det(x, use_cache=True).shape == (2, 8, 16) and det.page_stats()["tokens"] == 16
    with pytest.raises(UnknownImplementationError):
        registry.get("deterministic:")
