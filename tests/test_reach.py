"""Issue 36: the attention classes of today's model repositories, checked unchanged.

The classes under ``tests/plugins/reach/`` follow the conventions of nanochat (a package, ``(config, layer_idx)``,
``GPTConfig``, ``c_q``/``c_k``/``c_v``/``c_proj``), gpt-fast (``Attention(config: ModelArgs)`` with ``n_local_heads``,
a real-stacked ``freqs_cis``, a keep-mask, ``input_pos`` and a cache installed as ``attn.kv_cache``) and Meta's
llama3 (a constructor that needs a model-parallel group, a cache moved to CUDA).
"""

from __future__ import annotations

import re
import sys
from dataclasses import replace

import pytest
import torch

from attnbench import registry
from attnbench.correctness.matrix import run_matrix
from attnbench.plugins.loading import how_imported, package_of
from attnbench.plugins.module_cache import AppendingCache, cache_attr
from attnbench.spec import AttnSpec
from tests.refusal_text import refusal_text  # a refusal: an error: headline, a few short indented lines
from tests.test_exit_status import cli  # attnbench ARGV in this process: (exit status, stdout, stderr)

R = "tests/plugins/reach/"
SPEC = AttnSpec(d_in=32, d_out=32, context_length=16, dropout=0.0, num_heads=4, num_kv_heads=2)


def test_a_file_in_a_package_is_imported_as_package_module(repo_cwd):
    root, dotted = package_of((repo_cwd / R / "reachpkg/layers/attn.py").resolve())
    assert dotted == "reachpkg.layers.attn" and root == (repo_cwd / R).resolve()
    assert package_of((repo_cwd / R / "gptfast_style.py").resolve()) is None
    impl = registry.get(R + "reachpkg/layers/attn.py:CausalSelfAttention")
    assert impl.factory.binding.target.__module__ == "reachpkg.layers.attn"
    assert str(root) in sys.path  # kept: its forward imports reachpkg.common when it runs
    assert "as reachpkg.layers.attn (it is in a package)" in how_imported(R + "reachpkg/layers/attn.py")
    assert "as a script" in how_imported(R + "gptfast_style.py")


def test_config_and_layer_idx_get_the_class_own_config_and_index_0(repo_cwd):
    impl = registry.get(R + "reachpkg/layers/attn.py:CausalSelfAttention")
    binding = impl.factory.binding
    assert binding.extras == (("layer_idx", 0),)
    config = binding.make_config(SPEC)
    assert type(config).__name__ == "GPTConfig"
    assert (config.n_head, config.n_kv_head, config.n_embd, config.sequence_len) == (4, 2, 32, 16)
    assert (config.vocab_size, config.n_layer, config.window_pattern) == (32768, 12, "SSSL")  # class defaults kept
    module = impl.build(SPEC, "cpu", torch.float32)
    assert module.layer_idx == 0 and module.c_k.weight.shape == (16, 32)
    assert impl.gqa is True
    described = binding.describe()
    assert "config=GPTConfig(sequence_len=context_length, n_head=num_heads, n_kv_head=num_kv_heads" in described
    assert "class defaults kept: vocab_size=32768, n_layer=12, window_pattern='SSSL'" in described
    assert "layer_idx=0" in described


def test_gptfast_config_fields_are_mapped_by_meaning_and_post_init_runs(repo_cwd):
    impl = registry.get(R + "gptfast_style.py:Attention")
    config = impl.factory.binding.make_config(SPEC)
    assert type(config).__name__ == "ModelArgs"
    assert (config.dim, config.n_head, config.n_local_heads, config.head_dim, config.block_size) == (32, 4, 2, 8, 16)
    assert config.intermediate_size == 128  # __post_init__ ran: 4 * dim
    mha = impl.factory.binding.make_config(replace(SPEC, num_kv_heads=None))
    assert mha.n_local_heads == 4
    assert impl.gqa is True and "n_local_heads" in impl.factory.evidence[0]


