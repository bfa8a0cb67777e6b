"""RoPE, QK-norm, score scale and soft-capping in the spec, the canonical weights and the float64 reference (issue 26)."""

import math

import pytest
import torch

from attnbench.correctness import rope
from attnbench.correctness.cases import reference
from attnbench.errors import InvalidSpecError
from attnbench.spec import AttnSpec, RopeScaling
from attnbench.weights import random_weights

ROPE = AttnSpec(16, 16, 12, 0.0, 2, rope_theta=10_000.0)


def test_interleaved_tables_turn_each_adjacent_pair_by_position_times_frequency():
    x = torch.randn(5, 8, dtype=torch.float64)
    cos, sin = rope.rope_tables(range(3, 8), 8, 500.0, style="interleaved")
    out = rope.apply_rope(x, cos, sin, "interleaved")
    freq = 500.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    z = torch.view_as_complex(x.reshape(5, 4, 2).contiguous())
    turned = z * torch.polar(torch.ones(5, 4, dtype=torch.float64), torch.arange(3, 8)[:, None] * freq)
    torch.testing.assert_close(out, torch.view_as_real(turned).reshape(5, 8))


def test_half_style_is_interleaved_with_the_dimensions_permuted():
    x = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    perm = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # half pairs (j, j + 4) -> interleaved pairs (2j, 2j + 1)
    half = rope.apply_rope(x, *rope.rope_tables(range(6), 8, 100.0), "half")
    inter = rope.apply_rope(x[..., perm], *rope.rope_tables(range(6), 8, 100.0, style="interleaved"), "interleaved")
    torch.testing.assert_close(half[..., perm], inter)


def test_llama3_scaling_divides_long_wavelengths_keeps_short_and_blends_between():
    s = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context_length=8192)
    plain, scaled = rope.inv_freq(8, 500_000.0), rope.inv_freq(8, 500_000.0, s)
    wavelen = 2 * math.pi / plain  # about 6, 167, 4443, 118000
    assert scaled[0] == plain[0] and scaled[1] == plain[1]  # shorter than 8192 / 4
    assert torch.isclose(scaled[3], plain[3] / 8)  # longer than 8192
    assert 2048 < wavelen[2] < 8192 and plain[2] / 8 < scaled[2] < plain[2]


def test_rms_norm_divides_by_the_root_mean_square_and_applies_the_gain():
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    out = rope.rms_norm(x, torch.tensor([1.0, 2.0], dtype=torch.float64), eps=0.0)
    torch.testing.assert_close(out, torch.tensor([[3.0, 8.0]], dtype=torch.float64) / math.sqrt(12.5))


def test_reference_with_rope_is_relative_a_uniform_shift_changes_nothing_but_theta_does():
    w, x = random_weights(ROPE, 1), torch.randn(2, 9, 16, dtype=torch.float64)
    at0 = reference(x, w, ROPE)
    torch.testing.assert_close(reference(x, w, ROPE, start_pos=7), at0)
    assert (reference(x, w, AttnSpec(**{**ROPE.kwargs(), "rope_theta": 50.0})) - at0).abs().max() > 1e-3
    assert (reference(x, w, AttnSpec(16, 16, 12, 0.0, 2)) - at0).abs().max() > 1e-3


def test_reference_without_positional_fields_is_unchanged():
    spec = AttnSpec(16, 16, 12, 0.0, 2, True, num_kv_heads=1, window=3)
    w, x = random_weights(spec, 2), torch.randn(2, 7, 16, dtype=torch.float64)
    manual = reference(x, w, AttnSpec(**{**spec.kwargs(), "scale": spec.head_dim ** -0.5}))
    torch.testing.assert_close(reference(x, w, spec), manual)


def test_softcap_bounds_the_scores_and_a_huge_cap_changes_nothing():
    spec = AttnSpec(8, 8, 6, 0.0, 1, scale=3.0)
    w, x = random_weights(spec, 3), torch.randn(1, 6, 8, dtype=torch.float64)
    torch.testing.assert_close(reference(x, w, AttnSpec(**{**spec.kwargs(), "softcap": 1e9})), reference(x, w, spec))
    assert (reference(x, w, AttnSpec(**{**spec.kwargs(), "softcap": 0.5})) - reference(x, w, spec)).abs().max() > 1e-3


@pytest.mark.parametrize("norm", ["head", "full"])
def test_qk_norm_gains_differ_from_one_and_between_q_and_k(norm):
    spec = AttnSpec(16, 16, 8, 0.0, 4, num_kv_heads=2, qk_norm=norm)
    w = random_weights(spec, 4)
    w.check(spec)
    assert w.g_q.shape == ((4,) if norm == "head" else (16,)) and w.g_k.shape == ((4,) if norm == "head" else (8,))
    assert (w.g_q - 1).abs().min() > 0 and not torch.equal(w.g_q[:4], w.g_k[:4])
    plain = random_weights(AttnSpec(16, 16, 8, 0.0, 4, num_kv_heads=2), 4)
    assert plain.g_q is None and torch.equal(plain.W_q, w.W_q)  # the gains are drawn after the matrices
    with pytest.raises(ValueError, match="QK-norm gains"):
        plain.check(spec)


def test_spec_round_trips_the_positional_fields_and_rejects_bad_ones():
    spec = AttnSpec(16, 16, 8, 0.0, 2, rope_theta=5e5, rope_style="interleaved", rope_scaling=RopeScaling(),
                    qk_norm="full", norm_eps=1e-5, scale=0.3, softcap=30.0)
    assert AttnSpec(**spec.kwargs()) == spec and spec.score_scale == 0.3
    assert AttnSpec(16, 16, 8).positional_kwargs() == {} and AttnSpec(16, 16, 8, 0.0, 4).score_scale == 0.5
    for bad, match in [({"rope_style": "spiral"}, "rope_style"), ({"qk_norm": "layer"}, "qk_norm"),
                       ({"rope_theta": -1.0}, "rope_theta"), ({"rope_scaling": RopeScaling()}, "needs rope_theta"),
                       ({"num_heads": 16, "rope_theta": 1e4}, "even"), ({"softcap": 0}, "softcap")]:
        with pytest.raises(InvalidSpecError, match=match):
            AttnSpec(16, 16, 8, **bad)


def test_capabilities_normalise_and_the_skip_rule_names_what_is_missing():
    from attnbench.registry import Implementation
    from attnbench.resolve import variant_skip_reason

    impl = Implementation("x", lambda s: None, "", "", rope="interleaved", qk_norm=True)
    assert impl.rope == ("interleaved",) and impl.qk_norm == ("head", "full") and not impl.softcap
    assert variant_skip_reason(impl, AttnSpec(16, 16, 8, 0.0, 2, rope_theta=1e4, rope_style="interleaved",
                                              qk_norm="full")) is None
    why = variant_skip_reason(impl, AttnSpec(16, 16, 8, 0.0, 2, rope_theta=1e4, softcap=5.0))
    assert why == ("does not support rotary position embeddings in the 'half' style (rope_theta=10000) or "
                   "soft-capping of the scores (softcap=5)")
