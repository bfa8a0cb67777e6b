"""Hugging Face ``transformers`` attention layers under ``hf:`` names (implementations/hf.py).

transformers imports slowly (several seconds): the layers here are tiny (d_model 16-64, 2-4 heads, T <= 33)
and the full correctness matrix per layer is marked slow.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from attnbench import registry
from attnbench.correctness import matrix
from attnbench.correctness.cases import Shape
from attnbench.correctness.matrix import SHAPES, VARIANT_SHAPES, Case
from attnbench.errors import PluginLoadError, UnavailableError, UnknownImplementationError
from attnbench.implementations import hf
from attnbench.measure import kv_cache_bytes_analytic
from attnbench.results.schema import Cell
from attnbench.runner.workload import build_workload
from attnbench.spec import AttnSpec, RopeScaling
from attnbench.weights import export_weights, random_weights, zero_held

REPO = Path(__file__).resolve().parent.parent

MISSING = hf.transformers_missing()
needs_hf = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
ACCEPTANCE = [f"hf:{m}@{b}" for m in ("gpt2", "llama", "mistral", "bert") for b in ("eager", "sdpa")]
SHAPE = {s.id: s for s in SHAPES + VARIANT_SHAPES + [matrix.PROPERTY_SHAPE] + matrix.DECODE_SHAPES}


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """The layers are tiny: one thread is fastest on a loaded machine."""


# --- without transformers, and the names ----------------------------------------------------------


def test_without_transformers_hf_names_are_unavailable_with_the_install_command(monkeypatch, isolated_registry):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    impl = registry.get("hf:llama@sdpa")
    assert impl.unavailable_reason("cpu") == "transformers is not installed; pip install 'attnbench[hf]'"
    gqa = AttnSpec(32, 32, 16, 0.0, 4, num_kv_heads=2)  # capabilities unknown: the install command is the reason, not GQA
    from attnbench.resolve import resolve

    assert "pip install 'attnbench[hf]'" in resolve(impl, gqa, device="cpu", mode="decode").reason
    with pytest.raises(UnavailableError, match=r"pip install 'attnbench\[hf\]'"):
        impl.build(gqa)
    row = matrix.run_case(impl, Case("forward", SHAPE["gqa"], "float32"))
    assert row.status == "skip" and "pip install 'attnbench[hf]'" in row.message
    assert "hf:bert@eager" in registry.listed() and "hf:bert@eager" not in registry.names()


def test_names_parse_to_module_class_and_backend():
    assert hf.parse("hf:llama") == ("transformers.models.llama.modeling_llama", "LlamaAttention", "sdpa")
    assert hf.parse("hf:gpt2@eager")[1:] == ("GPT2Attention", "eager")
    assert hf.parse("hf:pkg.mod:MyAttention@flex_attention") == ("pkg.mod", "MyAttention", "flex_attention")
    with pytest.raises(UnknownImplementationError, match="unknown attention backend 'fast'.*@eager, @sdpa"):
        hf.parse("hf:llama@fast")
    with pytest.raises(UnknownImplementationError, match="hf:MODEL"):
        hf.parse("hf:nonesuch")
    assert len(hf.names()) == len(hf.MODELS) * len(hf.BACKENDS)


def test_compiled_hf_name_keeps_the_backend_and_splits_only_a_compile_mode(isolated_registry):
    if MISSING:
        pytest.skip(MISSING)
    assert registry.get("compiled:hf:llama@eager").description.startswith("torch.compile(mode='default') of hf:llama@eager")
    assert "mode='max-autotune'" in registry.get("compiled:hf:llama@eager@max-autotune").description


# --- building from the model's config class --------------------------------------------------------


@needs_hf
def test_capabilities_come_from_the_config_class():
    caps = {m: registry.get(f"hf:{m}@sdpa") for m in hf.MODELS}
    assert [(caps[m].gqa, caps[m].sliding_window, caps[m].non_causal) for m in hf.MODELS] == [
        (False, False, False),  # GPT2Config: no kv heads, no window, no is_decoder
        (True, False, False),  # LlamaConfig: num_key_value_heads
        (True, True, False),  # MistralConfig: + sliding_window
        (True, True, False),  # Qwen2Config: + sliding_window (layer_types)
        (False, False, True),  # BertConfig: is_decoder
    ]
    assert all(c.kv_cache and c.same_width_only and c.dropout == ("cpu", "cuda") for c in caps.values())
    eager = registry.get("hf:llama@eager")  # softmax(..., dtype=torch.float32): judged at its working precision
    assert "float64" in eager.dtypes and "float64" in registry.get("hf:gpt2@eager").dtypes
    flash = registry.get("hf:llama@flash_attention_2")
    assert flash.devices == ("cuda",) and flash.unavailable_reason("cpu")
    assert registry.get("hf:llama@flex_attention").dropout == ()


@needs_hf
def test_the_spec_maps_onto_each_config_class():
    from transformers import BertConfig, GPT2Config, MistralConfig, Qwen2Config

    spec = AttnSpec(32, 32, 20, 0.1, 4, True, num_kv_heads=2, window=5)
    mistral = hf.make_config(MistralConfig, spec, "eager")
    assert (mistral.hidden_size, mistral.num_attention_heads, mistral.num_key_value_heads, mistral.head_dim,
            mistral.max_position_embeddings, mistral.attention_dropout, mistral.sliding_window) == (32, 4, 2, 8, 20, 0.1, 5)
    assert mistral._attn_implementation == "eager"
    assert hf.make_config(Qwen2Config, spec, "sdpa").layer_types == ["sliding_attention"]
    assert hf.make_config(Qwen2Config, AttnSpec(32, 32, 20, 0.0, 4), "sdpa").layer_types == ["full_attention"]
    gpt2 = hf.make_config(GPT2Config, AttnSpec(32, 32, 20, 0.1, 4, True), "sdpa")
    assert (gpt2.n_embd, gpt2.n_head, gpt2.n_positions, gpt2.attn_pdrop, gpt2.resid_pdrop) == (32, 4, 20, 0.1, 0.0)
    bert = hf.make_config(BertConfig, AttnSpec(32, 32, 20, 0.1, 4, True, causal=False), "sdpa")
    assert (bert.is_decoder, bert.attention_probs_dropout_prob, bert.hidden_dropout_prob) == (False, 0.1, 0.0)


@needs_hf
@pytest.mark.parametrize("model", list(hf.MODELS))
def test_canonical_weights_load_and_export_both_ways(model):
    spec = AttnSpec(32, 32, 16, 0.0, 4, True)
    w = random_weights(spec, seed=3, dtype=torch.float32)
    module = registry.get(f"hf:{model}@sdpa").build(spec, weights=w)
    back, want = export_weights(module, spec), zero_held(module, w)
    for name, t in want.items():
        assert torch.equal(getattr(back, name), t), name
    if model == "gpt2":  # Conv1D stores (in, out): c_attn is [W_q; W_k; W_v] transposed
        assert module.layer.c_attn.weight.shape == (32, 96)
        assert torch.equal(module.layer.c_attn.weight, torch.cat([w.W_q, w.W_k, w.W_v]).t())
        assert torch.equal(module.layer.c_proj.weight, w.W_o.t())
    held = module.weight_adapter.held_at_zero
    assert held == {"llama": frozenset(), "mistral": {"b_q", "b_k", "b_v", "b_o"}, "qwen2": {"b_o"}}.get(model, frozenset())


@needs_hf
def test_a_bias_the_model_always_has_is_frozen_at_zero_when_the_spec_has_none():
    spec = AttnSpec(16, 16, 12, 0.0, 2)  # Qwen2 always has q/k/v biases; the spec has none
    module = registry.get("hf:qwen2@eager").build(spec, weights=random_weights(spec, seed=1, dtype=torch.float32))
    assert not module.layer.q_proj.bias.requires_grad and not module.layer.q_proj.bias.any()
    x = torch.randn(2, 9, 16)
    ref = matrix.reference(x.double(), zero_held(module, random_weights(spec, seed=1)), spec)
    assert matrix.rel_error(module(x), ref) < 1e-5


@needs_hf
def test_module_class_names_resolve_like_the_short_ones():
    spec = AttnSpec(16, 16, 12, 0.0, 2, True)
    w = random_weights(spec, seed=2, dtype=torch.float32)
    x = torch.randn(2, 7, 16)
    long = registry.get("hf:transformers.models.llama.modeling_llama:LlamaAttention@eager").build(spec, weights=w)
    short = registry.get("hf:llama@eager").build(spec, weights=w)
    assert torch.equal(long(x), short(x))
    with pytest.raises(PluginLoadError, match="no nn.Module 'LlamaAtention'.*LlamaAttention"):
        registry.get("hf:transformers.models.llama.modeling_llama:LlamaAtention")


# --- the correctness matrix -------------------------------------------------------------------------

VARIANT_CASES = {"llama": ["gqa"], "mistral": ["window", "gqa_window_bias", "window1"], "bert": ["noncausal"], "gpt2": []}


@needs_hf
@pytest.mark.parametrize("name", ACCEPTANCE)
def test_acceptance_layers_pass_forward_backward_causality_and_their_variants(name):
    model = name[3:].split("@")[0]
    cases = [Case("forward", SHAPE["gpt_like"], "float32"), Case("backward", SHAPE["one_head_bias"], "float32"),
             Case("dropout_train", SHAPE["props"], "float32")]
    cases += [Case("forward", SHAPE[s], "float32") for s in VARIANT_CASES[model]]
    if "float64" in registry.get(name).dtypes:  # the causality property runs in float64 (Llama-style eager declares none)
        cases.append(Case("causality", SHAPE["props"], "float64"))
    rows = [matrix.run_case(name, c) for c in cases]
    assert not [(r.kind, r.shape, r.status, r.message) for r in rows if r.status != "pass"]


def _decode_error(module, x: torch.Tensor, ref: torch.Tensor, prefill: int) -> tuple[float, str]:
    """Worst relative error of a prefill, then one token at a time with one rewind-and-repeat, against ``ref``."""
    module.reset_cache()
    worst, where = 0.0, ""
    with torch.no_grad():
        steps = [(0, prefill)] + [(t, t + 1) for t in range(prefill, x.shape[1])]
        for start, end in steps:
            out = module(x[:, start:end], use_cache=True)
            if end == x.shape[1] - 1:  # decode the same position again after a rewind, as the timer does
                module.rewind_cache(1)
                out = module(x[:, start:end], use_cache=True)
            err = matrix.rel_error(out, ref[:, start:end])
            worst, where = max((worst, where), (err, f"positions {start}..{end - 1}"))
    return worst, where


@needs_hf
@pytest.mark.parametrize("name", ["hf:llama@eager", "hf:llama@sdpa", "hf:mistral@sdpa"])
def test_decode_through_dynamic_cache_equals_the_full_forward(name):
    """Prefill, token-by-token decode, a rewind (crop) and a reset, against the reference with the biases the
    layer lacks held at zero; Mistral's windows wrap around (the matrix's own decode cases wait for issue 20)."""
    shapes = ["decode_mha", "decode_gqa"] + (["decode_mqa_window", "decode_window_long_prefill"] if "mistral" in name else [])
    for shape_id in shapes:
        shape = SHAPE[shape_id]
        w = random_weights(shape.spec, seed=5, dtype=torch.float32)
        module = registry.get(name).build(shape.spec, weights=w).eval()
        ref_w = zero_held(module, w).to(dtype=torch.float64)
        for seed, prefill in ((1, matrix.DECODE_PREFILL.get(shape_id, 5)), (2, 3)):  # the second after reset_cache()
            x = torch.randn(shape.batch, shape.seq_len, shape.spec.d_in, generator=torch.Generator().manual_seed(seed))
            err, where = _decode_error(module, x, matrix.reference(x.double(), ref_w, shape.spec), prefill)
            assert err < 1e-5, (shape_id, seed, where, err)


@needs_hf
def test_a_sliding_window_cache_rewinds_one_token_past_the_window_and_holds_window_tokens():
    spec = AttnSpec(16, 16, 16, 0.0, 2, window=3)
    module = registry.get("hf:mistral@sdpa").build(spec, weights=random_weights(spec, seed=1, dtype=torch.float32)).eval()
    with torch.no_grad():
        module(torch.randn(1, 8, 16), use_cache=True)
        assert [t.shape[-2] for t in module.cache_tensors()] == [3, 3]  # the window, not all 8
        module(torch.randn(1, 1, 16), use_cache=True)
        module.rewind_cache(1)
        with pytest.raises(ValueError, match="rewinds at most"):
            module.rewind_cache(2)
    with pytest.raises(Exception, match="more than context_length=16"):
        module(torch.randn(1, 9, 16), use_cache=True)


# --- the runner: inference, forward+backward, decode -------------------------------------------------


@needs_hf
@pytest.mark.parametrize("name", ACCEPTANCE)
def test_layers_run_in_inference_and_forward_backward(name):
    for mode in ("inference", "forward+backward"):
        work = build_workload(Cell(impl=name, batch=2, seq_len=16, num_heads=4, d_model=32, mode=mode))
        out = work.step()
        assert work.check_output(out) is None
        if mode == "forward+backward":
            assert all(p.grad is not None for p in work.module.parameters() if p.requires_grad)


@needs_hf
@pytest.mark.parametrize(("name", "kv", "window"), [("hf:llama@sdpa", 2, None), ("hf:mistral@eager", 1, 4)])
def test_decode_mode_cache_bytes_are_the_cache_tensors(name, kv, window):
    cell = Cell(impl=name, batch=2, seq_len=12, num_heads=4, d_model=32, mode="decode", num_kv_heads=kv, window=window)
    work = build_workload(cell)
    assert work.check_output(work.step()) is None
    assert work.kv_cache_bytes == kv_cache_bytes_analytic(2, 12, kv, 8, window, 4)
    assert work.module.cache.get_seq_length() == 12  # each timed step is rewound


# --- planted bugs, flagged by the property they break ------------------------------------------------


def _repeat_not_interleave(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The bug: query head h reads kv head h % num_kv_heads instead of h // (num_heads // num_kv_heads)."""
    return hidden if n_rep == 1 else hidden.repeat(1, n_rep, 1, 1)  # (b, n_kv * n_rep, T, hd)


