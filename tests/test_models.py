"""Attention in its model (issue 27): the scope axis, the model zoo, generation, attention's share, scope checks."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from attnbench import registry
from attnbench.correctness.matrix import cases, run_case
from attnbench.errors import SweepError
from attnbench.implementations.gqa import _factory
from attnbench.implementations.kv_cache import GrowingCache
from attnbench.models.check import TINY, check_generation, check_output
from attnbench.models.generate import Phases, first_divergence, rescaled_rates
from attnbench.models.scope import scope_cells
from attnbench.models.workload import build_scope_workload, forward_flops, shape_of
from attnbench.models.zoo import attention_modules
from attnbench.results.schema import Cell
from attnbench.runner.engine import make_sweep
from attnbench.runner.group import run_group
from attnbench.runner.sweep import Settings, Sweep


class StaleLongCache(GrowingCache):
    """A planted cache bug: once the cache holds 16 tokens, a decoded token's key and value are not stored, so it
    attends over the older tokens only. The layer's decode check never caches 16 tokens, so it passes there."""

    def _update(self, k, v):
        if self.pos >= 16 and k.shape[2] == 1:
            return self.cache_k, self.cache_v, None
        return super()._update(k, v)


@pytest.fixture
def stale_cache(isolated_registry):
    isolated_registry.register("stale_cache", _factory(StaleLongCache), description="drops tokens past 16", gqa=True,
                               kv_cache=True)
    return isolated_registry.get("stale_cache")


def tiny(impl: str, mode: str, scope: str = "model", **kw) -> Cell:
    model = scope == "model"
    return Cell(impl, batch=2, seq_len=kw.pop("seq_len", 8), num_heads=2, d_model=16, mode=mode, scope=scope,
                layers=2 if model else 0, vocab=32 if model else 0,
                new_tokens=kw.pop("new_tokens", 6) if mode.startswith("generate") else 0, **kw)


class TestScopeAxis:
    def test_layer_cells_keep_their_ids(self):
        sweep = Sweep(impl=("sdpa",), seq_len=(64,), mode=("inference",))
        [cell] = sweep.cells()
        assert cell.scope == "layer" and cell.cell_id == "sdpa|cpu|float32|b2|T64|h4|d256|inference|warm"

    def test_generate_expands_to_cache_on_and_off_at_model_scope_only(self):
        sweep = Sweep(impl=("sdpa",), mode=("generate", "inference"), scope=("layer", "model"), layers=(2,), vocab=(64,),
                      new_tokens=(5,))
        got = {(c.scope, c.mode) for c in sweep.cells()}
        assert got == {("layer", "inference"), ("model", "inference"), ("model", "generate-cache"),
                       ("model", "generate-nocache")}
        gen = next(c for c in sweep.cells() if c.mode == "generate-cache")
        assert gen.group_id.endswith("|model|L2|V64|M5") and gen.attention_mode == "decode"

    @pytest.mark.parametrize(("scope", "mode", "says"), [("layer", "generate", "--scope model"),
                                                         ("block", "train,generate", "--scope model"),
                                                         ("layer", "train", "--scope block or model"),
                                                         ("model", "decode", "use --mode generate"),
                                                         ("tower", "inference", "unknown scope")])
    def test_modes_a_scope_lacks_are_user_errors(self, scope, mode, says):
        with pytest.raises(SweepError, match=says):
            make_sweep(impl="sdpa", scope=scope, mode=mode)

    def test_block_cells_have_no_model_shape(self):
        [cell] = scope_cells(Cell("sdpa", mode="train"), "block", (2,), (64,), (5,))
        assert (cell.layers, cell.vocab, cell.new_tokens) == (0, 0, 0) and cell.group_id.endswith("|block")


class TestModelZoo:
    def test_surroundings_are_the_same_for_every_implementation(self):
        a = build_scope_workload(tiny("weight_split", "inference")).module
        b = build_scope_workload(tiny("sdpa", "inference")).module
        pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
        outside = [n for n in pa if ".attn." not in f".{n}"]
        assert len(outside) > 10 and all(torch.equal(pa[n], pb[n]) for n in outside)
        assert len(attention_modules(a)) == 2

    def test_grouped_query_cells_get_the_llama_block(self):
        w = build_scope_workload(tiny("kv_concat", "inference", scope="block", num_kv_heads=1))
        assert isinstance(w.module.norm1, torch.nn.RMSNorm) and hasattr(w.module.ff, "w3")
        assert isinstance(build_scope_workload(tiny("sdpa", "inference", scope="block")).module.norm1, torch.nn.LayerNorm)

    @pytest.mark.parametrize("mode", ["inference", "forward+backward", pytest.param("train", marks=pytest.mark.slow),
                                      "generate-nocache", "generate-cache"])
    def test_every_mode_gives_a_valid_output(self, mode):
        w = build_scope_workload(tiny("kv_concat", mode))
        assert w.check_output(w.step()) is None

    @pytest.mark.slow
    def test_a_training_step_changes_the_weights(self):
        w = build_scope_workload(tiny("sdpa", "train", scope="block"))
        before = w.module.attn.out_proj.weight.detach().clone() if hasattr(w.module.attn, "out_proj") else None
        first = next(iter(w.module.ff.parameters())).detach().clone()
        w.step()
        assert not torch.equal(first, next(iter(w.module.ff.parameters())))
        assert before is None or not torch.equal(before, w.module.attn.out_proj.weight)

    def test_model_flops_add_the_mlp_and_head_to_the_layers(self):
        c = tiny("sdpa", "inference")
        s = shape_of(c)
        mlp_and_head = 2 * c.batch * c.seq_len * (8 * c.d_model ** 2 * s.layers + c.d_model * s.vocab)
        from attnbench.measure.flops import analytic_flops

        attn = analytic_flops(c.batch, c.seq_len, c.d_model, c.d_model, "inference", num_heads=c.num_heads)
        assert forward_flops(c, s, c.seq_len, "inference") == pytest.approx(s.layers * attn + mlp_and_head)