@pytest.mark.parametrize("target", ["reachpkg/layers/attn.py:CausalSelfAttention", "gptfast_style.py:FrozenAttention"])
def test_c_q_names_and_frozen_weights_map_and_pass(repo_cwd, target):
    df = run_matrix([R + target], kinds=["forward", "causality"])
    assert (df.status == "pass").sum() > 0 and not df.status.isin(["fail", "error"]).any(), \
        df[df.status != "pass"].message.tolist()
    module = registry.get(R + target).build(SPEC, "cpu", torch.float32)
    names = " ".join(module.weight_adapter.layout.describe(SPEC))
    assert ("c_q.weight" in names and "c_proj.weight" in names) if "attn.py" in target else "wqkv.weight" in names


def test_check_verbose_says_how_it_was_imported_and_what_config_it_built(repo_cwd, capsys):
    code, out, err = cli(["check", "-v", "--kind", "forward", R + "reachpkg/layers/attn.py:CausalSelfAttention"], capsys)
    out = " ".join(out.split())
    assert code == 0, out + err
    assert "imported attn.py as reachpkg.layers.attn (it is in a package), with the package root" in out
    assert "layer_idx=0 (one layer is built: its index is 0)" in out
    assert "W_q <- c_q.weight" in out


def test_gptfast_forward_real_freqs_cis_and_module_attribute_cache(repo_cwd):
    impl = registry.get(R + "gptfast_style.py:CachedAttention")
    plan = impl.factory.context
    assert (plan.table_form, plan.attr_cache, plan.mask_form.kind) == ("real", "kv_cache", "keep")
    assert impl.kv_cache is True and impl.rope == ("interleaved",)
    df = run_matrix([R + "gptfast_style.py:CachedAttention"], kinds=["decode", "forward"])
    decode = df[df.kind == "decode"]
    assert (decode.status == "pass").sum() >= 4, df[df.status != "pass"][["shape", "message"]].to_string()
    assert not df.status.isin(["fail", "error"]).any(), df[df.status.isin(["fail", "error"])].message.tolist()
    rope = df[df["shape"].str.contains("rope")]
    assert (rope.status == "pass").any()


def test_module_attribute_cache_is_none_outside_decoding(repo_cwd):
    impl = registry.get(R + "gptfast_style.py:CachedAttention")
    module = impl.build(SPEC, "cpu", torch.float32)
    x = torch.randn(1, 5, 32)
    with torch.no_grad():
        full = module(x)
        module.reset_cache()
        steps = torch.cat([module(x[:, :3], use_cache=True), module(x[:, 3:4], use_cache=True),
                           module(x[:, 4:], use_cache=True)], dim=1)
    assert isinstance(module.kv_cache, AppendingCache) and module.kv_cache.k.shape[-2] == 5
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)
    module.reset_cache()
    assert module.kv_cache is None


def test_cache_attr_reads_the_forward_and_the_declared_attribute(repo_cwd):
    cached, plain = (registry.get(R + f"gptfast_style.py:{n}").factory.binding.target for n in ("CachedAttention", "Attention"))
    assert cache_attr(cached) == "kv_cache"
    assert cache_attr(plain) is None

    class Declared(plain):
        attnbench_cache_attr = "store"

    assert cache_attr(Declared) == "store"


@pytest.mark.parametrize(("target", "cause", "seen"), [
    ("cannot_run.py:ModelParallelAttention", "needs a distributed/model-parallel setup that is not initialised in this "
                                             "process", "AssertionError: model parallel group is not initialized"),
    ("cannot_run.py:CudaCacheAttention", "it needs CUDA, which this machine does not have", "AssertionError"),
    ("missing_package.py:Attention", "it imports 'attnbench_reach_absent_package', which is not installed here",
     "pip install attnbench_reach_absent_package"),
    ("fails_at_import.py:Attention", "failed: RuntimeError: this module needs a GPU at import time",
     "at tests/plugins/reach/fails_at_import.py:5: raise RuntimeError("),
])
def test_what_cannot_run_here_is_one_refusal_naming_the_cause(repo_cwd, capsys, target, cause, seen):
    if "Cuda" in target and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, out, err = cli(["check", R + target], capsys)
    assert code == 2 and cause in err.splitlines()[0], err  # the first true cause leads the refusal
    assert seen in refusal_text(err) and "Traceback" not in out + err and "not causal" not in err