@needs_hf
def test_repeat_kv_pairing_heads_by_repeat_is_flagged_in_eager_and_sdpa(monkeypatch):
    from transformers.integrations import sdpa_attention
    from transformers.models.llama import modeling_llama

    eager = Case("forward", SHAPE["gqa"], "float32")
    sdpa = Case("forward", SHAPE["gqa_window_bias"], "float32")  # a window mask: SDPA expands K/V with repeat_kv
    assert matrix.run_case("hf:llama@eager", eager).status == "pass"
    assert matrix.run_case("hf:mistral@sdpa", sdpa).status == "pass"
    monkeypatch.setattr(modeling_llama, "repeat_kv", _repeat_not_interleave)
    monkeypatch.setattr(sdpa_attention, "repeat_kv", _repeat_not_interleave)
    for name, case in (("hf:llama@eager", eager), ("hf:mistral@sdpa", sdpa)):
        row = matrix.run_case(name, case)
        assert row.status == "fail" and row.error > 0.01, (name, row)


@needs_hf
def test_an_eager_mask_shifted_by_one_is_flagged_by_causality(monkeypatch):
    from transformers import masking_utils

    case = Case("causality", SHAPE["props"], "float64")
    assert matrix.run_case("hf:gpt2@eager", case).status == "pass"
    monkeypatch.setattr(masking_utils, "causal_mask_function", lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + 1)
    row = matrix.run_case("hf:gpt2@eager", case)
    assert row.status == "fail" and "outputs before position" in row.message