class TestGeneration:
    def test_first_divergence_names_step_row_and_tokens(self):
        a = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
        b = torch.tensor([[1, 2, 3, 4], [5, 6, 9, 8]])
        d = first_divergence(a, b, prompt_len=10)
        assert (d.step, d.row, d.token_a, d.token_b, d.position) == (3, 1, 7, 9, 12)
        assert first_divergence(a, a.clone(), 10) is None

    def test_phase_columns_split_the_median_by_the_prefill_fraction(self):
        p = Phases(batch=2, prompt=10, new_tokens=5, ttft_s=[0.1, 0.2, 0.1], total_s=[1.0, 1.0, 0.5])
        cols = p.columns(2.0)  # median prefill fraction 0.2
        assert cols["ttft_s"] == pytest.approx(0.4)
        assert cols["prefill_tokens_per_s"] == pytest.approx(20 / 0.4)
        assert cols["decode_tokens_per_s"] == pytest.approx(8 / 1.6)
        assert cols["end_to_end_tokens_per_s"] == pytest.approx(5.0)
        assert rescaled_rates({"median_s": 2.0, **cols}, 4.0)["end_to_end_tokens_per_s"] == pytest.approx(2.5)

    @pytest.mark.slow
    def test_the_planted_cache_bug_survives_the_layer_check(self, stale_cache):
        layer = [run_case(stale_cache, c) for c in cases(["decode"])]
        assert {r.status for r in layer} <= {"pass", "skip"} and any(r.status == "pass" for r in layer)

    def test_a_planted_cache_bug_is_caught_in_generation_with_its_step(self, stale_cache):
        result = check_generation(stale_cache, TINY, torch.device("cpu"), "float64")
        assert result.status == "fail"
        assert "first differing token at step" in result.message and "with the cache generated" in result.message
        step = int(result.message.split("at step ")[1].split()[0])
        # 5 prompt tokens: step s's logits come from the call at position s + 3, the first past 16 cached is step 13
        assert step >= 13 and "logits with the cache differ from without it from step 13 " in result.message

    def test_correct_caches_pass_every_scope_check(self):
        impl = registry.get("kv_concat")
        cpu = torch.device("cpu")
        assert check_generation(impl, TINY, cpu, "float64").status == "pass"
        for scope in ("block", "model"):
            r = check_output(impl, scope, TINY, cpu, "float32")
            assert r.status == "pass" and r.error < 1e-5, r


class TestMeasuredRows:
    @pytest.mark.slow
    def test_a_generate_group_reports_tokens_per_second_and_attention_share(self):
        cells = [tiny(i, m, new_tokens=4) for m in ("generate-cache", "generate-nocache") for i in ("weight_split", "kv_concat")]
        settings = Settings(budget_s=0.05, min_samples=3, warmup_calls=1, warmup_s=0.0, flop_check=False)
        rows = {}
        for mode in ("generate-cache", "generate-nocache"):
            group = [c for c in cells if c.mode == mode]
            for r in run_group(group, settings, "t", baseline="kv_concat"):
                rows[(r["impl"], mode)] = r
        assert rows[("weight_split", "generate-cache")]["status"] == "skipped"
        assert "KV cache" in rows[("weight_split", "generate-cache")]["error"]
        on = rows[("kv_concat", "generate-cache")]
        assert on["status"] == "ok" and on["kv_cache_bytes"] > 0 and 0 < on["ttft_s"] < on["median_s"]
        assert on["end_to_end_tokens_per_s"] == pytest.approx(2 * 4 / on["median_s"])
        off = rows[("weight_split", "generate-nocache")]
        assert off["status"] == "ok" and 0 < off["attn_share"] < 1 and off["attn_share_low"] <= off["attn_share_high"]
        assert math.isfinite(off["speedup"]) and rows[("kv_concat", "generate-nocache")]["speedup"] == 1.0


    def test_a_long_generation_takes_its_attention_share_from_its_first_call(self, monkeypatch):
        """Issue 39: the share pass would repeat a 90-second generation three times; the first call, made with the
        attention clock on, stands for it when the call is long (and only then)."""
        from attnbench.measure import long_call
        from attnbench.runner.workload import build_workload

        passes = []
        monkeypatch.setattr("attnbench.models.workload.attention_share",
                            lambda *a, **k: passes.append(1) or {"attn_share": 0.5})
        w = build_workload(tiny("kv_concat", "generate-nocache", new_tokens=3))
        assert w.check_output(w.first_call()) is None and 0 < w.first_share < 1
        cols = w.extra_columns(median_s=long_call.LONG_CALL_S)
        assert cols["attn_share"] == cols["attn_share_low"] == cols["attn_share_high"] == w.first_share and not passes
        assert any("first call alone" in n for n in w.notes)
        assert w.extra_columns(median_s=0.01)["attn_share"] == 0.5 and passes == [1]  # a short call: the usual pass
        inference = build_workload(tiny("kv_concat", "inference"))
        inference.first_call()
        assert inference.first_share is None  # only a generation observes its first call


