"""Canonical weights: every layout round-trips, the same weights give the same function, clear errors."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

from attnbench import registry
from attnbench.correctness.cases import computes_mla
from attnbench.correctness.reference import reference_forward
from attnbench.errors import PluginLoadError, UnavailableError
from attnbench.spec import AttnSpec
from attnbench.weights import (
    BOOK_ADAPTER,
    CanonicalWeights,
    adapter_for,
    export_weights,
    load_weights,
    random_weights,
    state_from_canonical,
    zero_held,
)

pytestmark = pytest.mark.usefixtures("single_thread")

SPECS = {"bias_rect": AttnSpec(12, 16, 8, 0.0, 4, True), "nobias_rect": AttnSpec(12, 16, 8, 0.0, 4, False),
         "bias_square": AttnSpec(16, 16, 8, 0.0, 2, True), "nobias_square": AttnSpec(16, 16, 8, 0.0, 2, False)}


MLA_SPECS = {"rect": AttnSpec(12, 16, 8, 0.0, 4, rope_theta=100.0, q_lora_rank=6, kv_lora_rank=5, qk_nope_head_dim=4,
                              qk_rope_head_dim=2, v_head_dim=3),
             "square": AttnSpec(16, 16, 8, 0.0, 2, rope_theta=100.0, kv_lora_rank=6, qk_nope_head_dim=4,
                                qk_rope_head_dim=4, v_head_dim=8)}
"""Issue 46: what a DeepSeek-style MLA built-in (which computes nothing else) is built for, per SPECS key."""


def _spec_for(impl: registry.Implementation, key: str) -> AttnSpec:
    if computes_mla(impl):
        return MLA_SPECS[key.split("_")[1]]
    if impl.same_width_only:
        key = key.replace("rect", "square")
    return SPECS[key]


def _module(name: str, spec: AttnSpec, seed: int = 0) -> torch.nn.Module:
    """The implementation's module in float64 on CPU, constructed whether or not it can run here."""
    torch.manual_seed(seed)
    return registry.get(name).factory(spec).to(torch.float64)


@pytest.mark.parametrize("key", list(SPECS))
@pytest.mark.parametrize("name", sorted(registry.names()))
def test_load_then_export_round_trips_exactly(name, key):
    spec = _spec_for(registry.get(name), key)
    w = random_weights(spec, seed=3)
    module = load_weights(_module(name, spec), w, spec)
    back = export_weights(module, spec)
    w = zero_held(module, w)  # what a layout without a parameter (MLA's bias-free wo) holds: zero
    assert [n for n, _ in back.items()] == [n for n, _ in w.items()]
    for (n, got), (_, want) in zip(back.items(), w.items(), strict=True):
        assert got.dtype == torch.float64 and torch.equal(got, want), f"{name}: {n} changed in the round trip"
    if not spec.qkv_bias:
        assert back.b_q is None and back.b_k is None and back.b_v is None


@pytest.mark.parametrize("name", [n for n in registry.available("cpu") if n != "weight_split"
                                  and not computes_mla(registry.get(n))])  # MLA: tests/test_mla_deepseek.py
def test_same_weights_same_output(name):
    spec = _spec_for(registry.get(name), "bias_rect")
    w = random_weights(spec, seed=5)
    x = torch.randn(3, 7, spec.d_in, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    a = load_weights(_module("weight_split", spec, seed=1), w, spec).eval()
    b = load_weights(_module(name, spec, seed=2), w, spec).eval()  # different initial weights, overwritten
    with torch.no_grad():
        out_a = a(x)
        try:
            out_b = b(x)
        except UnavailableError as exc:  # varlen_nested: causal nested SDPA has no CPU kernel (PyTorch's reason)
            pytest.skip(str(exc))
    torch.testing.assert_close(out_b, out_a, rtol=0, atol=1e-12)
    torch.testing.assert_close(out_a, reference_forward(x, w, spec.num_heads), rtol=0, atol=1e-12)
    with torch.no_grad():  # the comparison is meaningful: other weights give another function
        other = load_weights(_module(name, spec), random_weights(spec, seed=6), spec).eval()(x)
    assert (other - out_a).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["fused_qkv", "einsum", "wrapper", "per_head_linear", "torch_mha"])
