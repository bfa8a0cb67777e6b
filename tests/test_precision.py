"""Issue 35: right verdicts on real modern layers.

Working precision observed and judged at what a class computes in; a class's own properties (always-on QK-norm, its
own norm epsilon, always-on RoPE, even head dims only) become its spec; factorised layers judged on what they hold;
failure lines that are true and name a verified likely cause; and planted bugs none of that may excuse.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnbench import registry
from attnbench.correctness import precision
from attnbench.correctness.cases import Case, Shape
from attnbench.correctness.matrix import cases, run_case, run_matrix
from attnbench.spec import AttnSpec

C = "tests/plugins/context/"
B = C + "buggy_precision.py:"
NEW_USER = "tests/plugins/styles/new_user.py:ScaledByModelWidth"
QKNORM = next(c.shape for c in cases(["forward"]) if c.shape.id == "qknorm_head_rope_mqa")


def _case(kind: str, shape_id: str, dtype: str = "float64") -> Case:
    return next(c for c in cases([kind]) if c.shape.id == shape_id and c.dtype == dtype)


# --- working precision ---------------------------------------------------------------------------------

def test_observe_names_float32_norms_and_a_float16_softmax(repo_cwd):
    impl = registry.get(C + "qwen3.py:GroupedQueryAttention")
    module = impl.build(QKNORM.spec, "cpu", "float64")
    x = torch.randn(2, 5, QKNORM.spec.d_in, dtype=torch.float64)
    seen = precision.observe(module, lambda: module(x), torch.float64)
    assert set(seen.parts) == {"q_norm", "k_norm"} and seen.kinds == {"norm"} and seen.in_float32
    assert seen.describe() == "float32 in q_norm, k_norm"

    half = registry.get(B + "SoftmaxInHalf").build(QKNORM.spec, "cpu", "float32")
    seen = precision.observe(half, lambda: half(x.float()), torch.float32)
    assert not seen.in_float32 and any("_softmax in float16" in op for op in seen.below32), seen.below32


def test_float32_buffers_of_a_cast_module_are_a_part():
    module = torch.nn.Module()
    module.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
    module.register_buffer("mask", torch.ones(3, 3).triu(1))
    module.double()
    seen = precision.observe(module, lambda: None, torch.float64)
    assert seen.parts == {"RoPE tables": {torch.float32}}


def test_the_relaxed_float64_tolerance_is_derived_not_fixed(repo_cwd):
    """Qwen3's float64 forward passes at a floor derived from the harness's math with its norms in float32: tighter
    than float32's 1e-5, looser than float64's 1e-9."""
    r = run_case(C + "qwen3.py:GroupedQueryAttention", _case("forward", "qknorm_head_rope_mqa"))
    assert r.status == "pass" and 1e-9 < r.tolerance < 1e-5 and r.error > 1e-9, r


@pytest.mark.parametrize("name", ["qwen3.py:GroupedQueryAttention", "gemma3.py:GroupedQueryAttention",
                                  "olmo3.py:Attention", "hf_rotary.py:RotaryAttention", "meta.py:Attention"])
def test_classes_with_float32_parts_pass_and_say_so(repo_cwd, name, capsys):
    from attnbench.cli.app import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["check", C + name, "--kind", "forward,backward,decode,rope_start"], standalone_mode=True)
    out = capsys.readouterr().out
    assert exit_.value.code == 0, out[-3000:]
    assert "working precision: float32 in " in out and "float64 cases judged at float32" in out


# --- a class's own properties --------------------------------------------------------------------------

def test_own_norm_eps_is_measured_and_always_on_qk_norm_fills_the_spec(repo_cwd):
    olmo = registry.get(C + "olmo3.py:Attention")
    assert any("norm_eps: its own, 1e-06" in line for line in olmo.factory.evidence)
    spec = olmo.own_spec(AttnSpec(16, 16, 8, 0.0, 2, rope_theta=100.0, norm_eps=1e-5))
    assert spec.qk_norm == "full" and spec.norm_eps == 1e-6
    other_eps = AttnSpec(16, 16, 8, 0.0, 2, rope_theta=100.0, qk_norm="full", norm_eps=1e-2)
    r = run_case(C + "olmo3.py:Attention", Case("forward", Shape("eps_full", 2, 8, other_eps), "float64"))
    assert r.status == "pass", r  # another epsilon in the spec: checked at the class's own
    # a class that takes norm_eps gets the spec's: nothing measured, so ignoring it is a failure (below)
    assert "norm_eps" not in registry.get(B + "Reference").factory.own


def test_odd_head_dims_are_skipped_with_the_class_s_reason(repo_cwd):
    r = run_case(C + "llama32.py:GroupedQueryAttention", _case("forward", "book_hd1"))
    assert r.status == "skip" and "needs an even head dim" in r.message and "Head dimension must be even" in r.message


def test_coverage_line_counts_what_the_class_can_take(repo_cwd):
    from attnbench.cli.check import coverage_line

    df = run_matrix([C + "llama32.py:GroupedQueryAttention"], kinds=["forward"])
    line = coverage_line(df)
    ran = int((df.status != "skip").sum())
    assert line.startswith(f"ran {ran} of the {ran + 2} cases this class can take (2 skipped: odd head dim)"), line
    assert ran / (ran + 2) >= 0.8


def test_factorised_layer_stress_is_judged_on_what_it_holds(repo_cwd):
    df = run_matrix([C + "mla.py:MultiHeadLatentAttention"], kinds=["extreme_logits"])
    assert df.status.isin(["pass", "skip"]).all(), df.message.tolist()
    skipped = df[df.status == "skip"]
    assert skipped.message.str.contains("cannot hold|not run|QK-norm", regex=True).all(), skipped.message.tolist()


# --- planted bugs the leniencies must not excuse ------------------------------------------------------

@pytest.mark.parametrize("bug, kind, shape, words", [
    ("SoftmaxInHalf", "forward", "gpt_like", "aten._softmax in float16"),
    ("EpsIgnored", "forward", "qknorm_head_rope_mqa", "forward error"),
    ("KeysRotatedBackwards", "forward", "rope_half_theta500_gqa", "forward error"),
    ("WindowWiderInDecode", "decode", "decode_mqa_window", "decoded token"),
    ("PartialRotaryMismatch", "forward", "rope_half_theta500_gqa", "forward error"),
    ("CacheOneLate", "decode", "decode_rope_gqa_qknorm", "decoded token"),
])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_planted_bug_is_flagged_by_the_case_it_breaks(repo_cwd, bug, kind, shape, words, dtype):
    r = run_case(B + bug, _case(kind, shape, dtype))
    assert r.status == "fail" and words in r.message, r
    if bug == "WindowWiderInDecode":  # prefill keeps N keys: only decoding breaks it
        assert run_case(B + bug, _case("forward", "window", dtype)).status == "pass"


def test_the_reference_class_of_the_planted_bugs_passes(repo_cwd):
    df = run_matrix([B + "Reference"], kinds=["forward", "backward", "decode", "rope_start"])
    assert df.status.isin(["pass", "skip"]).all(), df[~df.status.isin(["pass", "skip"])].message.tolist()


# --- messages that are true, and verified likely causes ---------------------------------------------

def test_sqrt_d_model_scale_is_named_as_the_likely_cause(repo_cwd):
    r = run_case(NEW_USER, _case("forward", "gpt_like"))
    assert r.status == "fail"
    assert "likely cause: scores scaled by 1/sqrt(d_out), expected 1/sqrt(head_dim) (here 1/sqrt(64) vs 1/sqrt(16))" \
        in r.message, r.message
    ok = run_case(NEW_USER, _case("eval_deterministic", "props"))
    assert ok.status == "fail" and "not a dropout problem" in ok.message and "dropout applied" not in ok.message


def test_no_likely_cause_without_evidence(repo_cwd):
    """A bug the alterations do not reproduce gets no likely cause (never a guess)."""
    r = run_case(B + "EpsIgnored", _case("forward", "qknorm_head_rope_mqa"))
    assert r.status == "fail" and "likely cause" not in r.message
    assert not math.isinf(r.error)


def test_shape_sequence_blames_state_only_when_a_fresh_module_passes(repo_cwd):
    r = run_case(NEW_USER, _case("shape_sequence", "sequence"))
    assert r.status == "fail" and "state kept" not in r.message and "after calls" not in r.message, r.message


@pytest.mark.slow
def test_the_check_of_a_whole_real_style_set_within_the_shape_grid(repo_cwd):
    """Every case of the planted-bug reference class and the book-numerics styles, float64 and float32 (the slow
    set's false-alarm sweep runs the forward and decode kinds of the same classes)."""
    names = [B + "Reference", C + "qwen3.py:GroupedQueryAttention", C + "olmo3.py:Attention"]
    df = run_matrix(names)
    assert df.status.isin(["pass", "skip"]).all(), df[~df.status.isin(["pass", "skip"])].message.tolist()


def test_shape_helper_builds():
    assert Shape("x", 1, 2, AttnSpec(4, 4, 4, 0.0, 2)).spec.head_dim == 2


def test_decode_mode_times_a_class_with_its_own_qk_norm_and_eps(repo_cwd):
    """`attnbench run --mode decode` on an OLMo-style class (QK-norm always on, eps its own) measures it with them,
    where it used to skip every cell ("always applies QK-norm; the spec has none")."""
    from attnbench.results.schema import Cell
    from attnbench.runner.workload import build_workload

    impl = registry.get(B + "AlwaysNormed")
    own = impl.own_spec(AttnSpec(32, 32, 12, 0.0, 4))
    assert (own.qk_norm, own.norm_eps) == ("head", 5e-6)
    work = build_workload(Cell(impl=B + "AlwaysNormed", batch=2, seq_len=12, num_heads=4, d_model=32, mode="decode"))
    assert work.check_output(work.step()) is None
    assert run_case(B + "AlwaysNormed", _case("decode", "decode_rope_gqa_qknorm")).status == "pass"


def test_a_window_that_counts_the_current_token_apart_is_inferred_and_mapped(repo_cwd):
    """i - j <= w (HF-style "w tokens before this one") is the same family as attnbench's N keys: inferred on a probe
    (never against the reference), named, and built with N - 1; inconsistent between prefill and decode: a failure."""
    impl = registry.get(B + "WindowCountsCurrentApart")
    assert impl.factory.own.get("window_offset") == 1 and any("counts the current token apart" in e
                                                               for e in impl.factory.evidence)
    for kind, shape in (("forward", "window"), ("forward", "gqa_window_bias"), ("decode", "decode_mqa_window")):
        r = run_case(B + "WindowCountsCurrentApart", _case(kind, shape))
        assert r.status == "pass", r
    one = run_case(B + "WindowCountsCurrentApart", _case("forward", "window1"))
    assert one.status == "skip" and "window=0 for it" in one.message
    bad = run_case(B + "WindowApartOnlyInPrefill", _case("decode", "decode_mqa_window"))
    assert bad.status == "fail" and "decoded token" in bad.message
    assert "window_offset" not in registry.get(B + "Reference").factory.own