# --- profile and asv go through the registry ---------------------------------------------------------


@needs_hf
def test_the_asv_suite_times_an_hf_name():
    sys.path.insert(0, str(REPO))
    try:
        import benchmarks.bench_attention as suite
    finally:
        sys.path.remove(str(REPO))
    bench = suite.Attention()
    bench.setup("hf:llama@sdpa", "inference", 64, 256)
    bench.time_step("hf:llama@sdpa", "inference", 64, 256)
    assert bench.track_gflops("hf:llama@sdpa", "inference", 64, 256) > 0


@needs_hf
@pytest.mark.slow
def test_profile_records_an_hf_layer(tmp_path):
    from attnbench.profiling import profile_cell

    res = profile_cell(Cell(impl="hf:llama@eager", batch=1, seq_len=16, num_heads=2, d_model=32), logdir=tmp_path)
    assert res.run_dir.parent == tmp_path
    assert {"aten::_softmax", "aten::bmm"} & set(res.ops.op)


# --- the whole matrix --------------------------------------------------------------------------

BASIC_KINDS = ("forward", "backward", "causality", "batch_independence", "eval_deterministic", "dropout_train", "golden")
ROUND2_KINDS = tuple(k for k in matrix.RUNNERS if k not in BASIC_KINDS)  # round-2 properties and decode