def test_litgpt_conventions_3d_tables_position_none_and_its_own_window(repo_cwd):
    impl = registry.get(R + "litgpt_style.py:CausalSelfAttention")
    plan, binding = impl.factory.context, impl.factory.binding
    assert (plan.table_dims, plan.position_none, plan.mask_form.kind) == ("3d", True, "keep")
    assert binding.extras == (("block_idx", 0),)
    config = binding.make_config(replace(SPEC, window=3))
    assert (config.n_query_groups, config.head_size, config.rope_n_elem, config.bias) == (2, 8, 8, False)
    assert config.sliding_window_size is None  # the mask carries the window: the class's own causal one stays off
    assert "sliding_window_size=None (the mask forward takes carries the window)" in binding.describe()
    df = run_matrix([R + "litgpt_style.py:CausalSelfAttention"], kinds=["forward"])
    assert not df.status.isin(["fail", "error"]).any(), df[df.status.isin(["fail", "error"])].message.tolist()
    assert df[df["shape"].str.contains("noncausal_mqa_window|rope")].status.eq("pass").any()


def test_litgpt_decodes_through_its_own_cache_built_by_build_kv_cache(repo_cwd):
    """litgpt's forward refuses any cache but its own KVCache: attnbench builds it with ``build_kv_cache``, gives the
    positions as a tensor and ``input_pos_maxp1`` so that the keys match the mask."""
    from attnbench.plugins.context import arguments

    impl = registry.get(R + "litgpt_style.py:CachedCausalSelfAttention")
    plan = impl.factory.context
    assert (plan.attr_cache, plan.cache_builder, plan.span_arg) == ("kv_cache", "build_kv_cache", "input_pos_maxp1")
    assert impl.kv_cache is True
    x = torch.randn(1, 2, 32)
    step = arguments(plan, SPEC, x, 3, None, True)
    assert step["input_pos"].tolist() == [3, 4] and step["input_pos_maxp1"] == 5
    assert arguments(plan, SPEC, x, 0, None, False)["input_pos_maxp1"] is None
    module = impl.build(SPEC, "cpu", torch.float32)
    with torch.no_grad():
        module(x, use_cache=True)
    assert type(module.kv_cache).__name__ == "KVCache" and module.kv_cache.k.shape[-2] == SPEC.context_length
    module.reset_cache()
    assert module.kv_cache is None
    df = run_matrix([R + "litgpt_style.py:CachedCausalSelfAttention"], kinds=["decode"])
    assert (df.status == "pass").sum() >= 4 and not df.status.isin(["fail", "error"]).any(), \
        df[df.status != "pass"][["shape", "message"]].to_string()


def test_nanochat_cos_sin_tuple_of_half_width_4d_tables_ve_and_window_size(repo_cwd):
    impl = registry.get(R + "nanochat_tables.py:CausalSelfAttention")
    plan = impl.factory.context
    assert (plan.tables, plan.table_dims, plan.nones, plan.window_arg) == (("cos_sin",), "seq_half", ("ve",), "window_size")
    assert impl.sliding_window is True
    df = run_matrix([R + "nanochat_tables.py:CausalSelfAttention"], kinds=["forward"])
    rope, window = df[df["shape"].str.contains("rope")], df[df["shape"].str.contains("window")]
    assert (rope.status == "pass").sum() >= 2 and (window.status == "pass").sum() >= 2, df[df.status != "pass"].message.tolist()
    assert not df.status.isin(["fail", "error"]).any(), df[df.status.isin(["fail", "error"])].message.tolist()


@pytest.mark.slow
def test_real_litgpt_class_passes_check_unchanged(capsys):
    pytest.importorskip("litgpt.model", reason="litgpt is not installed (pip install litgpt)")
    code, out, err = cli(["check", "litgpt.model:CausalSelfAttention"], capsys)
    assert code == 0, out + err
    passed = re.search(r"litgpt.model:CausalSelfAttention: PASS \((\d+) passed", out)
    assert passed and int(passed.group(1)) >= 60, out  # 69 with litgpt 0.5.13: RoPE, GQA, windows, non-causal, decode
    decode = re.search(r"CausalSelfAttention\s*│\s*decode\s*│\s*float32\s*│\s*(\d+)\s*│\s*0\s*│\s*0\s*│", out)
    assert decode and int(decode.group(1)) >= 4, out  # decoded through its own KVCache (build_kv_cache)


