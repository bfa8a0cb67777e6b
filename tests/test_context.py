"""Forwards that take their context as arguments (attnbench.plugins.context): bound by name, the mask's form
decided by a probe, a cache passed in and returned; an unsuppliable argument is one error line."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from attnbench import registry
from attnbench.correctness.cases import Case, Shape
from attnbench.correctness.decode import run_decode
from attnbench.correctness.matrix import run_case, run_matrix
from attnbench.plugins.binding import bind
from attnbench.plugins.context import MaskForm, plan_for, step_mask
from attnbench.plugins.inference import plan_with_probe
from attnbench.plugins.loading import import_file
from attnbench.spec import AttnSpec
from attnbench.weights import export_weights, load_weights, random_weights
from tests.refusal_text import refusal_text  # a refusal: an error: headline, a few short indented lines
from tests.seeds import FALSE_ALARM_SEEDS
from tests.test_plugins import run_cli

pytestmark = pytest.mark.usefixtures("single_thread")

C = "tests/plugins/context/"
KINDS = ["forward", "decode", "causality"]


def _plan(repo_cwd, path, cls):
    target = getattr(import_file(C + path), cls)
    return plan_with_probe(target, bind(target))


def test_step_mask_is_causal_and_windowed_for_a_step():
    spec = AttnSpec(8, 8, 16, 0.0, 2, window=2)
    hidden = step_mask(spec, 3, 2)  # queries 3, 4 over keys 0 .. 4
    assert hidden.shape == (2, 5)
    assert hidden.tolist() == [[True, True, False, False, True], [True, True, True, False, False]]


@pytest.mark.parametrize(("form", "expect"), [
    ("hidden", MaskForm("hidden")), ("keep", MaskForm("keep")), ("additive", MaskForm("additive")),
    ("additive4", MaskForm("additive", 4))])
def test_mask_form_is_decided_by_a_probe(repo_cwd, tmp_path, form, expect):
    """The same class reading its mask each way: the probe finds each form from causality alone."""
    use = {"hidden": "scores.masked_fill(mask, -torch.inf)", "keep": "scores.masked_fill(~mask, -torch.inf)",
           "additive": "scores + mask", "additive4": "scores + mask[:, :, :, :scores.shape[-1]]"}[form]
    path = tmp_path / "masks.py"
    path.write_text(f'''
import torch
from torch import nn
class A(nn.Module):
    def __init__(self, d_in, d_out, num_heads):
        super().__init__()
        self.h = num_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_in, d_out, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(d_out, d_out)
    def forward(self, x, mask):
        b, T, _ = x.shape
        q, k, v = (p(x).view(b, T, self.h, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = q @ k.transpose(2, 3) / q.shape[-1] ** 0.5
        scores = {use}
        return self.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, T, -1))
''')
    target = import_file(str(path)).A
    plan = plan_with_probe(target, bind(target))
    assert plan.mask == "mask" and plan.mask_form == expect
    df = run_matrix([f"{path}:A"], kinds=["forward", "causality"])
    assert (df.status == "pass").any() and not df.status.isin(["fail", "error"]).any(), df.to_string()


def test_qwen3_style_plan_indexes_full_tables_and_returns_its_cache(repo_cwd):
    plan = _plan(repo_cwd, "qwen3.py", "GroupedQueryAttention")
    assert (plan.mask, plan.tables, plan.position, plan.cache) == ("mask", ("cos", "sin"), "start_pos", "cache")
    assert plan.full_tables and plan.mask_form == MaskForm("hidden")
    impl = registry.get(C + "qwen3.py:GroupedQueryAttention")
    assert impl.kv_cache and impl.gqa and impl.sliding_window
    assert any(line.startswith("bound cache:") for line in impl.factory.evidence)


def test_llama32_style_gets_the_rows_of_its_positions(repo_cwd):
    plan = _plan(repo_cwd, "llama32.py", "GroupedQueryAttention")
    assert plan.tables == ("cos", "sin") and not plan.full_tables and plan.position is None and plan.cache is None


def test_plain_forward_is_not_bound(repo_cwd):
    assert plan_for(import_file("tests/plugins/styles/kv_gqa.py").GroupedQueryAttention) is None


@pytest.mark.parametrize("name", ["llama32.py:GroupedQueryAttention", "qwen3.py:GroupedQueryAttention"])
def test_context_styles_pass_unchanged(repo_cwd, name):
    df = run_matrix([C + name], kinds=KINDS)
    bad = df[df.status.isin(["fail", "error"])]
    assert bad.empty, "\n".join(f"{r.kind} {r.shape}: {r.message}" for r in bad.itertuples())
    assert "pass" in set(df[df.kind == "forward"].status)
    if name.startswith("qwen3"):
        assert "pass" in set(df[df.kind == "decode"].status)


def test_unsuppliable_argument_is_one_error_line(repo_cwd, capsys):
    assert plan_for(import_file(C + "llama32.py").NeedsTemperature).probed == ("temperature",)  # forms: by a probe
    code, out, err = run_cli(["check", "--impl", C + "llama32.py:NeedsTemperature"], capsys)
    text = refusal_text(err)
    assert code == 2 and err.startswith("error:") and "'temperature'" in err.splitlines()[0], err
    assert "cos, sin" in text and "Traceback" not in err


def test_bound_module_decodes_through_the_cache_it_returns(repo_cwd):
    impl = registry.get(C + "qwen3.py:GroupedQueryAttention")
    spec = AttnSpec(16, 16, 12, 0.0, 4, num_kv_heads=2)
    module = impl.build(spec, "cpu", "float64")
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    with torch.no_grad():
        full = module(x)
        module.reset_cache()
        steps = [module(x[:, :4], use_cache=True), module(x[:, 4:5], use_cache=True), module(x[:, 5:], use_cache=True)]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-12)
    assert module._attnbench_pos == 7 and module._attnbench_cache[0].shape == (2, 2, 7, 4)


# --- RoPE, QK-norm and scale in the chapter-5 styles, and the bugs that ship in them -----------------------------

ROPE = AttnSpec(16, 16, 16, 0.0, 4, num_kv_heads=2, rope_theta=500.0)
ROPE_HEAD = replace(ROPE, qk_norm="head")
GEMMA = replace(ROPE_HEAD, scale=0.3, window=4)
OLMO = replace(ROPE, qk_norm="full")
PLAIN = AttnSpec(16, 16, 16, 0.0, 4, num_kv_heads=2)


def verdict(name: str, spec: AttnSpec, kind: str = "forward", dtype: str = "float64"):
    impl = registry.get(C + name)
    case = Case(kind, Shape("rope_test", 2, 12, spec), dtype)
    return run_decode(impl, case, torch.device("cpu")) if kind == "decode" else run_case(impl, case)


@pytest.mark.parametrize(("name", "spec", "kinds"), [
    ("qwen3.py:GroupedQueryAttention", ROPE_HEAD, ("forward", "backward", "decode")),
    ("llama32.py:GroupedQueryAttention", ROPE, ("forward",)),
    ("gemma3.py:GroupedQueryAttention", GEMMA, ("forward", "backward")),
    ("olmo3.py:Attention", OLMO, ("forward",)),
    ("hf_rotary.py:RotaryAttention", ROPE, ("forward",)),
])
def test_styles_match_the_reference_with_rope_and_qk_norm(repo_cwd, name, spec, kinds):
    for kind in kinds:
        r = verdict(name, spec, kind)
        assert r.status == "pass", (kind, r.message)


@pytest.mark.parametrize(("name", "spec", "kind", "passes_at"), [
    ("qwen3.py:StartPosIgnored", ROPE, "decode", PLAIN),  # RoPE offset ignored when decoding
    ("qwen3.py:CachedKeyRotatedAgain", ROPE, "decode", PLAIN),
    ("llama32.py:QueriesNotRotated", ROPE, "forward", PLAIN),
    ("gemma3.py:KNormReusesQNormGain", ROPE_HEAD, "forward", ROPE),
    ("gemma3.py:ScaleIgnored", replace(ROPE, scale=0.3), "forward", ROPE),
    ("gemma3.py:NormAfterRope", ROPE_HEAD, "forward", ROPE),
    ("hf_rotary.py:ThetaIgnored", ROPE, "forward", replace(ROPE, rope_theta=10000.0)),
])
def test_planted_bugs_are_flagged_and_hide_without_the_new_cases(repo_cwd, name, spec, kind, passes_at):
    bad = verdict(name, spec, kind)
    assert bad.status == "fail", bad.message
    assert kind != "decode" or "decoded token at position" in bad.message, bad.message
    assert verdict(name, passes_at, kind).status == "pass"


def test_always_on_rope_and_qk_norm_become_the_spec(repo_cwd):
    """A class that always applies QK-norm or its own RoPE is checked with them (issue 35), never skipped."""
    olmo, rotary = registry.get(C + "olmo3.py:Attention"), registry.get(C + "hf_rotary.py:RotaryAttention")
    assert olmo.own_spec(ROPE).qk_norm == "full" and rotary.own_spec(PLAIN).rope_theta == 10000.0
    assert verdict("olmo3.py:Attention", ROPE).status == "pass"
    assert verdict("hf_rotary.py:RotaryAttention", PLAIN).status == "pass"
    assert rotary.rope == ("half",) and any("rope_theta" in line for line in rotary.factory.evidence)


def test_gemma_gain_is_measured_as_one_plus_scale(repo_cwd):
    impl = registry.get(C + "gemma3.py:GroupedQueryAttention")
    module = impl.build(ROPE_HEAD, "cpu", "float64")
    gains = module.weight_adapter.layout.gains
    assert {(g.canonical, g.offset, g.slope, g.placement) for g in gains} == {("g_q", 1.0, 1.0, "head"), ("g_k", 1.0, 1.0, "head")}
    w = random_weights(ROPE_HEAD)
    load_weights(module, w, ROPE_HEAD)
    assert torch.allclose(module.q_norm.scale, w.g_q.double() - 1)
    assert torch.allclose(export_weights(module, ROPE_HEAD).g_k, w.g_k.double())


CONTEXT_CORRECT = [C + n for n in ("llama32.py:GroupedQueryAttention", "qwen3.py:GroupedQueryAttention",
                                   "gemma3.py:GroupedQueryAttention", "olmo3.py:Attention", "hf_rotary.py:RotaryAttention",
                                   "mla.py:MultiHeadLatentAttention", "buggy_precision.py:Reference",
                                   "buggy_precision.py:AlwaysNormed", "buggy_precision.py:WindowCountsCurrentApart")]
"""The correct classes in the chapter-5 / HF styles (the slow set's false-alarm sweep runs them)."""


@pytest.mark.slow
def test_no_false_alarm_over_the_seeds_in_the_context_styles(repo_cwd):
    """The forward and decode cases (and every RoPE kind the matrix has) of the correct context styles, over
    FALSE_ALARM_SEEDS seeds (2 in CI; ATTNBENCH_FALSE_ALARM_SEEDS=20: 20 seeds, 127 s)
    (tests/test_properties.py runs every kind of the older styles; these would double that test's time)."""
    from attnbench.correctness.matrix import RUNNERS
    from attnbench.tools.false_alarms import false_alarms

    kinds = ["forward", "decode"] + [k for k in RUNNERS if k.startswith(("rope", "qk"))]
    bad = false_alarms(CONTEXT_CORRECT, range(FALSE_ALARM_SEEDS), kinds=kinds)
    assert bad.empty, "\n".join(f"seed {r.seed}: {r.impl} {r.kind} {r.shape}: {r.message}" for r in bad.itertuples())


# --- MLA: the reference takes its weights from the module; the latent cache -------------------------------------

MLA = AttnSpec(16, 32, 16, 0.0, 4, qkv_bias=True)


def test_mla_is_checked_with_weights_composed_from_the_module(repo_cwd):
    impl = registry.get(C + "mla.py:MultiHeadLatentAttention")
    assert impl.kv_cache and impl.backward == () and any(line.startswith("mla: yes") for line in impl.factory.evidence)
    for kind in ("forward", "decode", "causality"):
        r = verdict("mla.py:MultiHeadLatentAttention", MLA, kind)
        assert r.status == "pass", (kind, r.message)
    module = impl.build(MLA, "cpu", "float64", weights=random_weights(MLA))
    w = export_weights(module, MLA)
    assert torch.allclose(w.W_k, module.W_UK.weight @ module.W_DKV.weight)
    assert torch.allclose(w.b_v, module.W_UV.weight @ module.W_DKV.bias + module.W_UV.bias)
    assert torch.linalg.matrix_rank(w.W_k) == module.latent_dim == 8  # d_out // 4: low rank


def test_mla_latent_cache_misused_is_flagged_by_decode(repo_cwd):
    r = verdict("mla.py:LatentOfEarlierStepsDropped", MLA, "decode")
    assert r.status == "fail" and "decoded token at position" in r.message
    assert verdict("mla.py:LatentOfEarlierStepsDropped", MLA, "forward").status == "pass"


def test_decode_mode_times_a_returned_cache_and_measures_the_latent(repo_cwd):
    from attnbench.results.schema import Cell
    from attnbench.runner.workload import build_workload

    sizes = dict(batch=2, seq_len=12, num_heads=4, d_model=32, mode="decode")
    qwen = build_workload(Cell(impl=C + "qwen3.py:GroupedQueryAttention", num_kv_heads=2, **sizes))
    assert qwen.check_output(qwen.step()) is None
    assert qwen.kv_cache_bytes == 2 * 2 * 12 * 2 * 8 * 4  # keys and values: b, T, kv heads, head_dim, float32
    mla = build_workload(Cell(impl=C + "mla.py:MultiHeadLatentAttention", **sizes))
    assert mla.check_output(mla.step()) is None
    assert mla.kv_cache_bytes == 2 * 12 * 8 * 4  # one latent of d_out // 4 per token: 1/8 of MHA's keys and values


def test_meta_style_freqs_cis_is_interleaved_rope(repo_cwd):
    impl = registry.get(C + "meta.py:Attention")
    assert impl.rope == ("interleaved",)
    spec = AttnSpec(16, 16, 16, 0.0, 2, rope_theta=100.0, rope_style="interleaved")
    assert verdict("meta.py:Attention", spec, "forward", "float32").status == "pass"  # it rotates in float32
    assert "'half' style" in verdict("meta.py:Attention", replace(spec, rope_style="half")).message  # skipped: not its style
