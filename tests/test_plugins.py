"""Bring your own attention: classes written in common styles plug in unchanged (attnbench.plugins)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from attnbench import cli, registry
from attnbench.correctness.matrix import run_matrix
from attnbench.errors import PluginLoadError
from attnbench.plugins.binding import SpecConfig, bind
from attnbench.plugins.layout import PROBE, discover, role_of
from attnbench.spec import AttnSpec
from attnbench.weights import adapter_for, export_weights, load_weights, random_weights
from tests.refusal_text import refusal_text  # a refusal: an error: headline, a few short indented lines

pytestmark = pytest.mark.usefixtures("single_thread")

S = "tests/plugins/styles/"
REPO_STYLES = Path(__file__).resolve().parent / "plugins" / "styles"
KINDS = ["forward", "backward", "causality", "batch_independence", "eval_deterministic", "dropout_train"]
CORRECT = [  # one class per style; each must pass with no adapter
    "argument_order.py:NotebookOrder", "argument_order.py:KeywordsAnyOrder", "argument_order.py:HuggingFaceNames",
    "argument_order.py:make_attention", "argument_order.py:ReturnsOutputAndWeights", "fused.py:FusedQKV",
    "fused.py:FusedParams", "einsum.py:EinsumParams",
    "config_style.py:NanoStyleAttention", "config_style.py:MinStyleAttention", "mha_inside.py:WrapsTorchMHA",
    "mha_inside.py:TorchMHAOnly", "sibling/attention_with_helper.py:SiblingImport", "per_head.py:PerHeadModuleList",
    "bias_free.py:BiasFree", "bias_free.py:BiasFreeRect",
]
BUGGY = [  # an untransposed-weight bug in each layout, and nn.MultiheadAttention(add_bias_kv=qkv_bias)
    "argument_order.py:NotebookOrderUntransposed", "argument_order.py:KeywordsAnyOrderUntransposed",
    "fused.py:FusedQKVUntransposed", "fused.py:FusedParamsUntransposed", "einsum.py:EinsumParamsUntransposed",
    "config_style.py:NanoStyleUntransposed", "config_style.py:MinStyleUntransposed",
    "mha_inside.py:WrapsTorchMHAAddBiasKV", "mha_inside.py:WrapsTorchMHAUntransposed",
    "sibling/attention_with_helper.py:SiblingImportUntransposed", "per_head.py:PerHeadModuleListUntransposed",
    "bias_free.py:BiasFreeUntransposed", "bias_free.py:BiasFreeRectUntransposed",
]
PROPERTY_MESSAGE = re.compile(r"^(forward error|grad \w+ error|eval output error|eval mode is not deterministic|output shape|"
                              r"outputs before position|train-mode output|\w+Error: )")


def run_cli(argv, capsys):
    try:
        cli.main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("name", CORRECT)
def test_style_passes_with_no_adapter(repo_cwd, name):
    df = run_matrix([S + name], kinds=KINDS)
    bad = df[df.status.isin(["fail", "error"])]
    assert bad.empty, "\n".join(f"{r.kind} {r.shape} {r.dtype}: {r.message}" for r in bad.itertuples())
    assert set(df[df.status == "pass"].kind) == set(KINDS) - ({"dropout_train"} if name.endswith("BiasFree") else set())
    for r in df[df.status == "skip"].itertuples():
        assert r.message, r


@pytest.mark.parametrize("name", BUGGY)
def test_buggy_style_is_flagged_by_a_named_property(repo_cwd, name):
    df = run_matrix([S + name], kinds=KINDS)
    bad = df[df.status.isin(["fail", "error"])]
    assert not bad.empty, f"{name} passed every case"
    assert "forward" in set(bad.kind), bad
    assert bad.message.str.match(PROPERTY_MESSAGE).all(), bad.message.tolist()
    if "Untransposed" in name:  # d_in == d_out runs and is wrong: values, not only shapes, are checked
        square = bad[bad["shape"].isin(["gpt_like", "hd64_square"])]
        assert (square.status == "fail").any(), bad


def test_check_several_implementations_one_summary_line_each(repo_cwd, capsys):
    code, out, _ = run_cli(["check", S + "fused.py:FusedQKV", "--impl", f"nb={S}argument_order.py:NotebookOrder",
                            "--impl", S + "einsum.py:EinsumParamsUntransposed", "--kind", "forward,backward"], capsys)
    assert code == 1
    last = [line for line in out.strip().splitlines() if not line.startswith("  ")][-3:]  # indented: lines about each
    assert last[0].startswith(f"{S}fused.py:FusedQKV: PASS (")
    assert last[1].startswith("nb: PASS (")  # the display name, in the table and the summary
    assert last[2].startswith(f"{S}einsum.py:EinsumParamsUntransposed: FAIL (") and "forward, backward" in last[2]


def test_check_exit_0_when_everything_passes(repo_cwd, capsys):
    code, out, _ = run_cli(["check", S + "per_head.py:PerHeadModuleList", "--kind", "forward"], capsys)
    summary = [line for line in out.strip().splitlines() if not line.startswith("  ")]
    assert code == 0 and summary[-1].startswith(f"{S}per_head.py:PerHeadModuleList: PASS")
    assert out.strip().splitlines()[-1].startswith("  ran ") and "cases this class can take" in out


@pytest.mark.parametrize("name, lines", [
    ("config_style.py:NanoStyleAttention", ["constructor: NanoStyleAttention(config=", "W_q <- c_attn.weight[0:768]",
                                           "W_k <- c_attn.weight[768:1536]", "W_o <- c_proj.weight",
                                           "b_o = 0 (the module has no such parameter"]),
    ("einsum.py:EinsumParams", ["W_q <- W_query.T", "b_q <- bias_q", "W_o <- out_proj.weight"]),
    ("fused.py:FusedParams", ["W_v <- Wqkv[:, 1536:2304].T", "W_o <- Wo.T", "b_o <- bo"]),
    ("per_head.py:PerHeadModuleList", ["W_q[64*i:64*(i+1)] <- heads.{i}.query.weight for i in 0..11"]),
    ("mha_inside.py:WrapsTorchMHA", ["W_q <- attn.in_proj_weight[0:768]", "attn.out_proj.weight = I (fixed: proj.weight",
                                     "W_o <- proj.weight"]),
    ("argument_order.py:KeywordsAnyOrder", ["KeywordsAnyOrder(n_heads=num_heads, d_model=d_in, max_seq_len=context_length, "
                                            "p=dropout, use_bias=qkv_bias)"]),
])
def test_check_verbose_prints_the_mapping(repo_cwd, capsys, name, lines):
    code, out, _ = run_cli(["check", "-v", S + name, "--kind", "causality"], capsys)
    assert code == 0, out
    for line in lines:
        assert line in out, f"{line!r} not in\n{out}"


@pytest.mark.parametrize("name, pattern", [
    ("ConstructorRaises", r"cannot be built.*RuntimeError: ConstructorRaises: unsupported configuration"),
    ("NoRecognisableProjections", r"no recognisable projections.*alpha\.weight \(24, 20\).*weight_adapter"),
    ("TwoCandidateLayouts", r"two candidate layouts for W_q: qkv\.weight and q_proj\.weight.*Adapter"),
])
def test_setup_errors_are_one_line_and_exit_2(repo_cwd, capsys, name, pattern):
    code, out, err = run_cli(["check", S + "errors.py:" + name], capsys)
    assert code == 2
    assert "Traceback" not in err and re.search(pattern, refusal_text(err)), err
    assert "correctness matrix" not in out  # no case ran


def test_same_width_constructors_skip_rectangular_cases_with_a_reason(repo_cwd):
    assert registry.get(S + "config_style.py:MinStyleAttention").same_width_only  # one width: n_embd
    df = run_matrix([S + "mha_inside.py:WrapsTorchMHA"], kinds=["forward"])  # (d_in, d_out) around MHA(d_out)
    rect = df[df["shape"] == "oddT_din_ne_dout"]
    assert (rect.status == "skip").all() and rect.message.str.contains("needs d_in == d_out").all()
    assert (df[df["shape"] == "gpt_like"].status == "pass").all()


def test_wrong_only_when_widths_differ_fails_those_cases(repo_cwd, tmp_path):
    """A class whose output projection is Linear(d_in, d_out) maps at d_in == d_out and fails elsewhere."""
    src = (repo_cwd / S / "fused.py").read_text().replace("self.proj = nn.Linear(d_out, d_out)",
                                                           "self.proj = nn.Linear(d_in, d_out)")
    (tmp_path / "fused_bug.py").write_text(src)
    df = run_matrix([f"{tmp_path}/fused_bug.py:FusedQKV"], kinds=["forward"])
    assert (df[df["shape"] == "oddT_din_ne_dout"].status == "error").all()
    assert df[df["shape"] == "oddT_din_ne_dout"].message.str.contains("do not fit d_in=12 != d_out=16").all()
    assert (df[df["shape"] == "gpt_like"].status == "pass").all()


# --- binding --------------------------------------------------------------------------------------

def test_binding_by_name_in_any_order():
    class M(torch.nn.Module):
        def __init__(self, d_in, d_out, num_heads, context_length, dropout=0.0, qkv_bias=False, extra=7):
            super().__init__()
            self.got = dict(d_in=d_in, d_out=d_out, num_heads=num_heads, context_length=context_length,
                            dropout=dropout, qkv_bias=qkv_bias, extra=extra)

    spec = AttnSpec(12, 16, 10, 0.25, 4, True)
    assert bind(M)(spec).got == {**spec.kwargs(), "extra": 7}
    assert not bind(M).same_width_only


def test_binding_positional_only_when_names_say_nothing():
    class M(torch.nn.Module):
        def __init__(self, a, b, c, d, e, qkv_bias=False):
            super().__init__()
            self.got = (a, b, c, d, e, qkv_bias)

    assert bind(M).style == "positional"
    assert bind(M)(AttnSpec(12, 16, 10, 0.25, 4, True)).got == (12, 16, 10, 0.25, 4, True)


def test_binding_unknown_required_parameter_is_one_clear_error():
    class M(torch.nn.Module):
        def __init__(self, d_model, n_heads, attn_layout: str):
            super().__init__()

    with pytest.raises(PluginLoadError, match=r"'attn_layout'.*attnbench adapt"):
        bind(M)


def test_config_object_carries_every_codebase_s_names():
    config = SpecConfig.for_spec(AttnSpec(32, 32, 16, 0.1, 4, True))
    assert (config.n_embd, config.n_head, config.block_size, config.dropout, config.bias) == (32, 4, 16, 0.1, True)
    assert (config.attn_pdrop, config.resid_pdrop) == (0.1, 0.0)  # residual dropout: 0 (README)
    assert (config.hidden_size, config.num_attention_heads, config["max_position_embeddings"]) == (32, 4, 16)
    assert config.attention_dropout == 0.1 and config.head_dim == 8 and getattr(config, "missing", None) is None
    assert config.partial_rotary_factor == 1.0 and config.rotary_dim == 8  # the whole head rotated (no rope_head_dim)
    with pytest.raises(AttributeError, match="no field 'attn_kernel_type'"):  # guessed only for a class's build
        config.attn_kernel_type  # noqa: B018


def test_constructor_without_dropout_declares_none(repo_cwd):
    impl = registry.get(S + "bias_free.py:BiasFreeRect")
    assert impl.dropout == ("cpu", "cuda")
    assert registry.get(S + "bias_free.py:BiasFree").dropout == ()


def test_unknown_capability_key_points_to_the_readme(tmp_path):
    (tmp_path / "caps.py").write_text((tmp_path.parent / "x").name and
                                      "from torch import nn\nclass C(nn.Module):\n"
                                      "    attnbench_capabilities = {'no_dropout': True}\n"
                                      "    def __init__(self, d_in, d_out, context_length, dropout, num_heads):\n"
                                      "        super().__init__()\n        self.proj = nn.Linear(d_in, d_out)\n")
    with pytest.raises(PluginLoadError, match=r"unknown key\(s\) \['no_dropout'\].*docs/own-attention.md: Capabilities"):
        registry.get(f"{tmp_path}/caps.py:C")


# --- loading --------------------------------------------------------------------------------------

def test_file_plugin_imports_its_siblings_like_python_file_py(repo_cwd):
    folder = str(repo_cwd / S / "sibling")
    impl = registry.get(S + "sibling/attention_with_helper.py:SiblingImport")
    assert "attention_helpers" in sys.modules and folder not in sys.path  # only while importing
    assert impl.build(AttnSpec(8, 8, 4, 0.0, 2))(torch.randn(1, 3, 8)).shape == (1, 3, 8)


def test_display_name(repo_cwd):
    impl = registry.get(f"mine={S}fused.py:FusedQKV")
    assert impl.name == "mine" and impl.source.endswith("fused.py")
    assert run_matrix([f"mine={S}fused.py:FusedQKV"], kinds=["causality"]).impl.tolist() == ["mine"]


# --- layout ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("token, role", [("W_query", "q"), ("q_proj", "q"), ("wq", "q"), ("to_qkv", "qkv"),
                                         ("c_attn", "qkv"), ("Wqkv", "qkv"), ("in_proj_weight", "qkv"),
                                         ("c_proj", "o"), ("o_proj", "o"), ("wo", "o"), ("dense", "o"),
                                         ("bias_k", "k"), ("value", "v"), ("alpha", None), ("ln_1", None),
                                         ("out_proj_weight", "o"), ("layer_norm_weight", None), ("weight", None)])
def test_role_of_names(token, role):
    assert role_of(token) == role


@pytest.mark.parametrize("name", ["fused.py:FusedQKV", "fused.py:FusedParams", "einsum.py:EinsumParams",
                                  "per_head.py:PerHeadModuleList", "mha_inside.py:WrapsTorchMHA",
                                  "config_style.py:NanoStyleAttention"])
@pytest.mark.parametrize("qkv_bias", [False, True])
def test_discovered_layout_round_trips_and_is_differentiable(repo_cwd, name, qkv_bias):
    impl = registry.get(S + name)
    square = impl.same_width_only or "MHA" in name  # MHA(d_out) inside: found to need d_in == d_out once built
    spec = AttnSpec(16, 16, 8, 0.0, 2, qkv_bias) if square else AttnSpec(12, 16, 8, 0.0, 4, qkv_bias)
    module = impl.build(spec, dtype=torch.float64)
    w = random_weights(spec, seed=2)
    back = export_weights(load_weights(module, w, spec), spec)
    held = adapter_for(module).held_at_zero
    for n, t in w.items():
        torch.testing.assert_close(getattr(back, n), torch.zeros_like(t) if n in held else t, rtol=0, atol=0)
    leaves = w.leaves()
    state = adapter_for(module).to_state(leaves, spec)
    total = sum(v.sum() for v in state.values())
    grads = torch.autograd.grad(total, [t for n, t in leaves.items() if n not in held], allow_unused=True)
    assert all(g is not None for g in grads)


def test_orientation_comes_from_shapes_not_from_the_reference(repo_cwd):
    """(d_in, d_out) Parameters are transposed; (d_out, d_in) ones are not, even when that is the bug."""
    right = registry.get(S + "einsum.py:EinsumParams").factory(PROBE)
    wrong = registry.get(S + "einsum.py:EinsumParamsUntransposed").factory(PROBE)
    by_param = {s.param: s for s in discover(right, PROBE).sources}
    assert by_param["W_query"].transposed and not by_param["out_proj.weight"].transposed
    assert not {s.param: s for s in discover(wrong, PROBE).sources}["W_query"].transposed


def test_bias_free_layers_hold_missing_biases_at_zero(repo_cwd):
    module = registry.get(S + "bias_free.py:BiasFree").build(AttnSpec(16, 16, 8, 0.0, 2, True))
    assert adapter_for(module).held_at_zero == {"b_q", "b_k", "b_v", "b_o"}
    module = registry.get(S + "fused.py:FusedQKV").build(AttnSpec(12, 16, 8, 0.0, 4, True))
    assert adapter_for(module).held_at_zero == frozenset()


def test_display_name_is_the_impl_column_of_run_rows():
    from attnbench.results.schema import Cell, empty_row

    row = empty_row(Cell(f"nb={S}argument_order.py:NotebookOrder", "cpu", "float32", 1, 8, 2, 16, "forward", "warm"))
    assert row["impl"] == "nb"


@pytest.mark.cuda
def test_styles_pass_on_cuda(cuda_device, repo_cwd, capsys):
    names = [S + "fused.py:FusedQKV", S + "config_style.py:NanoStyleAttention", S + "mha_inside.py:WrapsTorchMHA"]
    df = run_matrix(names, device=cuda_device, kinds=KINDS)
    bad = df[df.status.isin(["fail", "error"])]
    assert bad.empty, "\n".join(f"{r.impl} {r.kind} {r.shape} {r.dtype}: {r.message}" for r in bad.itertuples())
    code, out, err = run_cli(["check", "--device", cuda_device, "-v", S + "einsum.py:EinsumParamsUntransposed",
                              "--kind", "forward"], capsys)
    assert code == 1 and "W_query <-" not in out and "W_q <- W_query" in out, out + err


def test_class_that_refuses_the_probe_sizes_still_runs_the_cases_it_can(repo_cwd, tmp_path, capsys):
    src = (repo_cwd / S / "argument_order.py").read_text().replace(
        'assert d_out % num_heads == 0, "d_out must be divisible by num_heads"', 'assert d_out >= 32, "wide layers only"')
    (tmp_path / "wide_only.py").write_text(src)
    code, out, err = run_cli(["check", f"{tmp_path}/wide_only.py:NotebookOrder", "--kind", "forward"], capsys)
    assert code == 1, err  # not a setup error: some sizes build
    df = run_matrix([f"{tmp_path}/wide_only.py:NotebookOrder"], kinds=["forward"])
    errors = df[df.status == "error"]
    assert len(errors) and errors.message.str.contains("wide layers only").all()
    assert (df[df["shape"].isin(["gpt_like", "hd64_square"])].status == "pass").all()


# --- what a class computes, inferred (plugins.inference), and chapter-4-style KV caches unchanged -----------

KV_STYLES = {  # class -> the variant and decode cases that must run (not be skipped) and pass
    "kv_growing.py:MultiHeadAttention": {("decode", "decode_mha")},
    "kv_optimized.py:MultiHeadAttention": {("decode", "decode_mha")},
    "kv_gqa.py:GroupedQueryAttention": {("forward", "gqa"), ("forward", "mqa_din_ne_dout"), ("decode", "decode_gqa")},
    "kv_swa.py:MultiHeadAttentionWithSWA": {("forward", "window"), ("forward", "window1"), ("decode", "decode_mha"),
                                            ("decode", "decode_window_long_prefill")},
    "llama_style.py:LlamaStyleAttention": {("forward", "gqa")},
}


@pytest.mark.parametrize("name", list(KV_STYLES))
def test_kv_cache_styles_run_their_variant_and_decode_cases_unchanged(repo_cwd, name):
    df = run_matrix([S + name], kinds=["forward", "decode"])
    bad = df[df.status.isin(["fail", "error"])]
    assert bad.empty, "\n".join(f"{r.kind} {r.shape} {r.dtype}: {r.message}" for r in bad.itertuples())
    passed = {(r.kind, r.shape) for r in df[df.status == "pass"].itertuples()}
    assert KV_STYLES[name] <= passed, KV_STYLES[name] - passed


def test_inference_reads_names_config_fields_and_use_cache(repo_cwd):
    gqa, swa, opt, llama = (registry.get(S + n) for n in ("kv_gqa.py:GroupedQueryAttention", "kv_swa.py:MultiHeadAttentionWithSWA",
                                                          "kv_optimized.py:MultiHeadAttention", "llama_style.py:LlamaStyleAttention"))
    assert (gqa.gqa, gqa.sliding_window, gqa.kv_cache) == (True, False, True)
    assert (swa.gqa, swa.sliding_window, swa.kv_cache) == (False, True, True)
    assert (opt.gqa, opt.sliding_window, opt.kv_cache) == (False, False, True)  # window_size sizes its cache
    assert (llama.gqa, llama.sliding_window, llama.kv_cache) == (True, False, False)
    assert "config fields read (what it reads is what it supports): hidden_size, num_attention_heads, num_key_value_heads" in \
        llama.factory.evidence[0]


def test_check_verbose_prints_each_inference_and_its_evidence(repo_cwd, capsys):
    code, out, err = run_cli(["check", "-v", "--kind", "decode", S + "kv_gqa.py:GroupedQueryAttention"], capsys)
    assert code == 0, out + err
    out = " ".join(out.split())  # the console wraps long lines
    assert ("inferred gqa: yes (constructor takes num_kv_groups, the number of key/value heads; confirmed: with 3 kv "
            "heads of 4 its key/value projections are 12 wide)") in out
    assert re.search(r"inferred kv_cache: yes \(forward takes use_cache, the class has reset_cache\(\); no rewind_cache: "
                     r"the decode timer restores the cache state after each step; a step replaces cache_k, cache_v; "
                     r"changes ptr_current_pos\)", out), out


def test_declared_capabilities_override_the_inference(tmp_path, capsys):
    path = tmp_path / "declared.py"
    path.write_text((REPO_STYLES / "kv_gqa.py").read_text() + "\n\nclass NoGQA(GroupedQueryAttention):\n"
                    "    attnbench_capabilities = {'gqa': False, 'kv_cache': False}\n")
    impl = registry.get(f"{path}:NoGQA")
    assert (impl.gqa, impl.kv_cache) == (False, False)
    assert "gqa: no (declared in attnbench_capabilities)" in impl.factory.evidence
    assert not any(line.startswith(("gqa: yes", "kv_cache: yes")) for line in impl.factory.evidence)


@pytest.mark.parametrize(("name", "pattern"), [
    ("UseCacheWithoutReset", r"UseCacheWithoutReset\.forward takes use_cache but the class has no method to empty its cache"),
    ("CacheInAGlobal", r"CacheInAGlobal's decode step changes state attnbench cannot restore: .*rewind_cache\(n\)"),
    ("KVGroupsAsGroupSize", r"takes num_kv_groups as the number of key/value heads, but built with num_heads=6, "
                            r"num_kv_groups=3 its key/value projections are not 3 x head_dim 4 = 12 wide \(W_key.weight has "
                            r"shape \(8, 20\)"),
])
def test_cache_and_kv_head_errors_are_one_line_and_exit_2(repo_cwd, capsys, name, pattern):
    for argv in (["check", S + "kv_buggy.py:" + name], ["run", "--impl", S + "kv_buggy.py:" + name, "--mode", "decode"]):
        code, out, err = run_cli(argv, capsys)
        assert code == 2 and "Traceback" not in err, err
        assert re.search(pattern, refusal_text(err)), err


@pytest.mark.parametrize(("name", "where"), [("DecodeMaskOffByOne", "decoded"), ("PointerNeverAdvances", "decoded")])
def test_wrong_cached_path_is_flagged_with_a_restore_in_the_property(repo_cwd, name, where):
    df = run_matrix([S + "kv_buggy.py:" + name], kinds=["decode"])
    bad = df[df.status == "fail"]
    assert not bad.empty and (df.status != "error").all(), df.to_string()
    assert any(where in m for m in bad.message), bad.message.tolist()


def test_use_cache_with_a_cache_passed_in_is_not_a_kv_cache_class(tmp_path):
    path = tmp_path / "hf_like.py"
    path.write_text((REPO_STYLES / "llama_style.py").read_text().replace(
        "    def forward(self, hidden_states):",
        "    def forward(self, hidden_states, past_key_value=None, use_cache=False):"))
    impl = registry.get(f"{path}:LlamaStyleAttention")
    assert impl.kv_cache is False and impl.gqa is True
    assert ("kv_cache: no (forward takes past_key_value, but a probe step returned no next cache: the cache is passed "
            "in, not kept by the class)") in impl.factory.evidence