N = R + "nanochat_style.py:"


def test_nanochat_conventions_are_measured_on_the_class_and_said_in_verbose(repo_cwd, capsys):
    impl = registry.get(N + "CausalSelfAttention")
    factory = impl.factory
    assert factory.own["rope_sign"] == -1 and factory.own["fixed_gain"] == pytest.approx(1.2, abs=1e-6)
    assert "qk_norm" in factory.requires and impl.qk_norm == ("head",) and impl.kv_cache is True
    assert factory.context.cache_object == "flash"
    own = impl.own_spec(replace(SPEC, rope_theta=500.0))
    assert (own.rope_sign, own.qk_norm) == (-1, "head") and own.norm_eps == pytest.approx(1e-6, rel=0.01)  # its own
    assert impl.own_spec(SPEC).rope_sign == 1  # no RoPE in the spec: nothing to turn
    code, out, err = cli(["check", "-v", "--kind", "forward", N + "CausalSelfAttention"], capsys)
    out = " ".join(out.split())
    assert code == 0, out + err
    assert "rope direction: -theta, pairs half" in out and "rope_sign=-1" in out
    assert "qk_norm: head, without weights" in out and "fixed gains 1.2 " in out
    assert "g_q = g_k = 1.2 (fixed" in out
    assert "a FlashCache (flash_attn_with_kvcache style" in out


def test_a_class_whose_module_names_no_norm_is_not_run_at_load(repo_cwd, monkeypatch):
    """The QK-norm probe calls forward where the plug-in loads (a run's driver): only when the module's source mentions
    a norm, so a class that crashes its process is not run there (its cells, isolated, record the crash)."""
    import importlib.util

    from attnbench.plugins import measured

    def load(path, name):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        return module

    assert not measured.may_norm(load("tests/plugins/faulty.py", "_faulty_probe").Segfaults)
    assert measured.may_norm(load("tests/plugins/reach/nanochat_style.py", "_nanochat_probe").CausalSelfAttention)
    calls = []
    monkeypatch.setattr(measured, "fixed_norm", lambda factory: calls.append(factory))
    impl = registry.get("tests/plugins/faulty.py:Segfaults")  # its forward would end this process: never called
    assert calls == [] and not impl.qk_norm


def test_another_factor_is_read_not_assumed(repo_cwd):
    factory = registry.get(N + "OtherFactor").factory
    assert factory.own["fixed_gain"] == pytest.approx((1.2 * 1.2 * 1.25) ** 0.5, abs=1e-6)


@pytest.mark.parametrize("target", ["CausalSelfAttention", "DeclaredCacheAttention"])
def test_nanochat_style_passes_rope_qknorm_and_decode_through_its_cache_object(repo_cwd, target):
    df = run_matrix([N + target], kinds=["forward", "decode"])
    bad = df[df.status.isin(["fail", "error"])]
    assert bad.empty, bad[["kind", "shape", "message"]].to_string()
    decode, rope = df[df.kind == "decode"], df[df["shape"].str.contains("rope")]
    assert (decode.status == "pass").sum() >= 5 and (rope.status == "pass").sum() >= 3


@pytest.mark.parametrize(("target", "kind", "shape"), [
    ("FactorLostWhenCached", "decode", "decode_mha"),
    ("KeysTurnTheOtherWay", "forward", "rope_half_theta500_gqa"),
    ("NormAcrossHeads", "forward", "gqa"),
])
def test_planted_nanochat_variants_are_flagged(repo_cwd, target, kind, shape):
    df = run_matrix([N + target], kinds=[kind])
    row = df[(df["shape"] == shape) & (df.dtype == "float64")]
    assert list(row.status) == ["fail"], df[["shape", "status", "message"]].to_string()