def _failures(name: str, kinds) -> list[tuple]:
    rows = matrix.run_matrix([name], kinds=kinds)
    return [(r.kind, r.shape, r.dtype, r.message) for r in rows.itertuples() if r.status in ("fail", "error")]


@needs_hf
@pytest.mark.parametrize("name", ACCEPTANCE)
def test_check_basic_cases_pass(name):
    assert not _failures(name, BASIC_KINDS)


@needs_hf
@pytest.mark.slow  # ~1.5 s each: long T and float16 properties
@pytest.mark.parametrize("name", ACCEPTANCE)  # llama and mistral are bias-free: the round-2 properties hold their biases at zero
def test_check_round2_properties_and_decode_pass(name):
    assert not _failures(name, ROUND2_KINDS)


# --- real rotary embeddings (issue 26): the model's own rotary class, default and Llama-3 scaled ----------------

ROPE_SHAPES = [Shape("hf_rope", 2, 12, AttnSpec(32, 32, 16, 0.0, 4, num_kv_heads=2, rope_theta=500.0)),
               Shape("hf_rope_llama3", 2, 12, AttnSpec(32, 32, 16, 0.0, 4, rope_theta=10000.0,
                                                       rope_scaling=RopeScaling(factor=8.0, original_context_length=8)))]


