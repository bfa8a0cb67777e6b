"""Sweeps, rows and reports with RoPE / QK-norm / scale / softcap (issue 26): the positional axis, its flags and TOML
keys, the llama3 preset, and the report's KV-cache bytes per token."""

import pytest

from attnbench import registry
from attnbench.cli.run import run_cmd
from attnbench.errors import SweepError
from attnbench.report import analysis as an
from attnbench.report.variants import cache_per_token
from attnbench.results.schema import Cell
from attnbench.results.store import RunStore, load_run
from attnbench.runner.engine import make_sweep
from attnbench.runner.positional import compose, parse_positional
from attnbench.runner.sweep import sweep_from_dict
from attnbench.runner.workload import spec_for
from attnbench.spec import RopeScaling
from tests.sample_runs import ok_row

LLAMA3 = "rope_theta=500000;rope_scaling=llama3"


def test_flags_and_toml_keys_compose_one_canonical_positional_value():
    assert compose({"rope_scaling": "llama3", "rope_theta": 500000.0}) == LLAMA3  # the spec's order, one spelling
    assert compose({"rope_theta": None}) is None
    assert compose({"qk_norm": "head", "score_scale": 0.125, "softcap": 30.0}) == "qk_norm=head;scale=0.125;softcap=30"
    data = {"sweep": {"impl": ["rope_math"], "rope_theta": 10000, "qk_norm": "full", "kv_heads": 2}}
    assert sweep_from_dict(data).positional == ("rope_theta=10000;qk_norm=full",)
    assert parse_positional(["none", "rope_theta=1e4"]) == ("", "rope_theta=10000")
    with pytest.raises(SweepError, match="qk_norm"):
        parse_positional("qk_norm=layer")
    with pytest.raises(SweepError, match="needs rope_theta"):
        compose({"rope_scaling": "llama3"})
    flags = {p.name for p in run_cmd.params}
    assert {"rope_theta", "rope_style", "rope_scaling", "qk_norm", "norm_eps", "score_scale", "softcap"} <= flags


def test_a_positional_cell_builds_its_spec_and_skips_what_does_not_declare_it():
    cell = Cell("rope_sdpa", seq_len=16, num_heads=4, d_model=64, mode="decode", num_kv_heads=2,
                positional=LLAMA3 + ";qk_norm=head")
    spec = spec_for(cell)
    assert (spec.rope_theta, spec.rope_scaling, spec.qk_norm, spec.context_length) == (5e5, RopeScaling(), "head", 17)
    assert cell.group_id.endswith("|kv2|" + LLAMA3 + ";qk_norm=head")
    assert registry.resolve("rope_sdpa", cell).reason is None
    assert "rotary position embeddings" in registry.resolve("sdpa_cache", cell).reason


def test_llama3_preset_sweeps_the_rope_family_with_gqa():
    sweep = make_sweep(preset="llama3")
    assert set(sweep.impl) == {"rope_sdpa", "rope_math"} and sweep.positional == (LLAMA3,)
    assert sweep.num_heads == (8,) and sweep.d_model == (512,) and 2 in sweep.num_kv_heads  # head_dim 64, 4:1 GQA
    assert set(sweep.mode) == {"inference", "decode"}
    assert make_sweep(preset="default").positional == ("",)


def test_report_compares_cache_bytes_per_token_across_variants(tmp_path):
    store = RunStore(tmp_path, run_id="per-token", meta={})
    for kv, window, impl in ((4, None, "rope_sdpa"), (2, None, "rope_sdpa"), (1, None, "rope_sdpa"), (4, 64, "kv_rolling")):
        for T in (128, 256):
            cell = Cell(impl, batch=2, seq_len=T, num_heads=4, d_model=256, mode="decode", num_kv_heads=kv,
                        window=window, positional="" if window else LLAMA3)
            store.append(ok_row(cell, [1e-4] * 5, kv_cache_bytes=2.0 * 2 * min(T, window or T) * kv * 64 * 4))
    store.finalize()
    table = cache_per_token(an.prepare(load_run(store.path)[0]))
    got = {(r.impl, r.variant): (r.T, r.bytes_per_token, r.of_mha) for r in table.itertuples()}
    assert got[("rope_sdpa", "MHA")] == (256, 2 * 256 * 4, 1.0)  # K and V of every head: 2·d_model floats
    assert got[("rope_sdpa", "GQA(2)")][2] == 0.5 and got[("rope_sdpa", "MQA")][2] == 0.25
    assert got[("kv_rolling", "SWA(64)")][2] == 0.25  # 64 of 256 tokens held
    assert set(table.positional) == {LLAMA3, ""}