def test_adapter_is_differentiable(name):
    """Gradients w.r.t. canonical weights through the module's own layout equal the book layout's."""
    spec = _spec_for(registry.get(name), "bias_rect")
    x = torch.randn(2, 5, spec.d_in, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = {}
    for impl in ("weight_split", name):
        module = _module(impl, spec).eval()
        w = random_weights(spec, seed=8).leaves()
        out = functional_call(module, state_from_canonical(module, w, spec), (x,), strict=False)
        grads[impl] = torch.autograd.grad(out.square().sum(), [t for _, t in w.items()])
    for g_book, g_impl in zip(grads["weight_split"], grads[name], strict=True):
        torch.testing.assert_close(g_impl, g_book, rtol=1e-10, atol=1e-12)


def test_book_layout_needs_no_adapter(plugins_on_path):
    import good

    assert adapter_for(good.PlainAttention(12, 16, 8, 0.0, 4)) is BOOK_ADAPTER


def test_class_without_book_names_or_adapter(plugins_on_path):
    import bad

    module = bad.NoBookNames(12, 16, 8, 0.0, 4)  # built directly: no layout discovery (a plug-in gets one)
    spec = SPECS["nobias_rect"]
    with pytest.raises(PluginLoadError) as info:
        load_weights(module, random_weights(spec), spec)
    message = str(info.value)
    assert message.startswith("NoBookNames has no canonical weight layout")
    for fix in ("W_query", "W_key", "W_value", "out_proj", "weight_adapter", "Adapter(to_state, from_state)"):
        assert fix in message
    with pytest.raises(PluginLoadError, match="no canonical weight layout"):
        export_weights(module, spec)


def test_unmappable_plugin_lists_its_parameters(repo_cwd):
    impl = registry.get("tests/plugins/styles/errors.py:NoRecognisableProjections")
    with pytest.raises(PluginLoadError) as info:
        impl.build(SPECS["nobias_rect"])
    message = str(info.value)
    assert message.startswith("cannot map NoRecognisableProjections's parameters") and "\n" not in message
    for part in ("alpha.weight (24, 20)", "delta.weight (24, 24)", "weight_adapter", "Adapter(to_state, from_state)"):
        assert part in message


def test_adapter_that_misses_a_trainable_parameter(plugins_on_path, repo_cwd):
    import bad

    spec = SPECS["nobias_rect"]
    with pytest.raises(PluginLoadError, match=r"not set by the adapter \['temperature'\]"):
        load_weights(bad.ExtraParameter(12, 16, 8, 0.0, 4), random_weights(spec), spec)
    with pytest.raises(PluginLoadError, match="no canonical counterpart for temperature"):  # as a plug-in
        registry.get("tests/plugins/bad.py:ExtraParameter").build(spec)


def test_weights_must_match_the_spec():
    spec = SPECS["bias_rect"]
    module = _module("weight_split", spec)
    with pytest.raises(ValueError, match=r"canonical W_q has shape \(16, 16\), expected \(16, 12\)"):
        load_weights(module, random_weights(SPECS["bias_square"]), spec)
    with pytest.raises(ValueError, match="lack q/k/v biases"):
        load_weights(module, random_weights(SPECS["nobias_rect"]), spec)


def test_random_weights():
    spec = SPECS["bias_rect"]
    torch.manual_seed(0)
    a = random_weights(spec, seed=11)
    torch.manual_seed(1)
    b = random_weights(spec, seed=11)  # independent of the global RNG
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.items(), b.items(), strict=True))
    assert not torch.equal(a.W_q, random_weights(spec, seed=12).W_q)
    a.check(spec)
    assert a.W_q.dtype == torch.float64 and random_weights(spec, dtype=torch.float32).W_o.dtype == torch.float32
    assert [n for n, _ in random_weights(SPECS["nobias_rect"]).items()] == ["W_q", "W_k", "W_v", "W_o", "b_o"]
    # unit scale: queries of a unit-variance input have roughly unit variance
    x = torch.randn(4000, spec.d_in, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert 0.7 < float((x @ a.W_q.T).std()) < 1.3
    with pytest.raises(ValueError, match="scale must be"):
        random_weights(spec, scale="xavier")


def test_random_weights_kept_per_process_are_copies_with_the_values_drawn_anew(monkeypatch):
    import attnbench.weights as weights

    spec = AttnSpec(12, 16, 8, 0.0, 4, True, qk_norm="head")
    weights._DRAWN.clear()
    first = random_weights(spec, seed=21, dtype=torch.float32, scale="linear")
    first.W_q.add_(1.0)  # a caller that changes its weights in place does not change the next caller's
    again = random_weights(spec, seed=21, dtype=torch.float32, scale="linear")
    fresh = weights._draw(spec, 21, torch.float32, "linear")
    assert [n for n, _ in again.items()] == [n for n, _ in fresh.items()]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(again.items(), fresh.items(), strict=True))
    assert again.W_q.data_ptr() != random_weights(spec, seed=21, dtype=torch.float32, scale="linear").W_q.data_ptr()
    assert not torch.equal(random_weights(spec, seed=21, dtype=torch.float32).W_q, again.W_q)  # the scale is in the key
    monkeypatch.setattr(weights, "DRAWN_CACHE_BYTES", 1)  # too large to keep: drawn anew, same values
    weights._DRAWN.clear()
    big = random_weights(spec, seed=21, dtype=torch.float32, scale="linear")
    assert not weights._DRAWN and torch.equal(big.W_o, fresh.W_o)


def test_canonical_weights_helpers():
    spec = SPECS["nobias_square"]
    w = random_weights(spec)
    w32 = w.to(dtype=torch.float32)
    assert isinstance(w32, CanonicalWeights) and w32.W_q.dtype == torch.float32 and w32.b_q is None
    leaves = w.leaves()
    assert all(t.requires_grad and t.is_leaf for _, t in leaves.items())
    assert leaves.W_q.data_ptr() != w.W_q.data_ptr()


def test_compiled_module_round_trips():
    spec = SPECS["bias_rect"]
    w = random_weights(spec, seed=4, dtype=torch.float32)
    module = registry.get("compiled:fused_qkv").build(spec, weights=w)
    assert any(n.startswith("_orig_mod.") for n, _ in module.named_parameters())
    back = export_weights(module, spec)
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(back.items(), w.items(), strict=True))