def test_the_cache_object_is_made_once_advanced_once_per_step_and_gone_after_reset(repo_cwd):
    spec = replace(SPEC, num_kv_heads=None)
    for target, position in (("CausalSelfAttention", lambda c: c.get_pos()), ("DeclaredCacheAttention", lambda c: c.length)):
        module = registry.get(N + target).build(spec, "cpu", torch.float64)
        x = torch.randn(2, 6, 32, dtype=torch.float64)
        with torch.no_grad():
            full = module(x)
            module.reset_cache()
            parts = [module(x[:, :4], use_cache=True)]
            cache = module._attnbench_cache
            parts += [module(x[:, 4:5], use_cache=True), module(x[:, 5:], use_cache=True)]
        assert module._attnbench_cache is cache and position(cache) == 6  # one object, advanced 4 + 1 + 1
        torch.testing.assert_close(torch.cat(parts, 1), full)
        module.reset_cache()
        assert module._attnbench_cache is None


def test_rope_sign_is_a_spec_field_the_reference_applies():
    from attnbench.correctness.reference import reference_forward
    from attnbench.spec import positional_from_text
    from attnbench.weights import random_weights

    spec = replace(SPEC, rope_theta=100.0, rope_sign=-1)
    assert replace(SPEC, **positional_from_text(spec.positional_text())) == spec == AttnSpec(**spec.kwargs())
    w = random_weights(spec)
    x = torch.randn(1, 6, 32, dtype=torch.float64)
    turned = reference_forward(x, w, 4, spec=spec)
    plus = reference_forward(x, w, 4, spec=replace(spec, rope_sign=1))
    assert (turned - plus).abs().max() > 1e-3
    hd = spec.head_dim  # reflecting the second half of every head's q and k rows turns -theta into +theta
    flip = torch.ones(spec.d_out, dtype=torch.float64).view(-1, hd)
    flip[:, hd // 2:] = -1
    w2 = replace(w, W_q=w.W_q * flip.reshape(-1, 1), W_k=w.W_k * flip[: spec.kv_heads].reshape(-1, 1))
    torch.testing.assert_close(reference_forward(x, w2, 4, spec=replace(spec, rope_sign=1)), turned)
    with pytest.raises(Exception, match="rope_sign"):
        replace(spec, rope_sign=2)


@pytest.mark.parametrize(("target", "style"), [("Attention", "interleaved"), ("HalfPairs", "half")])
def test_per_frequency_tables_get_the_pairing_the_class_is_measured_to_use(repo_cwd, target, style):
    impl = registry.get(R + "llama2c_style.py:" + target)
    assert impl.factory.context.tables == ("freqs_cos", "freqs_sin") and impl.rope == (style,)
    assert any(line.startswith(f"rope direction: +theta, pairs {style}") for line in impl.factory.evidence)
    df = run_matrix([R + "llama2c_style.py:" + target], kinds=["forward"])
    assert not df.status.isin(["fail", "error"]).any(), df[df.status.isin(["fail", "error"])].message.tolist()
    assert (df[df["shape"].str.contains("rope")].status == "pass").sum() >= 2


def test_a_forward_that_sleeps_stops_the_measured_probes_instead_of_holding_the_load(tmp_path):
    """The measured probes run where a plug-in is loaded (often the driver, which no cell timeout guards): a forward
    that sleeps 60 s once held a Ray run's driver for 8 minutes (tests/test_ray.py::test_timeouts)."""
    from attnbench import registry
    from attnbench.plugins.measured import PROBE_CALL_S

    plug = tmp_path / "sleepy.py"
    plug.write_text(
        "import time\nfrom torch import nn\nfrom torch.nn.functional import rms_norm  # a norm: the QK-norm probe runs\n\n\n"
        "class Sleeps(nn.Module):\n"
        "    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):\n"
        "        super().__init__()\n"
        "        self.W_query, self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias), nn.Linear(d_in, d_out, bias=qkv_bias)\n"
        "        self.W_value, self.out_proj = nn.Linear(d_in, d_out, bias=qkv_bias), nn.Linear(d_out, d_out)\n\n"
        "    def forward(self, x):\n        time.sleep(60)\n        return self.out_proj(self.W_value(x))\n")
    impl = registry.get(f"{plug}:Sleeps")
    evidence = getattr(impl.factory, "evidence", [])
    assert any(f"ran past {PROBE_CALL_S:g} s" in line for line in evidence), evidence


def test_a_forward_that_blocks_the_alarm_leaves_no_alarm_pending_and_the_mask_as_it_was(tmp_path):
    """A forward that blocks SIGALRM (tests/test_ray.py's Stuck) once left the probe's alarm pending: delivered later
    under the default action, it ended a pytest worker ("node down")."""
    import signal

    from attnbench import registry

    plug = tmp_path / "stuck.py"
    plug.write_text(
        "import signal, time\nfrom torch import nn\nfrom torch.nn.functional import rms_norm  # the QK-norm probe runs\n\n\n"
        "class Stuck(nn.Module):\n"
        "    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):\n"
        "        super().__init__()\n"
        "        self.W_query, self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias), nn.Linear(d_in, d_out, bias=qkv_bias)\n"
        "        self.W_value, self.out_proj = nn.Linear(d_in, d_out, bias=qkv_bias), nn.Linear(d_out, d_out)\n\n"
        "    def forward(self, x):\n        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n"
        "        time.sleep(2.5)\n        return self.out_proj(self.W_value(x))\n")
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    impl = registry.get(f"{plug}:Stuck")
    assert any("ran past" in line for line in impl.factory.evidence), impl.factory.evidence  # the probe did run
    assert signal.SIGALRM not in signal.sigpending()
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


def test_a_forward_level_causal_flag_is_the_spec_s_causality_when_no_mask_is_passed(repo_cwd):
    """``forward(x, attn_mask=None, is_causal=False)`` into SDPA, which refuses both: the flag alone says causal, the
    mask alone says a window (flag False), and a non-causal spec passes neither."""
    from attnbench.plugins.context import arguments

    plan = registry.get(R + "forward_forms.py:FlagAttention").factory.context
    assert plan.causal_arg == "is_causal" and plan.mask == "attn_mask" and not plan.mask_required
    x = torch.randn(1, 4, 32)
    causal = arguments(plan, SPEC, x, 0, None, False)
    assert causal == {"is_causal": True}
    windowed = arguments(plan, replace(SPEC, window=2), x, 0, None, False)
    assert windowed["is_causal"] is False and windowed["attn_mask"].shape[-2:] == (4, 4)
    assert arguments(plan, replace(SPEC, causal=False), x, 0, None, False) == {"is_causal": False}
    step = arguments(plan, SPEC, x, 3, None, True)  # after 3 cached tokens: SDPA's flag would align top-left
    assert step["is_causal"] is False and step["attn_mask"].shape[-2:] == (4, 7)
    df = run_matrix([R + "forward_forms.py:FlagAttention", R + "forward_forms.py:FlagDefaultTrue"],
                    kinds=["forward", "backward"])
    assert (df.status == "pass").sum() >= 20 and not df.status.isin(["fail", "error"]).any(), \
        df[df.status.isin(["fail", "error"])][["impl", "shape", "message"]].to_string()


def test_a_causal_flag_the_class_ignores_is_dropped_and_the_mask_passed(repo_cwd):
    plan = registry.get(R + "forward_forms.py:IgnoresFlag").factory.context
    assert plan.mask_required and plan.mask == "mask" and plan.mask_form.kind == "hidden"
    df = run_matrix([R + "forward_forms.py:IgnoresFlag"], kinds=["forward"])
    assert (df.status == "pass").sum() >= 5 and not df.status.isin(["fail", "error"]).any()


def test_rotation_matrices_under_freq_cis_are_bound_and_pass(repo_cwd, capsys):
    impl = registry.get(R + "forward_forms.py:MatrixRope")
    plan = impl.factory.context
    assert plan.tables == ("freq_cis",) and plan.table_form == "matrix" and impl.rope == ("interleaved",)
    code, out, _ = cli(["check", "-v", "--kind", "forward", R + "forward_forms.py:MatrixRope"], capsys)
    assert code == 0 and "freq_cis rotation matrices (..., head_dim/2, 2, 2)" in out, out
    df = run_matrix([R + "forward_forms.py:MatrixRope"], kinds=["forward"])
    rope = df[df["shape"].str.contains("rope")]
    assert (rope.status == "pass").any() and not df.status.isin(["fail", "error"]).any(), \
        df[df.status.isin(["fail", "error"])][["shape", "message"]].to_string()


@pytest.mark.parametrize("target, param, value", [("TypedAttention", "attn_type", "AttentionType.GLOBAL"),
                                                  ("NamedKindAttention", "layer_kind", "'full_attention'")])
def test_a_constructor_choice_gets_its_first_plain_member(repo_cwd, capsys, target, param, value):
    code, out, _ = cli(["check", "-v", "--kind", "forward", R + f"attn_type.py:{target}"], capsys)
    assert f"{param}=<{value}: 2>" in out or f"{param}={value}" in out, out
    assert f"{param}: the first plain member of its choices" in out and code == 0, out


def test_an_hf_style_layer_decodes_through_a_cache_object_with_update(repo_cwd):
    """``forward(..., past_key_values=None, ...)`` returning ``(out, weights)``: the weights are not a next cache,
    so the cache is an object passed in, whose ``update(k, v, layer_idx, cache_kwargs)`` it calls (``DynamicCache``)."""
    impl = registry.get(R + "hf_style.py:Attention")
    assert impl.factory.context.cache_object == "layer" and impl.kv_cache is True
    df = run_matrix([R + "hf_style.py:Attention"], kinds=["decode"])
    assert (df.status == "pass").sum() >= 8 and not df.status.isin(["fail", "error"]).any(), \
        df[df.status != "pass"][["shape", "message"]].to_string()


@pytest.mark.parametrize("target", ["transformers.models.llama.modeling_llama:LlamaAttention",
                                    "transformers.models.qwen3.modeling_qwen3:Qwen3Attention"])
def test_real_transformers_layers_decode_unchanged_as_plug_ins(target):
    """The installed transformers' classes as plug-ins (not ``hf:`` names): their decode cases pass through the cache
    object (before, the attention weights they return were taken for a next cache, and every decode case erred)."""
    pytest.importorskip("transformers", reason="transformers is not installed (the hf extra)")
    df = run_matrix([target], kinds=["decode"])
    assert (df.status == "pass").sum() >= 8 and not df.status.isin(["fail", "error"]).any(), \
        df[df.status != "pass"][["shape", "message"]].to_string()


def test_projection_modules_a_constructor_takes_are_built_from_the_spec(repo_cwd, capsys):
    binding = registry.get(R + "injected.py:InjectedAttention").factory.binding
    assert dict(binding.modules) == {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "output_proj": "out"}
    module = binding(SPEC)
    assert (module.k_proj.in_features, module.k_proj.out_features) == (32, 16) and module.k_proj.bias is None
    code, out, _ = cli(["check", "-v", "--kind", "forward", R + "injected.py:InjectedAttention"], capsys)
    assert code == 0 and "k_proj=nn.Linear(d_in, num_kv_heads * head_dim, bias=qkv_bias)" in " ".join(out.split()), out


def test_a_loose_file_importing_its_repository_by_name_is_imported_from_the_repository_root(tmp_path):
    """stable-diffusion's ldm/modules/attention.py, flux's flux/modules/layers.py: folders without __init__.py whose
    files import `from ldm.modules.x import y`, run from the repository root. attnbench finds that root (issue 46,
    the held-out corpus), where it said "imports 'ldm', which is not installed here" and suggested `pip install`."""
    from attnbench.errors import PluginLoadError
    from attnbench.plugins.loading import IMPORTED, import_file

    mods = tmp_path / "repo" / "nsldm" / "modules"
    mods.mkdir(parents=True)
    (tmp_path / "repo" / ".git").mkdir()
    (mods / "util.py").write_text("def twice(x):\n    return 2 * x\n")
    (mods / "attention.py").write_text("from nsldm.modules.util import twice\n\nVALUE = twice(21)\n")
    (mods / "broken.py").write_text("import nsldm_missing_dependency\n")
    module = import_file(str(mods / "attention.py"))
    assert module.__name__ == "nsldm.modules.attention" and module.VALUE == 42
    assert "a folder of its repository without __init__.py" in IMPORTED[module.__name__]
    with pytest.raises(PluginLoadError, match="imports 'nsldm_missing_dependency', which is not installed here"):
        import_file(str(mods / "broken.py"))
