"""DeepSeek-style MLA and partial rotary (issue 46): the spec's fields, the float64 reference against a by-hand
computation, the built-ins ``mla_deepseek`` (naive) and ``mla_deepseek_absorbed`` passing forward, backward and decode
cases, and planted bugs each flagged by the case kind they break."""

from dataclasses import replace

import pytest
import torch

from attnbench import registry
from attnbench.correctness import mla_cases
from attnbench.correctness.cases import Case, reference
from attnbench.correctness.matrix import cases, run_case
from attnbench.correctness.rope import apply_rope_part, rope_tables
from attnbench.errors import InvalidSpecError
from attnbench.spec import AttnSpec, positional_from_text
from attnbench.weights import export_weights, load_weights, random_weights
from tests.plugins import buggy_mla_deepseek

MLA = dict(rope_theta=100.0, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
DECODE = [c for c in cases(["decode"]) if c.shape.spec.is_mla]
FORWARD = [c for c in mla_cases.cases() if c.kind == "forward" and c.dtype == "float64"]
NAMES = ["mla_deepseek", "mla_deepseek_absorbed"]


pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors: one thread, as run_matrix uses (conftest)


# --- the spec -------------------------------------------------------------------------------------

def test_mla_spec_fields_round_trip_and_scale():
    spec = AttnSpec(32, 32, 12, 0.0, 4, q_lora_rank=12, **MLA)
    assert spec.is_mla and spec.is_variant and spec.qk_head_dim == 10 and spec.rotary_dim == 4
    assert spec.score_scale == pytest.approx(10 ** -0.5)  # 1/sqrt(nope + rope), not 1/sqrt(d_out // num_heads)
    assert AttnSpec(**spec.kwargs()) == spec and spec.mla_kwargs()["q_lora_rank"] == 12
    assert replace(spec, scale=0.3).score_scale == 0.3
    assert not AttnSpec(8, 8, 4, 0.0, 2).is_mla and AttnSpec(8, 8, 4, 0.0, 2).mla_kwargs() == {}


def test_partial_rotary_field_round_trips_through_text():
    spec = AttnSpec(16, 16, 8, 0.0, 2, rope_theta=500.0, rope_head_dim=4)
    assert spec.rotary_dim == 4 and spec.positional_text() == "rope_theta=500;rope_head_dim=4"
    assert AttnSpec(16, 16, 8, 0.0, 2, **positional_from_text(spec.positional_text())) == spec


@pytest.mark.parametrize(("fields", "fix"), [
    (dict(q_lora_rank=4), "set kv_lora_rank too"),
    (dict(kv_lora_rank=8, rope_theta=1.0), "needs qk_nope_head_dim, qk_rope_head_dim, v_head_dim"),
    ({**MLA, "rope_theta": None}, "set rope_theta"),
    ({**MLA, "qk_rope_head_dim": 3}, "must be even"),
    ({**MLA, "num_kv_heads": 1}, "leave num_kv_heads None"),
    ({**MLA, "qkv_bias": True}, "qkv_bias=False"),
    ({**MLA, "qk_norm": "head"}, "leave qk_norm None"),
    ({**MLA, "rope_head_dim": 4}, "leave rope_head_dim None"),
    ({**MLA, "v_head_dim": 0}, "v_head_dim must be a positive int"),
    (dict(rope_head_dim=4), "needs rope_theta"),
    (dict(rope_theta=10.0, rope_head_dim=10), "from 2 to head_dim=8"),
])
def test_invalid_fields_name_the_fix(fields, fix):
    with pytest.raises(InvalidSpecError, match=fix):
        AttnSpec(16, 16, 8, 0.0, 2, **fields)


# --- the reference, against a computation by hand -------------------------------------------------

def _turn(v: torch.Tensor, position: int, theta: float, style: str) -> torch.Tensor:
    """``v`` (r,) rotated at ``position``: pair j turns by position * theta ** (-2j / r), as complex numbers."""
    r = v.numel()
    angle = position * theta ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    a, b = (v[0::2], v[1::2]) if style == "interleaved" else (v[:r // 2], v[r // 2:])
    z = torch.complex(a, b) * torch.polar(torch.ones_like(angle), angle)
    if style == "half":
        return torch.cat([z.real, z.imag])
    return torch.stack([z.real, z.imag], dim=-1).flatten()


def _norm(v: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    return v / torch.sqrt(v.square().mean() + eps) * gain


def _attend(q: list, k: list, v: list, scale: float) -> list:
    """Causal attention of one head over lists of per-token vectors."""
    out = []
    for i, qi in enumerate(q):
        p = torch.softmax(torch.stack([qi @ k[j] * scale for j in range(i + 1)]), dim=0)
        out.append(sum(p[j] * v[j] for j in range(i + 1)))
    return out


def _mla_by_hand(x: torch.Tensor, w, s: AttnSpec) -> torch.Tensor:
    """One token and one head at a time: ``[W_UK_h c_kv | k_pe]`` keys, ``W_UV_h c_kv`` values (batch 1)."""
    nope, qk, vd, r = s.qk_nope_head_dim, s.qk_head_dim, s.v_head_dim, s.kv_lora_rank
    heads = [[] for _ in range(s.num_heads)]
    tokens = []
    for t, xt in enumerate(x[0]):
        c_q = xt if w.W_dq is None else _norm(w.W_dq @ xt, w.g_dq, s.norm_eps)
        kv = w.W_dkv @ xt
        c = _norm(kv[:r], w.g_dkv, s.norm_eps)
        tokens.append((w.W_q @ c_q, c, _turn(kv[r:], t, s.rope_theta, s.rope_style)))
    for h in range(s.num_heads):
        q = [torch.cat([qt[h * qk:h * qk + nope], _turn(qt[h * qk + nope:(h + 1) * qk], t, s.rope_theta, s.rope_style)])
             for t, (qt, _, _) in enumerate(tokens)]
        k = [torch.cat([w.W_k[h * nope:(h + 1) * nope] @ c, pe]) for _, c, pe in tokens]
        v = [w.W_v[h * vd:(h + 1) * vd] @ c for _, c, _ in tokens]
        heads[h] = _attend(q, k, v, s.score_scale)
    rows = [torch.cat([heads[h][t] for h in range(s.num_heads)]) for t in range(x.shape[1])]
    return (torch.stack(rows) @ w.W_o.T + w.b_o)[None]


@pytest.mark.parametrize("shape", [s.id for s in mla_cases.MLA_SHAPES])
def test_mla_reference_equals_the_computation_by_hand(shape):
    spec = next(s.spec for s in mla_cases.MLA_SHAPES if s.id == shape)
    w = random_weights(spec, seed=4)
    x = torch.randn(1, 6, spec.d_in, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(reference(x, w, spec), _mla_by_hand(x, w, spec), rtol=0, atol=1e-12)
    shared = replace(w, W_dkv=torch.cat([w.W_dkv[:spec.kv_lora_rank], 2 * w.W_dkv[spec.kv_lora_rank:]]))
    assert (reference(x, shared, spec) - reference(x, w, spec)).abs().max() > 1e-3  # k_pe's rows matter


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_partial_rotary_turns_the_first_slice_and_passes_the_rest(style):
    spec = AttnSpec(8, 16, 8, 0.0, 2, rope_theta=100.0, rope_style=style, rope_head_dim=4)
    w = random_weights(spec, seed=1)
    x = torch.randn(1, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    qs = (x[0] @ w.W_q.T).unflatten(-1, (2, 8))  # (T, heads, head_dim)
    ks = (x[0] @ w.W_k.T).unflatten(-1, (2, 8))

    def turned(t_vectors: torch.Tensor, h: int) -> list:
        return [torch.cat([_turn(v[h, :4], t, 100.0, style), v[h, 4:]]) for t, v in enumerate(t_vectors)]

    vs = (x[0] @ w.W_v.T).unflatten(-1, (2, 8))
    heads = [_attend(turned(qs, h), turned(ks, h), [v[h] for v in vs], 8 ** -0.5) for h in range(2)]
    by_hand = torch.stack([torch.cat([heads[0][t], heads[1][t]]) for t in range(5)]) @ w.W_o.T + w.b_o
    torch.testing.assert_close(reference(x, w, spec)[0], by_hand, rtol=0, atol=1e-12)
    full = reference(x, w, replace(spec, rope_head_dim=None))
    assert (full - reference(x, w, spec)).abs().max() > 1e-3  # the unrotated part matters


def test_rope_part_last_rotates_the_tail_only():
    cos, sin = rope_tables([3], 4, 10.0, style="interleaved")
    x = torch.arange(1.0, 11.0, dtype=torch.float64)[None]  # (T=1, 10)
    out = apply_rope_part(x, cos, sin, "interleaved", part="last")
    assert torch.equal(out[0, :6], x[0, :6]) and not torch.allclose(out[0, 6:], x[0, 6:])
    torch.testing.assert_close(out[0, 6:], _turn(x[0, 6:], 3, 10.0, "interleaved"), rtol=0, atol=1e-14)


# --- the built-ins ------------------------------------------------------------------------------------

@pytest.mark.parametrize("q_lora_rank", [None, 12])
@pytest.mark.parametrize("name", NAMES)
def test_weights_round_trip(name, q_lora_rank):
    spec = AttnSpec(32, 32, 12, 0.0, 4, q_lora_rank=q_lora_rank, **MLA)
    w = random_weights(spec, seed=5)
    module = load_weights(registry.get(name).factory(spec).double(), w, spec)
    back = export_weights(module, spec)
    assert [n for n, _ in back.items()] == [n for n, _ in w.items()]
    for (n, got), (_, want) in zip(back.items(), w.items(), strict=True):
        assert torch.equal(got, torch.zeros_like(want) if n == "b_o" else want), n  # wo has no bias: held at zero
    assert ("wq_a.weight" in dict(module.named_parameters())) == (q_lora_rank is not None)


@pytest.mark.parametrize("name", NAMES)
def test_builtins_pass_forward_backward_and_decode(name):
    results = [run_case(name, c) for c in mla_cases.cases() + DECODE]
    bad = [(r.kind, r.shape, r.dtype, r.message) for r in results if r.status != "pass"]
    assert not bad, bad
    assert {r.kind for r in results} == {"forward", "backward", "decode"} and len(DECODE) == 4


def test_the_absorbed_cache_holds_the_latent_and_k_pe_only():
    spec = DECODE[0].shape.spec
    x = torch.randn(2, 5, spec.d_in, dtype=torch.float64)
    sizes = {}
    for name in NAMES:
        module = registry.get(name).build(spec, dtype="float64", weights=random_weights(spec)).eval()
        with torch.no_grad():
            module(x, use_cache=True)
        sizes[name] = sum(t.numel() for t in module.cache_tensors()) // (2 * spec.context_length)
    assert sizes == {"mla_deepseek": spec.num_heads * (spec.qk_head_dim + spec.v_head_dim),
                     "mla_deepseek_absorbed": spec.kv_lora_rank + spec.qk_rope_head_dim}


def test_other_shapes_skip_with_the_reason():
    plain = next(c for c in cases(["forward"]) if c.shape.id == "oddT_din_ne_dout" and c.dtype == "float64")
    r = run_case("mla_deepseek", plain)
    assert r.status == "skip" and "computes DeepSeek-style MLA only" in r.message
    r = run_case("rope_math", DECODE[0])  # declares RoPE and a cache, not MLA
    assert r.status == "skip" and r.message.startswith("does not support DeepSeek-style MLA")


# --- planted bugs, each flagged by the case kind it breaks ------------------------------------------

BUGS = [  # factory, the layer it derives from, the kinds that flag it (of forward, backward, decode)
    ("make_rope_not_rotated", "mla_deepseek", {"forward", "backward", "decode"}),
    ("make_rope_key_per_head", "mla_deepseek", {"forward", "backward", "decode"}),
    ("make_latent_norm_skipped", "mla_deepseek", {"forward", "backward", "decode"}),
    ("make_wuk_applied_twice", "mla_deepseek_absorbed", {"decode"}),
]


@pytest.mark.parametrize(("factory", "base", "flagged"), BUGS, ids=[b[0][5:] for b in BUGS])
def test_planted_bug_is_flagged_by_the_case_it_breaks(factory, base, flagged):
    impl = replace(registry.get(base), name=factory, factory=getattr(buggy_mla_deepseek, factory))
    shape = mla_cases.MLA_SHAPES[0]
    chosen = [Case("forward", shape, "float64"), Case("backward", shape, "float64"), DECODE[0]]
    results = {r.kind: r for r in (run_case(impl, c) for c in chosen)}
    assert {k for k, r in results.items() if r.status == "fail"} == flagged, {k: r.message for k, r in results.items()}
    assert all(r.status == "pass" for k, r in results.items() if k not in flagged)
    first = "forward" if "forward" in flagged else "decode"
    words = {"forward": "forward error", "decode": "decode, prefill then single tokens: prefill of 5 tokens"}[first]
    assert results[first].message.startswith(words), results[first].message


def test_decode_case_shapes_are_mla_and_distinct():
    assert {c.shape.id for c in DECODE} == {"decode_mla_qlora", "decode_mla_full_q"}
    specs = [c.shape.spec for c in DECODE]
    assert {s.q_lora_rank is None for s in specs} == {True, False} and {s.rope_style for s in specs} == {"half", "interleaved"}