class TestViews:
    @staticmethod
    def rows():
        import pandas as pd

        base = dict(status="ok", device="cpu", dtype="float32", batch=2, num_heads=4, d_model=64, num_kv_heads=4,
                    baseline="sdpa", layers=0, vocab=0, new_tokens=0, seq_len=256)
        rows = []
        for scope, speedup in (("layer", 2.1), ("block", 1.3), ("model", 1.1)):
            rows.append({**base, "impl": "flash", "scope": scope, "mode": "inference", "speedup": speedup})
            rows.append({**base, "impl": "sdpa", "scope": scope, "mode": "inference", "speedup": 1.0})
        for mode, rate in (("generate-cache", 300.0), ("generate-nocache", 100.0)):
            rows.append({**base, "impl": "kv_concat", "scope": "model", "mode": mode, "speedup": float("nan"),
                         "layers": 2, "vocab": 64, "new_tokens": 8, "end_to_end_tokens_per_s": rate})
        return pd.DataFrame(rows)

    def test_the_amdahl_view_lines_up_layer_block_and_model(self):
        from attnbench.models.views import scope_sentences, scope_speedups

        table = scope_speedups(self.rows())
        assert len(table) == 1 and list(table[["layer", "block", "model"]].iloc[0]) == [2.1, 1.3, 1.1]
        assert scope_sentences(self.rows()) == [
            "flash vs sdpa, inference b=2 T=256 d=64: 2.10x as a layer, 1.30x in the block, 1.10x in the model"]

    def test_the_cache_factor_is_cached_over_uncached_tokens_per_second(self):
        from attnbench.models.views import cache_factors

        [factor] = cache_factors(self.rows())["factor"]
        assert factor == pytest.approx(3.0)


@pytest.mark.slow
def test_a_run_across_scopes_reports_in_the_model(tmp_path):
    import attnbench
    from attnbench.report.page import build_report

    df = attnbench.run(impl=["weight_split", "sdpa"], seq_len=[16], batch=[1], num_heads=[2], d_model=[16],
                       mode=["inference"], scope=["layer", "block"], out=tmp_path / "results", run_id="scopes",
                       settings={"budget_s": 0.05, "threads": 1, "min_samples": 3})
    assert set(df["scope"]) == {"layer", "block"} and (df["status"] == "ok").all()
    assert df.loc[df["scope"] == "block", "attn_share"].between(0, 1).all()
    assert df.loc[df["scope"] == "layer", "attn_share"].isna().all()
    html = build_report(df.attrs["run_dir"], tmp_path / "report").read_text()
    assert "In the model" in html and "model-attention-share" in html
    assert "Paired speed-ups of each implementation as a layer, in the block" in html


@pytest.mark.parametrize("mode", ["generate-cache", "generate-nocache", "train", "inference"])
def test_the_cost_prediction_reads_a_model_cells_own_flop_model(mode):
    """The runner predicts every cell's cost before it runs (runner/budget.py): a model cell's modes have FLOPs of
    their own (attention, MLP, LM head, the generation's steps), not the layer's."""
    from attnbench.models.workload import step_flops
    from attnbench.runner import budget
    from attnbench.runner.sweep import Settings

    cell = Cell("sdpa", "cpu", "float32", 1, 16, 4, 128, mode, "warm", scope="model", layers=2, vocab=512,
                new_tokens=8 if mode.startswith("generate") else 0)
    assert budget.cell_flops(cell) == step_flops(cell) > budget.cell_flops(Cell("sdpa", "cpu", "float32", 1, 16, 4, 128))
    plan = budget.plan_cell(cell, Settings(), None, contextlib.nullcontext)
    assert plan.skip is None and plan.predicted_s > 0 and plan.timeout_s >= budget.floor_s(cell)
