"""Roles decided by probes (plugins.roles, plugins.stages), the first true cause, and `attnbench adapt`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from attnbench.plugins.binding import bind
from tests.test_exit_status import cli as run  # attnbench ARGS in this process: (exit status, stdout, stderr)

R = "tests/plugins/roles/conventions.py:"


@pytest.mark.parametrize("cls", ["TwoInts", "Unnamed", "FlagCausal", "Bf16Weights", "OptionalMasks"])
def test_a_real_convention_passes_check_unchanged(repo_cwd, capsys, cls):
    code, out, err = run(["check", "-v", R + cls, "--kind", "forward,backward,causality"], capsys)
    assert code == 0, out + err
    assert re.search(r"PASS \(\d+ passed", out), out


@pytest.mark.parametrize("target", ["kwargs_config_padding_mask.py:KwargsConfigAttention",
                                    "rope_and_length_by_other_names.py:RopeArgAttention",
                                    "width_named_n_state.py:StateWidthAttention",
                                    "string_causal_mask.py:StringMaskAttention",
                                    "batched_mask.py:BatchedMaskAttention",
                                    "query_and_value_head_sizes.py:SplitHeadSizesAttention",
                                    "query_and_value_head_sizes.py:LengthsAttention",
                                    "placement_and_config_guesses.py:PlacedAttention",
                                    "placement_and_config_guesses.py:KernelTypeAttention",
                                    "placement_and_config_guesses.py:NestedArgsAttention"])
def test_reach_conventions_pass(repo_cwd, capsys, target):
    """Classes reproducing minimind (a **kwargs config, a padding mask left None), lit-llama (``rope``,
    ``max_seq_length``), Whisper (``n_state``; a mask whose content is ignored) and lingua (a constructor theta beside
    forward tables, rotation matrices), sooftware/attentions (a ``(B, T, T)`` mask: the causal probe runs two rows, so a
    form that works at batch 1 only is not bound), sgrvinod's tutorial (query and value head sizes, both the head dim;
    keys and values fused in an unnamed projection; causal by a flag; each key sequence's length ``(B,)`` given, by a
    probe), shap-e (a required ``device`` and ``dtype``) and metavoice (``config.attn_kernel_type``, compared with
    ``"torch_attn"``): tests/plugins/reach_roles."""
    code, out, err = run(["check", "tests/plugins/reach_roles/" + target, "--kind", "forward,backward,causality,decode"],
                         capsys)
    assert code == 0 and "PASS" in out, out + err


def test_a_whole_block_is_refused_as_such(repo_cwd, capsys):
    code, _, err = run(["check", R + "WholeBlock"], capsys)
    assert code == 2 and "is a whole block, not an attention layer" in err and "attn (TwoInts)" in err


def test_two_unknown_ints_get_width_and_heads_by_the_projections_shapes(repo_cwd):
    from attnbench.plugins import import_file

    module = import_file("tests/plugins/roles/conventions.py")
    binding = bind(module.Unnamed)
    assert dict(binding.params) == {"a": "d_in", "b": "num_heads"}
    assert "roles decided by a probe" in binding.describe()


def test_verbose_names_the_flag_and_the_cast(repo_cwd, capsys):
    _, out, _ = run(["check", "-v", R + "FlagCausal", "--kind", "causality"], capsys)
    assert "autoregressive: set to True for causal attention" in out
    _, out, _ = run(["check", "-v", R + "Bf16Weights", "--kind", "causality"], capsys)
    assert "built in bfloat16: cast as a whole" in out


def test_construction_is_the_first_cause_not_a_later_symptom(repo_cwd, capsys):
    code, out, err = run(["check", R + "BrokenInit"], capsys)
    assert code == 2
    headline = err.strip().splitlines()[0]
    assert headline.startswith("error: BrokenInit cannot be built"), err
    assert "TypeError" in err and "no_such_argument" in err
    assert "not causal" not in err


def test_an_unsolvable_role_is_named_alone_and_adapt_writes_a_todo_a_user_completes(repo_cwd, capsys, tmp_path):
    code, _, err = run(["check", R + "NeedsLayout"], capsys)
    assert code == 2 and "'layout' (str)" in err and "'width'" not in err and "attnbench adapt" in err
    adapter = tmp_path / "needs_adapter.py"
    code, out, _ = run(["adapt", R + "NeedsLayout", "-o", str(adapter)], capsys)
    assert code == 0 and "1 TODO(s)" in out
    text = adapter.read_text()
    assert "width=spec.d_in" in text and "n_head=spec.num_heads" in text
    code, _, err = run(["check", f"{adapter}:Adapted"], capsys)  # not yet completed: the TODO is the cause
    assert code == 2 and "adapter TODO: layout" in err
    done = tmp_path / "needs_adapter_done.py"  # a new file: this process keeps the first one imported
    done.write_text(re.sub(r"layout=TODO\(.*\),", 'layout="bthd",', text))  # what the user writes
    code, out, err = run(["check", f"{done}:Adapted"], capsys)
    assert code == 0 and "PASS" in out, out + err


def test_adapt_refuses_to_overwrite(repo_cwd, capsys, tmp_path):
    existing = tmp_path / "a.py"
    existing.write_text("x = 1\n")
    code, _, err = run(["adapt", R + "TwoInts", "-o", str(existing)], capsys)
    assert code == 2 and "--force" in err
    assert Path(existing).read_text() == "x = 1\n"


RR = "tests/plugins/reach_roles/"


def _cases(target: str, picks: list[tuple[str, str, str]]):
    """The verdicts of ``target`` on a few chosen cases ``(kind, shape, dtype)`` of the matrix."""
    from attnbench import registry
    from attnbench.correctness.matrix import cases, run_case

    chosen = [c for c in cases([k for k, _, _ in picks]) if (c.kind, c.shape.id, c.dtype) in picks]
    impl = registry.get(RR + target)
    return impl, {(c.kind, c.shape.id): run_case(impl, c) for c in chosen}


def test_strided_kv_heads_and_no_output_projection_pass_as_measured(repo_cwd):
    """x-transformers: query head h reads kv head h % kv_heads (a probe measures the order: the layout reorders the
    query heads), and with one head there is no output projection (W_o held at I)."""
    impl, results = _cases("strided_kv_heads_no_out.py:StridedKVAttention", [
        ("forward", "gqa", "float64"), ("backward", "gqa", "float64"), ("forward", "one_head_bias", "float64")])
    assert len(results) == 3 and all(r.status == "pass" for r in results.values()), \
        [(k, r.status, r.message) for k, r in results.items()]
    from attnbench.spec import AttnSpec

    gqa = AttnSpec(32, 32, 12, 0.0, 4, True, num_kv_heads=2)
    lines = " ".join(impl.build(gqa, "cpu", torch.float32).weight_adapter.layout.describe(gqa))
    assert "query head h reads kv head h % kv_heads (measured)" in lines
    one = AttnSpec(16, 16, 8, 0.0, 1, True)
    assert "W_o = I" in " ".join(impl.build(one, "cpu", torch.float32).weight_adapter.layout.describe(one))


@pytest.mark.slow
def test_an_untyped_config_read_under_a_prefix_passes(repo_cwd):
    """nanoVLM: ``cfg.lm_n_heads``, ``cfg.lm_n_kv_heads``, ``cfg.lm_hidden_dim``, ``cfg.lm_dropout`` on a config of
    no type: each is the alias its longest tail names (n_heads, n_kv_heads, dim, dropout), and the class passes."""
    impl, results = _cases("prefixed_config.py:PrefixedConfigGQA", [
        ("forward", "gqa", "float64"), ("forward", "rope_half_theta500_gqa", "float64"),
        ("backward", "gpt_like", "float64")])
    assert len(results) == 3 and all(r.status == "pass" for r in results.values()), \
        [(k, r.status, r.message) for k, r in results.items()]


@pytest.mark.slow
def test_a_channels_first_layer_of_pointwise_convolutions_passes(repo_cwd):
    """VITS: ``nn.Conv1d(channels, channels, 1)`` projections on ``(B, C, T)``; ``out_channels`` is the input's width
    again (the class fits multi-head attention only where they are equal), and the class passes as it is."""
    impl, results = _cases("channels_first_conv.py:ChannelsFirstAttention", [
        ("forward", "gpt_like", "float64"), ("backward", "gpt_like", "float64"), ("forward", "one_head_bias", "float64")])
    assert len(results) == 3 and all(r.status == "pass" for r in results.values()), \
        [(k, r.status, r.message) for k, r in results.items()]


@pytest.mark.slow
def test_one_head_with_an_inner_width_and_a_config_beside_a_width(repo_cwd):
    """g-mlp: no parameter sets heads (one head, the rest skipped), ``dim_inner`` fits only where the widths are equal
    (checked at one width); GPT-1: ``cfg`` beside ``nx`` gets attnbench's config, ``nx`` the width by a probe, and
    its ``scale=False`` default is set to True by the scale a probe measures (round 13: its model always builds it with
    ``scale=True``; it failed as unscaled in round 12), so both pass."""
    one, results = _cases("one_head_inner_width.py:OneHeadInner", [
        ("forward", "one_head_bias", "float64"), ("forward", "gpt_like", "float64")])
    assert results[("forward", "one_head_bias")].status == "pass", results
    assert results[("forward", "gpt_like")].status == "skip" and "always has one head" in \
        results[("forward", "gpt_like")].message
    assert one.same_width_only
    picks = [("forward", "gpt_like", "float64")]
    _, scaled = _cases("one_head_inner_width.py:ConfigBesideWidthScaled", picks)
    flagged, unscaled = _cases("one_head_inner_width.py:ConfigBesideWidth", picks)
    assert scaled[("forward", "gpt_like")].status == "pass", scaled
    assert unscaled[("forward", "gpt_like")].status == "pass", unscaled
    assert any(line.startswith("scale: set to True, decided by a probe") for line in flagged.factory.evidence)


@pytest.mark.slow
def test_a_query_given_last_is_an_input_though_each_output_reads_its_own_position_only(repo_cwd):
    """TencentPretrain: ``forward(key, value, query, mask)``; ``query`` given x moves only its own position's output
    (as a temperature would), but a query is an input by its name; the causal probe decides, and the class passes."""
    _, results = _cases("key_value_query_order.py:KeyValueQuery", [
        ("forward", "gpt_like", "float64"), ("forward", "gqa", "float64"), ("backward", "gpt_like", "float64")])
    assert len(results) == 3 and all(r.status == "pass" for r in results.values()), \
        [(k, r.status, r.message) for k, r in results.items()]


def test_pointwise_convolutions_on_channels_first_inputs_are_the_same_function_as_linear_layers():
    from torch import nn

    from attnbench.plugins.channels_first import PointwiseConv, as_channels_last, pointwise_convs

    class Convs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Conv1d(6, 6, 1), nn.Conv1d(6, 6, 1), nn.Conv1d(6, 4, 1, bias=False)

        def forward(self, x, scale=1.0):
            return self.c(self.a(x) * self.b(x)) * scale

    torch.manual_seed(0)
    ref = Convs()
    x = torch.randn(2, 5, 6)
    want = ref(x.transpose(1, 2), scale=2.0).transpose(1, 2)
    assert pointwise_convs(ref) == ["a", "b", "c"]
    got = as_channels_last(Convs(), 6)
    got.load_state_dict({k: v[..., 0] if v.dim() == 3 else v for k, v in ref.state_dict().items()})
    assert isinstance(got.a, PointwiseConv) and type(got).__name__ == "Convs"
    torch.testing.assert_close(got(x, scale=2.0), want)
    assert pointwise_convs(nn.Sequential(nn.Conv1d(6, 6, 1), nn.Conv1d(6, 6, 1), nn.Conv1d(6, 6, 3))) == []


def test_a_config_field_read_under_a_prefix_is_the_alias_its_longest_tail_names():
    from attnbench.plugins.binding import SpecConfig

    config = SpecConfig({"n_heads": 4, "dim": 32, "p": 0.1})
    assert (config.lm_n_heads, config.vision_dim, getattr(config, "momh_enabled", False)) == (4, 32, False)
    assert config.__dict__["_attnbench_suffixed"] == {"lm_n_heads": "n_heads", "vision_dim": "dim"}
    assert not hasattr(config, "top_p")  # a one-letter tail is no alias


def test_keys_and_values_read_in_different_orders_are_not_reordered(repo_cwd):
    """``repeat`` on the values and ``repeat_interleave`` on the keys: the value probe alone reads "strided", the key
    probe reads the reference's order, and no order of the query heads makes the class right, so none is applied
    (its GQA cases fail and localisation names the values' line; tests/test_localize.py)."""
    from attnbench import registry
    from attnbench.plugins import heads
    from attnbench.spec import AttnSpec

    gqa = AttnSpec(32, 32, 12, 0.0, 4, True, num_kv_heads=2)
    for cls, want in (("ValuesTiledKeysInterleaved", ""), ("GroupedSteps", "")):
        impl = registry.get(f"tests/plugins/planted_conventions.py:{cls}")
        assert impl.build(gqa, "cpu", torch.float32).weight_adapter.layout.kv_groups == want, cls
    impl = registry.get(RR + "strided_kv_heads_no_out.py:StridedKVAttention")
    assert impl.build(gqa, "cpu", torch.float32).weight_adapter.layout.kv_groups == heads.STRIDED


def test_a_bias_flag_by_its_effect_and_an_inert_theta_is_no_rope(repo_cwd):
    """mamba's MHA: ``qkv_proj_bias`` is the q/k/v bias switch because building with it adds exactly those biases,
    ``num_heads_kv`` the kv heads because building with it gives grouped-query weights; ``rotary_emb_base`` changes
    nothing as built, so the class is not taken to rotate."""
    impl, results = _cases("bias_flag_inert_theta.py:BiasFlagAttention", [
        ("forward", "one_head_bias", "float64"), ("backward", "one_head_bias", "float64"),
        ("forward", "gpt_like", "float64"), ("forward", "gqa", "float64")])
    assert len(results) == 4 and all(r.status == "pass" for r in results.values()), \
        [(k, r.status, r.message) for k, r in results.items()]
    binding = impl.factory.binding
    assert {("qkv_proj_bias", "qkv_bias"), ("num_heads_kv", "num_kv_heads")} <= set(binding.params)
    assert "decided by a probe" in binding.describe()
    assert impl.gqa and any(line.startswith("gqa: yes (constructor takes num_heads_kv") for line in impl.factory.evidence)
    assert not impl.rope and any(line.startswith("rope: no (constructor takes rotary_emb_base, but a probe")
                                 for line in impl.factory.evidence)


def test_every_required_input_gets_x_for_self_attention(repo_cwd):
    """hkproj's ``forward(q, k, v, mask)``: k and v get the same sequence as q; the mask (0 = hidden) by a probe."""
    impl, results = _cases("qkv_inputs_required_mask.py:QKVInputsAttention", [
        ("forward", "one_head_bias", "float64"), ("causality", "props", "float64")])
    assert len(results) == 2 and all(r.status == "pass" for r in results.values()), \
        [(k, r.status, r.message) for k, r in results.items()]
    assert impl.factory.context.inputs == ("k", "v")


@pytest.mark.parametrize("cls", ["MaskedWhenGiven", "RequiredBias"])
def test_an_optional_or_bias_named_mask_is_probed_for_its_causal_form(repo_cwd, capsys, cls):
    """open_clip: causal only when given `attn_mask` (it was run without one: FAIL, "no causal mask"); VAR: a required
    `attn_bias` (refused: "needs 'attn_bias', which attnbench cannot supply"). Second held-out corpus, round 10."""
    code, out, err = run(["check", "tests/plugins/reach_roles/optional_mask_forms.py:" + cls, "--kind",
                          "forward,backward,causality"], capsys)
    assert code == 0 and "PASS" in out, out + err


def test_a_mask_no_form_of_which_is_causal_leaves_an_encoder_checked_non_causal(repo_cwd, capsys):
    """dinov2's MemEffAttention without xformers ignores its `attn_bias`: it ran without a mask and failed every case
    (round 9), then was refused as not causal with any mask form; it is a ViT's attention, an encoder's (round 20),
    checked against the non-causal reference."""
    code, out, err = run(["check", "tests/plugins/reach_roles/optional_mask_forms.py:NeverCausal", "-v",
                          "--kind", "forward,causality"], capsys)
    assert code == 0 and "causal: no, an encoder's attention" in " ".join(out.split()), out + err


def test_a_class_multi_query_by_construction_runs_its_one_kv_head_cases(repo_cwd, capsys):
    """memorizing-transformers' `to_kv = Linear(dim, 2 * dim_head)` with no kv-heads parameter was refused as
    "to_kv.weight has shape (12, 24), expected (48, 24)"; its weights say it is multi-query (second held-out corpus)."""
    code, out, err = run(["check", "-v", "tests/plugins/reach_roles/multi_query_fused_kv.py:MultiQueryAttention"], capsys)
    assert code == 0 and "PASS" in out, out + err
    assert "kv heads: always 1 (multi-query" in out and "W_k <- to_kv.weight[0:64]" in out
    assert "skipped: its own constraint" in out  # the cases with more kv heads than one


def test_multi_query_is_read_off_the_weights_not_assumed(repo_cwd):
    from attnbench.plugins import import_file
    from attnbench.plugins.layout import SQUARE_PROBE
    from attnbench.plugins.stages import always_one_kv_head

    mqa = bind(import_file("tests/plugins/reach_roles/multi_query_fused_kv.py").MultiQueryAttention)
    mha = bind(import_file("tests/plugins/roles/conventions.py").TwoInts)
    assert always_one_kv_head(mqa, SQUARE_PROBE) and not always_one_kv_head(mha, SQUARE_PROBE)


def test_a_cache_passed_in_under_a_name_of_its_own_is_not_the_class_s_to_empty(repo_cwd, capsys):
    """bark's `forward(x, past_kv=None, use_cache=False)` was refused: "takes use_cache but the class has no method to
    empty its cache" (second held-out corpus); `past_kv` passes the cache in, as `layer_past` does."""
    code, out, err = run(["check", "-v", "tests/plugins/reach_roles/past_kv_returned.py:PastKVAttention"], capsys)
    assert code == 0 and "PASS" in out, out + err
    assert "kv_cache: no (forward takes use_cache with past_kv: the cache is passed in" in out


def test_a_fused_mat_qkv_with_split_biases_and_a_required_attn_bias_passes(repo_cwd, capsys):
    """VAR's `mat_qkv` (refused: "no parameter found for W_q", though the refusal's fix line named it) with q and v
    biases around a zero k-bias buffer, and a required additive `attn_bias` (second held-out corpus)."""
    code, out, err = run(["check", "-v", "tests/plugins/reach_roles/fused_qkv_split_biases.py:SplitBiasAttention"],
                         capsys)
    assert code == 0 and "PASS" in out, out + err
    assert "W_q <- mat_qkv.weight[0:768]" in out and "b_k = 0 (the module has no such parameter" in out


@pytest.mark.parametrize(("cls", "form"), [("ChannelsLastImageAttention", "(B, H, W, C)"),
                                           ("ChannelsFirstImageAttention", "(B, C, H, W)")])
def test_a_forward_that_takes_images_is_refused_as_such(repo_cwd, capsys, cls, form):
    """segment-anything's `Attention` (`B, H, W, _ = x.shape`) failed every case with "not enough values to unpack"
    (second held-out corpus): a sequence raises, an image runs, so it is no sequence attention layer."""
    code, out, err = run(["check", RR + "image_tokens.py:" + cls], capsys)
    assert code == 2 and "Traceback" not in err, out + err
    assert err.splitlines()[0] == (f"error: {cls} takes images {form}, not token sequences (B, T, C): not a sequence "
                                   "attention layer"), err
    assert "not enough values to unpack" in err and "attnbench adapt" in err


def test_a_pre_norm_is_refused_by_its_invariance_and_adapt_writes_the_layer_without_it(repo_cwd, capsys, tmp_path):
    """MEGABYTE's `Attention` norms its input (gain `norm.g`) before its projections: refused "no canonical counterpart
    for norm.g" (a naming problem, which it is not). Its output does not move when x is scaled: a pre-norm, named."""
    code, _, err = run(["check", RR + "pre_norm_input.py:PreNormAttention"], capsys)
    assert code == 2 and err.splitlines()[0] == ("error: PreNormAttention applies a norm (norm.g) to its input before "
                                                 "the projections: a pre-norm block, not a bare attention layer"), err
    assert "scaled (x -> 3x)" in err and "replaces norm with nn.Identity()" in " ".join(err.split())
    adapter = tmp_path / "prenorm_adapter.py"
    code, out, _ = run(["adapt", RR + "pre_norm_input.py:PreNormAttention", "-o", str(adapter)], capsys)
    assert code == 0 and "self.inner.norm = nn.Identity()" in adapter.read_text()
    code, out, err = run(["check", f"{adapter}:Adapted", "--kind", "forward,backward,causality"], capsys)
    assert code == 0 and "PASS" in out, out + err  # the rest of the class is a correct causal attention


def test_the_input_probe_leaves_a_bare_attention_layer_alone(repo_cwd):
    from attnbench.plugins import forms, import_file

    for path, cls in (("tests/plugins/roles/conventions.py", "TwoInts"), (RR + "pre_norm_input.py", "PreNormAttention")):
        binding = bind(getattr(import_file(path), cls))
        found = forms.probe_class(binding, None, binding.probe, __import__("contextlib").nullcontext())
        assert (found.norm if found else None) == (None if cls == "TwoInts" else "norm"), (cls, found)


def test_rotation_tables_under_a_name_of_their_own_are_given_by_a_probe(repo_cwd):
    """flux's `forward(x, pe)` was refused "needs 'pe', which attnbench cannot supply": None, x again and position ids
    raise, rotation matrices (..., head_dim/2, 2, 2) run, causal: its RoPE cases pass."""
    impl, results = _cases("rotation_pe_argument.py:PeTableAttention", [
        ("forward", "rope_interleaved_theta100_bias", "float64"), ("forward", "gpt_like", "float64"),
        ("backward", "gpt_like", "float64")])
    assert len(results) == 3 and all(r.status == "pass" for r in results.values()), \
        [(k, r.status, r.message) for k, r in results.items()]
    plan = impl.factory.context
    assert (plan.tables, plan.table_form, plan.probed) == (("pe",), "matrix", ()) and impl.rope == ("interleaved",)


def test_rotary_tables_defaulting_to_none_are_probed_too(repo_cwd):
    """LlamaGen's `freqs_cis: torch.Tensor = None`, applied unconditionally: left at None, every mask form raised and
    the class was refused as not causal (found by a held-out corpus); probed, it gets real (..., 2) tables and passes."""
    impl, results = _cases("optional_tensor_tables.py:OptionalTablesAttention", [
        ("forward", "rope_interleaved_theta100_bias", "float64"), ("forward", "gpt_like", "float64")])
    assert len(results) == 2 and all(r.status == "pass" for r in results.values()), \
        [(k, r.status, r.message) for k, r in results.items()]
    assert impl.factory.context.tables == ("freqs_cis",) and impl.rope == ("interleaved",)


def test_flux_style_attention_is_refused_as_never_causal_once_its_tables_are_given(repo_cwd, capsys):
    code, _, err = run(["check", RR + "rotation_pe_argument.py:NeverCausalPeAttention"], capsys)
    head = err.splitlines()[0]
    assert code == 2 and "is not causal with any mask form attnbench can supply" in head and "pe given rotary" in head
    assert "pe as rotation matrices, no mask: not causal" in " ".join(err.split())


def test_query_key_value_inputs_get_x_and_pass(repo_cwd):
    """`nn.MultiheadAttention`'s `forward(query, key, value, attn_mask=None, need_weights=True)`: key and value are
    inputs the class attends over (changing them at one position moves later outputs), so x again."""
    impl, results = _cases("second_inputs.py:QueryKeyValueAttention", [
        ("forward", "one_head_bias", "float64"), ("backward", "gpt_like", "float64"), ("causality", "props", "float64")])
    assert len(results) == 3 and all(r.status == "pass" for r in results.values()), \
        [(k, r.status, r.message) for k, r in results.items()]
    assert impl.factory.context.inputs == ("key", "value") and impl.factory.context.mask == "attn_mask"


def test_cross_attention_of_a_fixed_other_width_is_refused_as_such(repo_cwd, capsys):
    code, _, err = run(["check", RR + "second_inputs.py:FixedWidthCrossAttention"], capsys)
    headline = ("FixedWidthCrossAttention is cross-attention: context has a width of its own, so it cannot be x: not "
                "a self-attention layer")
    assert code == 2 and err.splitlines()[0] == f"error: {headline}", err
    assert "to_k takes 40 features" in err


@pytest.mark.slow  # a whole check of a class (round 20): the README's fast set stays under 5 minutes
def test_cross_attention_given_x_with_no_causal_form_is_checked_as_an_encoder_s(repo_cwd, capsys):
    """Stable Diffusion's ``CrossAttention(query_dim, context_dim)`` with a padding mask, its context given x: it was
    refused as "cross-attention: not causal with any mask form"; given x it is a non-causal self-attention (round 20),
    which is what ldm computes with ``context=None``, and is checked so."""
    code, out, err = run(["check", RR + "second_inputs.py:CrossAttention", "-v", "--kind", "forward,causality"], capsys)
    said = " ".join(out.split())
    assert code == 0 and "causal: no, an encoder's attention" in said, out + err


@pytest.mark.parametrize("cls", ["MaskedCrossAttention", "DefaultWidthCrossAttention"])
def test_cross_attention_whose_context_width_can_be_x_s_passes_as_self_attention(repo_cwd, cls):
    """`context_dim` (required, or an optional int) is the width of the second input by its effect on the weights:
    given d_in, and the context given x, the class with a (T, S) mask is a correct causal self-attention."""
    impl, results = _cases("second_inputs.py:" + cls, [("forward", "gpt_like", "float64"),
                                                        ("causality", "props", "float64")])
    assert all(r.status == "pass" for r in results.values()), [(k, r.status, r.message) for k, r in results.items()]
    assert ("context_dim", "d_context") in impl.factory.binding.params and impl.factory.context.inputs == ("context",)


UN = "unnamed_projections.py:"


@pytest.mark.parametrize("cls", ["ListedProjections", "FourNets", "ShuffledNets", "ConcatOut", "FrozenScale"])
def test_projections_no_name_binds_are_bound_by_shape_and_probe(repo_cwd, capsys, cls):
    """BERT-pytorch's ModuleList of three, pytorch-original-transformer's four unnamed nets, hyunwoongko's w_concat and
    PatchTST's frozen scale were refused at the weight mapping (a held-out corpus); bound by shape, ordered by a probe,
    they pass."""
    dtypes = ["--dtype", "float32"] if cls == "FrozenScale" else []  # in float64 its scale is float32-rounded
    code, out, err = run(["check", "-v", RR + UN + cls, "--kind", "forward,backward,causality,no_side_effects", *dtypes],
                         capsys)  # no_side_effects hashed a 0-dim parameter as bytes and raised (PatchTST)
    assert code == 0 and "PASS" in out, out + err
    said = " ".join(out.split())
    if cls == "ShuffledNets":  # registration order is v, q, k: only the probe binds them right
        assert "q <- qkv_nets.1, k <- qkv_nets.2, v <- qkv_nets.0: measured" in said  # o: out_projection's name
        assert "W_o <- out_projection_net.weight" in said
    if cls == "FrozenScale":
        assert "scale: kept as built" in said


def test_the_role_probe_reads_what_each_projection_does_not_its_place():
    """:func:`by_shape.qkv_roles` on a plain causal attention that reads its slots in a shuffled order finds that
    order, with and without the output projection among the slots, and says None for a class it cannot read (keys
    rotated by position)."""
    from attnbench.plugins import by_shape
    from attnbench.spec import AttnSpec

    spec = AttnSpec(d_in=8, d_out=8, context_length=8, dropout=0.0, num_heads=2)

    def attention(wq, wk, wv, wo, x, rotate=False):
        q, k, v = x @ wq.T, x @ wk.T, x @ wv.T
        if rotate:
            k = k * torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[:, None]
        b, t, d = q.shape
        q, k, v = (z.view(b, t, 2, d // 2).transpose(1, 2) for z in (q, k, v))
        s = (q @ k.transpose(-2, -1) / (d // 2) ** 0.5).masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
        return (s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d) @ wo.T

    def slots(w):
        return [w.W_q, w.W_k, w.W_v, w.W_o]

    for order in ((0, 1, 2), (2, 0, 1), (1, 2, 0)):  # slot indices of q, k, v
        def run3(w, x, order=order):
            m = slots(w)
            return attention(m[order[0]], m[order[1]], m[order[2]], w.W_o, x)
        assert by_shape.qkv_roles(run3, spec) == order
    def run4(w, x):  # registration order o, v, q, k
        m = slots(w)
        return attention(m[2], m[3], m[1], m[0], x)
    assert by_shape.qkv_roles(run4, spec, slots=4) == (2, 3, 1, 0)
    assert by_shape.qkv_roles(lambda w, x: attention(*slots(w), x, rotate=True), spec) is None


def test_a_score_scale_switched_on_by_a_flag_is_set_by_the_scale_it_causes(repo_cwd, capsys):
    """GPT-2's ``Attention(nx, n_ctx, config, scale=False)`` with transposed ``Conv1D`` weights: the flag is set by the
    scale measured with each value (tests/plugins/reach_roles/scale_flag_conv1d.py). Its ``x.view(-1, C)`` refuses a
    strided input, which fails ``strided_input`` alone: the decode cases give each step's tokens contiguous."""
    target = "tests/plugins/reach_roles/scale_flag_conv1d.py:ScaleFlagAttention"
    code, out, err = run(["check", "-v", target, "--kind", "forward,backward,causality,decode"], capsys)
    assert code == 0 and "PASS" in out, out + err
    assert "scale: set to True, decided by a probe (as built, scale=False, its scores are scaled by 1;" in out
    assert "first plain member" not in out
    code, out, err = run(["check", target, "--kind", "strided_input"], capsys)
    assert code == 1 and "refuses a non-contiguous input" in out, out + err


def test_the_scale_probe_reads_a_class_s_scale_and_leaves_one_without_a_flag_alone(repo_cwd):
    from attnbench import registry
    from attnbench.plugins.scale_flag import measured_scale

    impl = registry.get("tests/plugins/reach_roles/scale_flag_conv1d.py:ScaleFlagAttention")
    assert measured_scale(impl.factory) == pytest.approx(6 ** -0.5, rel=1e-9)  # PROBE: 4 heads of 6, flag set
    plain = registry.get("tests/plugins/reach_roles/width_named_n_state.py:StateWidthAttention")
    assert measured_scale(plain.factory) == pytest.approx(6 ** -0.5, rel=1e-9)
    assert not any("decided by a probe (as built" in line for line in plain.factory.evidence)


def test_a_time_first_forward_is_checked_transposed(repo_cwd, capsys):
    """fairseq's ``MultiheadAttention`` reads ``tgt_len, bsz, embed_dim = query.size()``: given (B, T, C) no mask form
    runs, transposed it binds (key and value the query again, key_padding_mask and incremental_state None) and passes."""
    target = "tests/plugins/reach_roles/time_first_fairseq.py:MultiheadAttention"
    code, out, err = run(["check", "-v", target, "--kind", "forward,backward,causality"], capsys)
    assert code == 0 and "PASS" in out, out + err
    assert "time first: its forward takes (T, B, C)" in out
    assert "bound key_padding_mask, incremental_state: None" in out


def test_a_forward_that_needs_its_biases_is_checked_with_them_held_on(repo_cwd, capsys):
    """ESM's fairseq copy concatenates its three biases on its fused path: built with ``bias=False`` no form of its
    forward runs, so the switch is held True (zeros loaded where the case has no biases), and it is time first too."""
    target = "tests/plugins/reach_roles/time_first_fairseq.py:FastPathMultiheadAttention"
    code, out, err = run(["check", "-v", target, "--kind", "forward,backward,causality"], capsys)
    assert code == 0 and "PASS" in out, out + err
    assert "bias=True always: with bias=False no form of its forward ran" in out
    assert "time first: its forward takes (T, B, C)" in out


@pytest.mark.parametrize("cls", ["ArgsConfigAttention", "EmptyCacheAttention"])
def test_a_config_named_args_and_a_cache_with_a_default_of_its_own_pass(repo_cwd, capsys, cls):
    """happy-llm's ``(args: ModelArgs, is_causal=False)`` (placeholders for a whole model's required fields) and
    wenet's ``cache=torch.zeros((0, 0, 0, 0))`` (kept at its default outside decoding)."""
    target = "tests/plugins/reach_roles/args_config_cache_default.py:" + cls
    code, out, err = run(["check", "-v", target, "--kind", "forward,backward,causality,decode"], capsys)
    assert code == 0 and "PASS" in out, out + err
    if cls == "ArgsConfigAttention":
        assert "vocab_size=1 (required, no spec field: a placeholder)" in out


def test_a_sublayer_with_its_own_norm_is_refused_naming_it(repo_cwd, capsys):
    """FastSpeech2's ``(n_head, d_model, d_k, d_v, dropout)``: ``d_v`` shares the head dim with ``d_k`` (bound by name);
    its ``layer_norm(fc(out) + residual)`` is named, not its constructor."""
    target = "tests/plugins/reach_roles/args_config_cache_default.py:ResidualNormSublayer"
    code, _, err = run(["check", target], capsys)
    text = " ".join(err.split())
    assert code == 2 and "layer_norm: a norm of its own beyond q/k norms, so a sublayer with its norm" in text, err
    assert err.startswith("error: ResidualNormSublayer is a sublayer with a norm of its own (layer_norm)"), err


def test_a_required_window_gets_the_context_length_when_the_spec_has_none(repo_cwd, capsys, tmp_path):
    """lucidrains' ``LocalMHA(*, dim, window_size, ...)`` divides its required window: with no window in the spec it is
    built with one over every position (full causal attention), said by ``-v``; ``adapt`` writes the same."""
    target = "tests/plugins/reach_roles/required_window.py:RequiredWindowLocal"
    code, out, err = run(["check", "-v", target, "--kind", "forward,backward,causality"], capsys)
    assert code == 0 and "PASS" in out, out + err
    assert "window_size: the context length when the spec has no window" in out
    adapter = tmp_path / "window_adapter.py"
    code, out, _ = run(["adapt", target, "-o", str(adapter)], capsys)
    assert code == 0 and "0 TODO(s)" in out and "binds this class by itself" in adapter.read_text()
    assert "window_size=spec.window if spec.window is not None else spec.context_length" in adapter.read_text()


def test_adapt_does_not_say_a_class_that_cannot_be_built_binds_by_itself(repo_cwd, capsys, tmp_path):
    """A class that registers but raises when built is refused in the adapter's docstring, with the exception."""
    adapter = tmp_path / "broken_adapter.py"
    code, _, _ = run(["adapt", R + "BrokenInit", "-o", str(adapter)], capsys)
    assert code == 0
    text = adapter.read_text()
    assert "binds this class by itself" not in text and "attnbench refused the class" in text


def test_q_and_k_norm_biases_are_named_not_a_sublayer(repo_cwd, capsys):
    """uni2ts' ``q_norm``/``k_norm`` LayerNorms with biases: the refusal names the biases; ``q_norm`` is no sublayer norm."""
    code, _, err = run(["check", "tests/plugins/reach_roles/qk_layernorm_bias.py:LayerNormQK"], capsys)
    text = " ".join(err.split())
    assert code == 2 and "biases of its q/k norms" in text and "sublayer" not in text, err


def test_a_config_field_compared_with_strings_gets_the_plain_one_and_verbose_says_so(repo_cwd, capsys):
    code, out, err = run(["check", "-v", "tests/plugins/reach_roles/placement_and_config_guesses.py:KernelTypeAttention",
                          "--kind", "causality"], capsys)
    text = " ".join(out.split())
    assert code == 0, out + err
    assert "config fields attnbench lacks, guessed: attn_kernel_type='torch_attn' (its source compares it with " \
           "'torch_attn', also 'flash_attn')" in text, text


def test_required_device_and_dtype_get_the_case_s(repo_cwd, capsys):
    code, out, err = run(["check", "-v", "tests/plugins/reach_roles/placement_and_config_guesses.py:PlacedAttention",
                          "--kind", "forward", "--dtype", "float64"], capsys)
    text = " ".join(out.split())
    assert code == 0, out + err
    assert "device=<the case's device>, dtype=<the case's dtype>" in text, text


def test_a_config_field_a_guess_cannot_fill_is_named_in_the_construction_refusal(repo_cwd, capsys):
    code, out, err = run(["check", "tests/plugins/reach_roles/placement_and_config_guesses.py:NormClassAttention"], capsys)
    text = " ".join(err.split())
    assert code == 2, out + err
    assert "cannot be built" in text and "TypeError: 'GuessedInt' object is not callable" in text, text
    assert "config fields attnbench lacks, guessed:" in text, text
    assert "norm_class (compared with no string in its source: 0, off; read as a part, the config itself)" in text, text


@pytest.mark.parametrize("cls", ["NeoXStyleAttention", "GroupedFusedAttention"])
def test_fused_rows_held_per_head_are_measured_and_loaded_so(repo_cwd, capsys, cls):
    """GPT-NeoX's ``(B, T, heads, 3 * head_dim)`` and Megatron's grouped ``(B, T, kv_heads, rep + 2, head_dim)``."""
    code, out, err = run(["check", "-v", "tests/plugins/reach_roles/fused_rows_per_head.py:" + cls,
                          "--kind", "forward,backward,causality"], capsys)
    text = " ".join(out.split())
    assert code == 0 and "PASS" in text, out + err
    assert "rows: its fused q/k/v rows are held per kv head" in text, text


def test_fused_rows_in_blocks_are_not_reordered(repo_cwd):
    """nanoGPT's ``c_attn`` (``split(C, dim=2)``): the reference's order, measured as such."""
    from attnbench import registry

    module = registry.get("tests/plugins/reach_roles/placement_and_config_guesses.py:KernelTypeAttention").factory(
        __import__("attnbench.spec", fromlist=["AttnSpec"]).AttnSpec(d_in=24, d_out=24, context_length=9, dropout=0.0,
                                                                      num_heads=4))
    assert not module.weight_adapter.layout.fused_rows


@pytest.mark.parametrize(("cls", "shape"), [("NeoXPartialAttention", "rope_partial_half"),
                                            ("GPTJPartialAttention", "rope_partial_interleaved")])
def test_rotary_over_part_of_each_head_is_bound_by_its_fraction_or_width_and_checked(repo_cwd, capsys, cls, shape):
    """GPT-NeoX's ``config.rotary_pct`` (its fused rows per head too) and GPT-J's ``rotary_dim`` with its own
    interleaved tables: the partial-rotary shapes run and pass."""
    target = "tests/plugins/reach_roles/partial_rotary.py:" + cls
    code, out, err = run(["check", "-v", target, "--shape", shape], capsys)
    text = " ".join(out.split())
    assert code == 0 and "PASS (3 passed, 0 skipped)" in text, out + err
    assert "inferred rope_partial: yes" in text, text


def test_a_class_that_rotates_all_of_each_head_fails_the_partial_cases(repo_cwd, capsys, tmp_path):
    """The same GPT-J class with its rotary width ignored (the whole head rotated) fails exactly the partial cases."""
    source = Path("tests/plugins/reach_roles/partial_rotary.py").read_text()
    planted = source.replace("self.heads, self.head_dim, self.rotary_dim = num_heads, embed_dim // num_heads, rotary_dim",
                             "self.heads, self.head_dim, self.rotary_dim = num_heads, embed_dim // num_heads, "
                             "embed_dim // num_heads")
    assert planted != source
    (tmp_path / "whole.py").write_text(planted)
    code, out, err = run(["check", str(tmp_path / "whole.py") + ":GPTJPartialAttention", "--kind", "forward"], capsys)
    assert code == 1, out + err
    failed = {line.split()[3] for line in out.splitlines() if line.strip().startswith("FAIL")}
    assert failed == {"rope_partial_interleaved"}, out


@pytest.mark.parametrize("cls", ["SplitHeadSizes", "KeyedConfig", "SizeCheckedMask", "CausalNeedsLength", "BiasNamedMask"])
def test_seventh_corpus_conventions_pass(repo_cwd, capsys, cls):
    """FMS's four ints (roles ranked by their hints, three head dims), ParlAI's ``config["embedding_size"]`` (a key
    guessed by its name's role), Hugging Face's eager ``(bsz, 1, q_len, kv_len)`` mask check, MONAI's causal flag that
    needs ``sequence_length``: tests/plugins/reach_roles/hinted_roles_and_masks.py."""
    code, out, err = run(["check", "tests/plugins/reach_roles/hinted_roles_and_masks.py:" + cls,
                          "--kind", "forward,backward,causality"], capsys)
    assert code == 0 and "PASS" in out, out + err


def test_a_config_key_no_spec_field_fills_gets_the_role_its_name_says(repo_cwd, capsys):
    code, out, err = run(["check", "-v", "tests/plugins/reach_roles/hinted_roles_and_masks.py:KeyedConfig",
                          "--kind", "causality"], capsys)
    assert code == 0, out + err
    assert "embedding_size (its name says d_in; read as a part, the config itself)" in " ".join(out.split()), out


def test_a_bare_assert_in_a_constructor_is_named_by_its_line(repo_cwd, tmp_path, capsys):
    (tmp_path / "asserts.py").write_text("import torch\n\n\nclass Asserts(torch.nn.Module):\n"
                                         "    def __init__(self, config):\n        super().__init__()\n"
                                         "        assert config.n_head > 99\n")
    code, out, err = run(["check", str(tmp_path / "asserts.py") + ":Asserts"], capsys)
    text = " ".join(err.split())
    assert code == 2 and "raised AssertionError: at " in text and "asserts.py:7 'assert config.n_head > 99'" in text, text


def test_every_role_assignment_stopping_at_a_distributed_assert_names_that_setup(repo_cwd, tmp_path, capsys):
    """FMS's ``TPMultiHeadAttention``: four ints no name tells, and a constructor that first asserts
    ``torch.distributed.is_initialized()``: the setup is the first cause, not the ints."""
    (tmp_path / "tp.py").write_text("import torch\n\n\nclass TP(torch.nn.Module):\n"
                                    "    def __init__(self, emb_dim, emb_kq, emb_v, nheads, kvheads):\n"
                                    "        assert torch.distributed.is_initialized()\n        super().__init__()\n")
    code, out, err = run(["check", str(tmp_path / "tp.py") + ":TP"], capsys)
    text = " ".join(err.split())
    assert code == 2 and "TP cannot be built on this machine: it needs a distributed/model-parallel setup" in text, text
    assert "'assert torch.distributed.is_initialized()'" in text, text


def test_a_guessed_int_reads_as_the_config_and_copies_as_a_plain_int():
    import copy

    from attnbench.plugins.binding import SpecConfig
    from attnbench.plugins.config_guess import GuessedInt

    config = SpecConfig.for_spec(__import__("attnbench").AttnSpec(24, 24, 9, 0.0, 4))
    guessed = GuessedInt(config, 24)
    assert guessed == 24 and guessed.n_head == 4  # config.model.n_head: the part is the config itself
    assert type(copy.deepcopy(guessed)) is int and copy.deepcopy(guessed) == 24  # a deep-copied module keeps 24


def test_causal_intent_is_read_from_the_forward_and_an_encoder_s_is_causal_false_is_not_it():
    from torch import nn

    from attnbench.plugins.causal_intent import intent

    class Encoder(nn.Module):
        def forward(self, x, mask):
            return nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask, is_causal=False)

    class Decoder(nn.Module):
        def forward(self, x, mask):
            keep = x.new_ones(x.shape[1], x.shape[1]).tril()
            return x * keep.sum()

    assert intent(Encoder) == ""
    assert intent(Decoder).endswith("'keep = x.new_ones(x.shape[1], x.shape[1]).tril()'")


R16 = "tests/plugins/reach_roles/round16_conventions.py:"


@pytest.mark.parametrize("cls", ["ListConfig", "ListReturned", "OptionalSizes", "HeadAxes", "FloatKeepMask",
                                 "AffineProjections", "ScoresReturned"])
def test_round16_conventions_pass(repo_cwd, capsys, cls):
    """modalities (a guessed list field iterates as empty; one tested against None is None), the old GPT-2
    ``Attention`` (returns a list), sockeye (optional sizes under unknown names; a weightless attention child),
    TransformerLens (heads-axis parameters left uninitialised), bert4torch (a float keep-mask), THUMT (square weights
    whose orientation its ``Affine`` module shows) and Whisper (its scores returned beside its output, not a cache):
    each refused or failing before round 16."""
    code, out, err = run(["check", R16 + cls, "--kind", "forward,backward,causality,decode"], capsys)
    assert code == 0 and "PASS" in out, out + err


def test_a_feed_forward_width_makes_a_whole_block(repo_cwd, capsys):
    """STORM's ``AttentionBlock(feat_dim, hidden_dim, num_heads, dropout)``: ``hidden_dim`` is the MLP's width, so the
    class is refused as a block, not for an unknown argument."""
    code, out, err = run(["check", R16 + "FeedForwardBlock"], capsys)
    assert code == 2 and "is a whole block, not an attention layer" in err and "slf_attn" in err, out + err


def test_how_the_round16_conventions_were_bound_is_said(repo_cwd, capsys):
    code, out, err = run(["check", "-v", R16 + "HeadAxes", "--kind", "forward"], capsys)
    assert code == 0, out + err
    assert "left uninitialised by its constructor" in out and "W_q <- W_Q viewed (heads, cols, head_dim)" in out
    assert "b_q <- b_Q viewed (heads, head_dim)" in out
    code, out, err = run(["check", "-v", R16 + "AffineProjections", "--kind", "forward"], capsys)
    assert code == 0 and "stored (out, in): its module adds x @ W.T, measured" in out, out + err
    code, out, err = run(["check", "-v", R16 + "FloatKeepMask", "--kind", "forward"], capsys)
    assert code == 0 and "float, 1 = attend, 0 = hidden" in out, out + err
    code, out, err = run(["check", "-v", R16 + "ListConfig", "--kind", "forward"], capsys)
    assert code == 0 and "qk_norm_config=None (its source tests it against None" in out, out + err


def test_returned_scores_are_not_a_cache(repo_cwd, capsys):
    """Whisper's ``(out, qk)``: ``-v`` says the class keeps no cache of its own, and its decode cases are not run."""
    code, out, err = run(["check", "-v", R16 + "ScoresReturned", "--kind", "forward,decode"], capsys)
    assert code == 0 and "kv_cache: no (forward takes kv_cache, but a probe step returned no next cache" in out, out + err


def test_a_cache_under_an_unknown_name_is_found_by_what_it_does(repo_cwd, capsys):
    """``forward(x, past_kv=None)`` returning ``(out, (k, v))``: ``past_kv`` is no name attnbench knows; a probe finds
    that passing back what a call returned continues it, so the decode cases run: they pass for a correct class and
    fail, at a chunk of several tokens after cached ones, for one that masks nothing once a cache is passed."""
    code, out, err = run(["check", "-v", R16 + "UnnamedCache", "--kind", "forward,decode"], capsys)
    assert code == 0 and "bound past_kv: the cache the previous step returned" in out and "found by a probe" in out
    assert "kv_cache: yes" in out, out + err
    code, out, err = run(["check", R16 + "UnmaskedCachedChunk", "--kind", "forward,decode"], capsys)
    assert code == 1 and "decode, uneven chunks" in out + err, out + err


def test_a_qk_norm_switch_beside_a_theta_with_a_default_is_probed(repo_cwd, capsys):
    """The book's Qwen3 layer that builds its own tables: its QK-norm probe built it with the spec's theta, None, which
    raised, so no QK-norm case ran and keys normed by the queries' norm passed."""
    code, out, err = run(["check", "-v", R16 + "OwnTablesQKNorm", "--kind", "forward"], capsys)
    assert code == 0 and "inferred qk_norm: head (constructor takes qk_norm" in out, out + err
    assert "QK-norm (head)" in out, out + err
    code, out, err = run(["check", R16 + "KeysNormedByQueryNorm", "--kind", "forward"], capsys)
    assert code == 1 and "qknorm" in out + err, out + err


def test_an_int_that_sizes_a_table_attention_has_not_is_named_as_such(repo_cwd, capsys):
    """Music-Transformer's ``max_rel_dist``: the refusal names the table every assignment builds, not the one
    assignment (the dropout, a float) that raised."""
    code, out, err = run(["check", R16 + "RelativeTable"], capsys)
    said = " ".join(err.split())
    assert code == 2 and "with max_rel_dist=context_length it builds, but it holds E.weight (9, 24), which multi-head " \
        "attention has no counterpart for" in said, out + err
    assert "every assignment tried raised" not in err


R17 = "tests/plugins/reach_roles/round17_conventions.py:"


def test_a_class_that_always_rotates_by_a_required_base_is_probed_with_one(repo_cwd, capsys):
    """``(n_heads, d_model, rope_base)`` with ``base ** ...`` in ``__init__``: ``None`` cannot build it, so the causal
    probe builds it with a theta (it was refused as "not causal with any mask form": a later symptom)."""
    code, out, err = run(["check", R17 + "RopeBaseRequired", "--kind", "forward,causality"], capsys)
    assert code == 0 and "PASS" in out, out + err


def test_a_decoder_that_keeps_a_cache_and_masks_nothing_fails_rather_than_is_refused(repo_cwd, capsys):
    """Meta's reference Llama attention, written for one token at a time: its ``cache_k`` says it is a decoder, so a
    step of several tokens that sees later ones fails the causal cases."""
    code, out, err = run(["check", R17 + "OneTokenDecoder", "--kind", "forward,causality"], capsys)
    assert code == 1 and "no causal mask: each token also attends to later tokens" in out, out + err


def test_heads_per_kv_head_in_a_config_is_carried(repo_cwd, capsys):
    """``config.n_kv_groups`` (derived by that repository's own config in ``__post_init__``) is heads // kv heads in
    the config attnbench builds, not a guessed 0."""
    code, out, err = run(["check", "tests/plugins/reach_roles/round17_groups.py:DerivedGroups", "--kind",
                          "forward,causality"], capsys)
    assert code == 0 and "PASS" in out, out + err


@pytest.mark.parametrize("cls", ["OwnLinearModules", "RawHeadsSquareOut", "CacheUpdateLayerFirst",
                                 "CacheUpdateAtPosition", "WideFrequencyTables"])
def test_tenth_corpus_conventions_pass(repo_cwd, capsys, cls):
    """fangpin (from-scratch Linear modules holding ``w``), alan-cooney (a raw square ``W_O`` read like its heads-axis
    q/k/v), from-scratch cache objects updated ``(layer_idx, k, v)`` or ``(start_pos, k, v)``, and llama2.c's names
    for ``(T, head_dim)`` tables: each refused, or failing its decode cases, before round 17."""
    code, out, err = run(["check", R17 + cls, "--kind", "forward,causality,decode"], capsys)
    assert code == 0 and "PASS" in out, out + err


def test_a_relative_import_in_a_folder_without_init_imports_as_a_namespace_package(repo_cwd, capsys):
    code, out, err = run(["check", "tests/plugins/reach_roles/relative_noinit/attention.py:Attention", "--kind",
                          "forward"], capsys)
    assert code == 0 and "PASS" in out, out + err


def test_a_size_set_to_zero_is_no_fit_and_the_block_is_refused_as_one(repo_cwd, capsys):
    code, out, err = run(["check", R17 + "BlockWithRate"], capsys)
    assert code == 2 and err.startswith("error: BlockWithRate is a whole block, not an attention layer"), out + err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_an_inner_attention_whose_one_int_reaches_cuda_is_refused_for_cuda(repo_cwd, capsys):
    code, out, err = run(["check", R17 + "WindowOnGpu"], capsys)
    assert code == 2 and "it needs CUDA, which this machine does not have" in err.splitlines()[0], out + err


def test_a_future_mask_parameter_says_causal_and_a_scrambled_merge_fails(repo_cwd, capsys):
    from attnbench.plugins.causal_intent import intent
    from attnbench.plugins.loading import import_file

    module = import_file(R17.rstrip(":"))
    assert "future_mask" in intent(module.FutureMaskMergeScrambled)
    code, out, err = run(["check", R17 + "FutureMaskMergeScrambled", "--kind", "forward,causality"], capsys)
    assert code == 1 and "FAIL" in out, out + err


R18 = "tests/plugins/reach_roles/round18_conventions.py:"


def test_a_mask_that_reaches_an_inner_module_only_through_kwargs_is_passed_there(repo_cwd, capsys):
    """torchmultimodal's ``forward(q, kv=None, ..., **attn_kwargs)``: no parameter names a mask, and no form of one
    makes it causal, so the mask names are tried through its ``**kwargs``; ``attention_mask`` (a float keep-mask)
    reaches its inner attention. Refused as cross-attention "not causal with any mask form" before round 18."""
    code, out, err = run(["check", R18 + "KeywordMaskOuter", "--kind", "forward,causality", "-v"], capsys)
    assert code == 0 and "PASS" in out, out + err
    assert "bound attention_mask through its **kwargs" in " ".join(out.split()), out


def test_a_cache_the_caller_preallocates_and_the_class_writes_is_given_buffers(repo_cwd, capsys):
    """gemma_pytorch's ``forward(hidden_states, freqs_cis, kv_write_indices, kv_cache, mask, local_mask=None)``: the
    caller's ``(k_cache, v_cache)`` buffers, written in place at the write indices, the mask over every slot; its
    decode cases run with the buffers kept across steps. Refused before round 18 ("raises however attnbench gives
    ...": ``k_cache, v_cache = None``)."""
    target = "tests/plugins/reach_roles/write_indices_cache.py:SlotCacheAttention"  # gemma's, from round 8
    code, out, err = run(["check", target, "--kind", "forward,causality,decode", "-v"], capsys)
    said = " ".join(out.split())
    assert code == 0 and "PASS" in out, out + err
    assert "bound kv_cache: preallocated zero key and value buffers (B, context_length, kv_heads, head_dim)" in said
    assert "inferred kv_cache: yes" in said and " decode " in out, out


def test_a_cache_object_updated_at_a_position_appends_keys_along_their_sequence_axis(repo_cwd, capsys):
    """``kv_cache.update(xk, xv, start_pos)`` with ``(B, S_new, H, D)`` keys: the int is the write position, not a
    layer, and the keys grow along axis 1. Before round 18 each step made a layer of its own and appended along the
    heads: the decoded tokens read the wrong keys."""
    target = "tests/plugins/reach_roles/round18_position.py:UpdateAtPosition"
    code, out, err = run(["check", target, "--kind", "forward,causality,decode"], capsys)
    assert code == 0 and "PASS" in out and " decode " in out, out + err


@pytest.mark.parametrize("cls", ["RopeArgument", "RopeArgumentUnannotated"])
def test_a_rotary_module_the_forward_takes_is_built_for_each_spec(repo_cwd, capsys, cls):
    """``forward(x, rope: RoPE, position_ids, ...)``: the module of its own code, built by its constructor's names
    (``base`` the theta, ``max_seq_len`` the context length), and the class checked on its RoPE cases. Refused before
    round 18 ("needs 'rope', which attnbench cannot supply")."""
    target = f"tests/plugins/reach_roles/round18_rope_module.py:{cls}"
    code, out, err = run(["check", target, "--kind", "forward,causality,decode", "-v"], capsys)
    said = " ".join(out.split())
    assert code == 0 and "PASS" in out and " decode " in out, out + err
    assert "bound rope: a RoPE (a module of its own code the forward takes)" in said, said


def test_a_forward_that_returns_a_dataclass_is_read_by_its_fields(repo_cwd, capsys):
    """``MultiHeadAttentionOutput(output, kv_cache)``: its first field is the output and its second the next cache,
    as a tuple's would be. Refused before round 18 ("not causal with any mask form": the dataclass was the output)."""
    code, out, err = run(["check", R18 + "DataclassOutput", "--kind", "forward,causality,decode", "-v"], capsys)
    assert code == 0 and "PASS" in out and " decode " in out, out + err
    assert "inferred kv_cache: yes" in " ".join(out.split()), out


R19 = "tests/plugins/reach_roles/round19_own_rope.py:"


@pytest.mark.parametrize("cls, said", [
    ("OwnBaseRotary", "rope: half, its own, theta 10000, +theta"),
    ("OwnBaseInterleaved", "rope: interleaved, its own, theta 500000, +theta"),
])
def test_a_rope_no_name_says_is_measured_with_its_own_base(repo_cwd, capsys, cls, said):
    """A class that builds its tables in ``__init__`` from the head size alone (``RotaryEmbedding(head_dim)`` at its
    ``base=10000`` default; Meta's complex ``freqs_cis`` buffer at 500,000) always rotates: its pairing and base are
    measured, and every case is checked with RoPE at that base. Before round 19 it was checked without RoPE and
    failed every case; the complex buffer was also cast to real by the build in float64."""
    code, out, err = run(["check", R19 + cls, "--kind", "forward,causality,backward", "-v"], capsys)
    assert code == 0 and "PASS" in out, out + err
    assert said in " ".join(out.split()), out


def test_a_cached_class_with_its_own_rope_decodes_at_the_cached_offset(repo_cwd, capsys):
    code, out, err = run(["check", R19 + "OwnBaseCached", "--kind", "forward,decode"], capsys)
    assert code == 0 and "PASS" in out and " decode " in out, out + err


def test_a_class_with_its_own_rope_that_leaves_its_keys_unrotated_fails(repo_cwd, capsys):
    """The measurement reads the queries' turn against an unrotated key at position 0, so a class that forgets to
    rotate its keys is still seen to rotate, and fails its cases (the bug), rather than passing as RoPE-free."""
    code, out, err = run(["check", R19 + "OwnBaseKeysUnrotated", "--kind", "forward", "-v"], capsys)
    assert code == 1 and "FAIL" in out, out + err
    assert "its own, theta 10000" in " ".join(out.split()), out


def test_positions_learned_rather_than_rotated_are_no_rope(repo_cwd, capsys):
    code, out, err = run(["check", R19 + "LearnedPositions", "--kind", "forward", "-v"], capsys)
    assert "its own, theta" not in " ".join((out + err).split()), out + err


def test_a_mask_sized_by_a_module_constant_is_the_class_s_own_limit(repo_cwd, capsys):
    """nanoGPT's mask buffer sized by a module-level ``block_size``: nothing the constructor takes sets it, so the
    longest sequence it takes is measured (64) and the longer cases are skipped as its own constraint. Before round
    19 they raised, and the class FAILed."""
    code, out, err = run(["check", "tests/plugins/reach_roles/round19_own_length.py:GlobalBlockSize", "-v"], capsys)
    said = " ".join(out.split())
    assert code == 0 and "PASS" in out, out + err
    assert "context length: at most 64 tokens, its own" in said and "its own constraint" in said, said


def test_a_class_that_takes_any_length_has_no_limit_inferred(repo_cwd, capsys):
    code, out, err = run(["check", "tests/plugins/reach_roles/round19_own_length.py:UnboundedLength",
                          "--kind", "forward,low_precision", "-v"], capsys)
    assert code == 0 and "context length: at most" not in " ".join(out.split()), out + err


R19C = "tests/plugins/reach_roles/round19_conventions.py:"


@pytest.mark.parametrize("cls, said", [
    ("ScoresThenOutput", "bound mask"),  # TimesFM's (scores, output): was "not causal with any mask form"
    ("PaddingMaskRequired", "(B, T) padding mask"),  # d3rlpy's: was "not causal with any mask form"
    ("RequiredFlag", "bound use_kv_cache: False"),  # lag-llama's: was "needs 'use_kv_cache'"
    ("LiteralNorm", "qk_norm=qk_norm"),  # stable-audio's: was "raised ValueError: qk_norm must be one of ..."
    ("DropoutModuleArgument", "bound mask"),  # DI-engine's: was "a whole block, not an attention layer"
    ("GroupSizeConfig", "group_size"),  # T6's llama-gqa (the thirteenth corpus, after its run): was a ZeroDivisionError
])
def test_round19_conventions_pass(repo_cwd, capsys, cls, said):
    """The fourteenth corpus's conventions (a development set), reproduced: each refused before round 19."""
    code, out, err = run(["check", R19C + cls, "--kind", "forward,causality", "-v"], capsys)
    assert code == 0 and "PASS" in out, out + err
    assert said in " ".join(out.split()), out


def test_a_per_dimension_scale_left_empty_is_named_not_a_later_symptom(repo_cwd, capsys):
    """A ``torch.empty`` vector parameter gave the probes NaN, and the class was refused as "not causal with any mask
    form"; its garbage values now give way to ones for the probes, and the refusal names the parameter that has no
    counterpart in multi-head attention."""
    code, out, err = run(["check", R19C + "EmptyQueryScale", "--kind", "forward"], capsys)
    assert code == 2 and "no canonical counterpart for scaling" in " ".join((out + err).split()), out + err


@pytest.mark.slow  # a whole check of a class (round 20): the README's fast set stays under 5 minutes
def test_a_module_that_turns_gradients_off_at_import_is_checked_with_them_on(repo_cwd, capsys):
    """min-dalle's package turns grad mode off as it is imported: every case raised "element 0 of tensors does not
    require grad". The import's switch is put back, and ``-v`` says so."""
    code, out, err = run(["check", "tests/plugins/reach_roles/round20_grad_off_at_import.py:GradOffAtImport",
                          "--kind", "forward,backward", "-v"], capsys)
    said = " ".join(out.split())
    assert code == 0 and "PASS" in out, out + err
    assert "importing its module turned torch's grad mode: True -> False; attnbench put it back" in said, out
    assert torch.is_grad_enabled()


@pytest.mark.slow  # a whole check of a class (round 20): the README's fast set stays under 5 minutes
def test_projections_wider_than_the_model_width_are_the_first_cause_not_causality(repo_cwd, capsys):
    """EAGLE's draft attention: every mask form raised the same shape error at its q projection, and the refusal led
    with "not causal with any mask form"; it names the projection that takes 2 * hidden_size features."""
    code, out, err = run(["check", "tests/plugins/reach_roles/round20_wide_input.py:JoinedStatesAttention"], capsys)
    said = " ".join((out + err).split())
    assert code == 2 and "error: JoinedStatesAttention's q_proj takes 48 features, but its input hidden_states has the " \
        "width its constructor was given (24)" in said, said
    assert "not causal" not in said.split("tried")[0], said


@pytest.mark.slow  # a whole check of a class (round 20): the README's fast set stays under 5 minutes
def test_a_4x_era_hugging_face_copy_decodes_and_its_tables_end_at_the_tokens_it_sees(repo_cwd, capsys):
    """EAGLE's ``modeling_mixtral_kv``: its (out, None, past_key_value) was read as "no next cache" (its probe also
    built it without the theta it needs), and its tables of kv_seq_len rows, indexed by position_ids, raised
    IndexError at a start past 0: an ERROR. It now decodes against the reference, and the start cases are its own
    constraint."""
    code, out, err = run(["check", "tests/plugins/reach_roles/round20_old_hf_tables.py:KvSeqLenTables",
                          "--kind", "forward,decode,rope_start", "-v"], capsys)
    said = " ".join(out.split())
    assert code == 0 and "PASS" in out, out + err
    assert "inferred kv_cache: yes (forward takes past_key_value and returns the next cache" in said, said
    assert re.search(r"│ decode +│ float64 +│ +[1-9]", out), out
    assert "ERROR" not in out, out


RE = "tests/plugins/reach_roles/round20_encoder.py:"


@pytest.mark.parametrize("cls", ["EncoderAttention", "PaddingMaskEncoder"])
def test_an_encoder_s_attention_is_checked_non_causal(repo_cwd, capsys, cls):
    """ViT's attention FAILed every case as "no causal mask", and a BERT-style layer with a padding mask was refused
    as "not causal with any mask form": each is an encoder's attention, checked against the non-causal reference."""
    code, out, err = run(["check", RE + cls, "--kind", "forward,backward,causality", "-v"], capsys)
    said = " ".join(out.split())
    assert code == 0 and "PASS" in out, out + err
    assert "inferred causal: no, an encoder's attention (decided by a probe" in said, said
    assert "1 skipped: an encoder's attention: every case ran non-causal" in said, said


@pytest.mark.parametrize("cls", ["EncoderScaleWrong", "CausalMaskLineGone"])
def test_an_encoder_with_a_bug_and_a_causal_class_without_its_mask_fail(repo_cwd, capsys, cls):
    """A wrong scale in an encoder fails its non-causal cases; a class whose tril buffer says it is causal is not an
    encoder when its mask line is gone: it fails as before."""
    code, out, err = run(["check", RE + cls, "--kind", "forward", "-v"], capsys)
    assert code == 1 and "FAIL" in out, out + err
    assert ("an encoder's attention" in out) == (cls == "EncoderScaleWrong"), out


@pytest.mark.slow  # a whole check of a class (round 20): the README's fast set stays under 5 minutes
def test_the_mask_probe_reads_a_returned_dataclass_by_its_fields(repo_cwd, capsys):
    """Chronos-2's ``AttentionOutput(hidden_states, attn_weights)``: the mask probe compared the returned objects and
    attnbench crashed with a traceback; the dataclass is read as the tuple of its fields, its output first."""
    code, out, err = run(["check", "tests/plugins/reach_roles/round20_dataclass_output.py:DataclassOutput",
                          "--kind", "forward,causality"], capsys)
    assert code == 0 and "PASS" in out, out + err


def test_a_required_optional_config_field_gets_none_and_num_att_heads_is_the_heads():
    """i6_models' config dataclasses: every field required, ``rel_pos_clip: Optional[int]`` among them, and the heads
    as ``num_att_heads``; the dataclass could not be built (``cannot be built``)."""
    import dataclasses
    from typing import Optional

    from attnbench.plugins.aliases import ALIASES
    from attnbench.plugins.configs import placeholders

    @dataclasses.dataclass
    class Cfg:
        input_dim: int
        num_att_heads: int
        rel_pos_clip: Optional[int]  # noqa: UP045 - the spelling i6_models uses
        axes: str | None
        with_bias: bool

    assert placeholders(Cfg, {"input_dim": 8, "num_att_heads": 2}) == {"rel_pos_clip": None, "axes": None,
                                                                       "with_bias": False}
    assert "num_att_heads" in ALIASES["num_heads"]


def test_an_import_s_switches_are_put_back_and_the_cpu_leaves_no_device_mode():
    """What an import turns is put back and said; a default device put back to the CPU is no default at all (a
    ``set_default_device("cpu")`` would leave a TorchFunctionMode under every later call)."""
    from torch.overrides import _get_current_function_mode_stack

    from attnbench.plugins.import_state import kept

    turned: list[str] = []
    with kept(turned):
        torch.set_default_device("meta")
        torch.set_grad_enabled(False)
    assert turned == ["grad mode: True -> False", "default device: cpu -> meta"]
    assert torch.is_grad_enabled() and torch.get_default_device().type == "cpu"
    assert not _get_current_function_mode_stack()