@needs_hf
@pytest.mark.parametrize("name", ["hf:llama", "hf:qwen2", "hf:mistral"])
def test_layers_pass_with_their_own_rotary_embedding(name):
    impl = registry.get(name)
    assert impl.rope == ("half",) and "neutral" not in impl.description
    for shape in ROPE_SHAPES:
        for kind in ("forward", "decode"):
            row = matrix.run_case(name, Case(kind, shape, "float32"))
            assert row.status == "pass", (shape.id, kind, row.message)
    # float64: its rotary class computes cos/sin in float32, so it is judged at that working precision (issue 35)
    row = matrix.run_case(name, Case("forward", ROPE_SHAPES[0], "float64"))
    assert row.status == "pass" and 1e-9 < row.tolerance < 1e-5, row


@needs_hf
def test_rope_skipping_the_keys_is_flagged(monkeypatch):
    from transformers.models.llama import modeling_llama

    real = modeling_llama.apply_rotary_pos_emb
    case = Case("forward", ROPE_SHAPES[0], "float32")
    neutral = Case("forward", SHAPE["gqa"], "float32")
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", lambda q, k, cos, sin, *a, **kw: (real(q, k, cos, sin)[0], k))
    row = matrix.run_case("hf:llama", case)
    assert row.status == "fail" and row.error > 0.01, row
    assert matrix.run_case("hf:llama", neutral).status == "pass"  # what neutral RoPE alone would have said


def test_bert_is_not_described_with_rope():
    if MISSING is None:
        assert "RoPE" not in registry.get("hf:bert").description and registry.get("hf:bert").rope == ()
