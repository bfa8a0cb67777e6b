"""The rope family passes the positional cases; planted RoPE / QK-norm / scale bugs are flagged by them, by the
property each breaks, and pass every case that existed before them (issue 26)."""

from dataclasses import replace

import pytest

from attnbench import registry
from attnbench.correctness.matrix import cases, run_case, shape_specs
from attnbench.correctness.positional import exercised
from tests.plugins import buggy_rope

OLD_CASES = [c for c in cases(["forward", "backward", "decode"]) if c.dtype == "float64"
             and c.shape.id in ("oddT_din_ne_dout", "gqa", "window", "decode_mqa_window")]
"""Cases of the kinds and shapes the matrix had before RoPE: none sets a positional field."""
NEW_CASES = [c for c in cases() if c.shape.spec.is_positional and not c.shape.spec.mask_kinds  # issue 37: masks apart
             and not c.shape.spec.is_mla]  # issue 46: DeepSeek MLA's shapes are tests/test_mla_deepseek.py's

BUGS = [  # factory, the case that flags it (kind, shape), what its message says
    ("make_offset_ignored", "decode", "decode_rope_gqa_qknorm", "prefill then single tokens: decoded token at position 5"),
    ("make_queries_not_rotated", "forward", "rope_llama3_gqa", "forward error"),
    ("make_sign_flipped", "forward", "rope_interleaved_theta100_bias", "forward error"),
    ("make_norm_after_rope", "forward", "qknorm_head_rope_mqa", "forward error"),
    ("make_k_norm_reuses_q_gain", "forward", "qknorm_head_rope_mqa", "forward error"),
    ("make_scale_ignored", "forward", "score_scale", "forward error"),
    ("make_cache_rotated_again", "decode", "decode_rope_gqa_qknorm", "decoded token at position 5"),
    ("make_softcap_not_rescaled", "forward", "softcap", "forward error"),
]


pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors: one thread, as run_matrix uses (conftest)


def planted(factory_name: str) -> registry.Implementation:
    return replace(registry.get("rope_math"), name=factory_name, factory=getattr(buggy_rope, factory_name))


def test_old_cases_set_no_positional_field():
    assert OLD_CASES and not any(c.shape.spec.is_positional for c in OLD_CASES)
    assert {c.kind for c in OLD_CASES} == {"forward", "backward", "decode"}


@pytest.mark.parametrize("name", ["rope_math", "rope_sdpa"])
def test_rope_family_passes_the_positional_cases(name):
    results = [run_case(name, c) for c in NEW_CASES]
    bad = [(r.kind, r.shape, r.dtype, r.message) for r in results if r.status not in ("pass", "skip")]
    assert not bad, bad
    skipped = {r.shape for r in results if r.status == "skip"}
    assert skipped == (set() if name == "rope_math" else {"softcap"})


@pytest.mark.parametrize(("factory", "kind", "shape", "words"), BUGS, ids=[b[0][5:] for b in BUGS])
def test_planted_bug_passes_the_old_cases_and_is_flagged_by_its_property(factory, kind, shape, words):
    impl = planted(factory)
    old = [run_case(impl, c) for c in OLD_CASES]
    assert all(r.status == "pass" for r in old), [(r.kind, r.shape, r.message) for r in old if r.status != "pass"]
    flagged = [run_case(impl, c) for c in NEW_CASES if (c.kind, c.shape.id, c.dtype) == (kind, shape, "float64")]
    assert [r.status for r in flagged] == ["fail"], flagged
    assert words in flagged[0].message


@pytest.mark.parametrize("factory", ["make_offset_ignored", "make_cache_rotated_again"])
def test_decode_bugs_hide_from_every_full_forward(factory):
    """Prefills at any start are right (RoPE is relative): only decoding after a prefill shows these."""
    results = [run_case(planted(factory), c) for c in NEW_CASES if c.kind in ("forward", "rope_start")]
    assert all(r.status == "pass" for r in results), [(r.kind, r.shape, r.message) for r in results if r.status != "pass"]


def test_norm_order_bug_hides_without_qk_norm():
    impl = planted("make_norm_after_rope")
    rope_only = [c for c in NEW_CASES if c.kind == "forward" and c.shape.id == "rope_llama3_gqa"]
    assert [run_case(impl, c).status for c in rope_only] == ["pass", "pass"]


def test_verbose_words_name_what_the_cases_exercised():
    import pandas as pd

    rows = [run_case("rope_sdpa", c) for c in NEW_CASES]
    df = pd.DataFrame([r.__dict__ for r in rows])
    text = exercised(df, shape_specs())["rope_sdpa"]
    assert text.startswith("RoPE (half, interleaved; theta 100, 500, 1000, 500000; llama3 scaling; start positions; "
                           "decode offsets)")
    assert "QK-norm (full, head)" in text and "score scale" in text and "softcap" not in text


@pytest.mark.slow
def test_no_false_alarm_in_the_positional_cases_over_20_seeds():
    """The 20-seed false-alarm sweep (attnbench.tools.false_alarms) over the rope family's positional cases."""
    import pandas as pd

    from attnbench.tools.false_alarms import false_alarms

    def run(impls, device="cpu", kinds=None, seed=0):
        return pd.DataFrame([run_case(i, c, device, seed).__dict__ for i in impls for c in NEW_CASES])

    bad = false_alarms(["rope_math", "rope_sdpa"], range(20), run=run)
    assert bad.empty, "\n".join(f"seed {r.seed}: {r.impl} {r.kind} {r.shape} {r.dtype}: {r.message}" for r in bad.itertuples())


def test_check_verbose_says_what_was_exercised(capsys):
    from tests.test_cli_basic import run_cli

    code, out, _ = run_cli(["check", "rope_math", "--kind", "rope_start", "-v"], capsys)
    assert code == 0, out
    assert "rope_math exercised: RoPE (half; theta 100; start positions), QK-norm (head)" in out
