"""Issue 48: the mixed serving step (attnbench.runner.mixed) and its check case (attnbench.correctness.mixed)."""

from __future__ import annotations

import pytest

from attnbench.correctness.matrix import cases, run_matrix
from attnbench.errors import SweepError, UnavailableError
from attnbench.runner import mixed
from attnbench.runner.mixed import Request

BUGGY = "tests/plugins/buggy_paged.py:BlockTableOnePageLate"


def test_batch_spec_grammar():
    assert mixed.parse_batch_spec("2q1k_32q1kv2k") == (Request(1024, 1024),) * 2 + (Request(1, 2048),) * 32
    assert mixed.parse_batch_spec("2q1k+32q1s2k") == mixed.parse_batch_spec("2q1k_32q1kv2k")  # s: vLLM's old spelling
    assert mixed.parse_batch_spec("q4kv1k") == (Request(4, 1024),)
    assert [r.kind for r in mixed.parse_batch_spec("q5_q1kv9_q3kv7")] == ["prefill", "decode", "chunk"]
    assert mixed.describe(mixed.parse_batch_spec("2q5_3q1kv9")) == "2 prefill of 5; 3 decode over 9"
    for bad, says in (("", "empty"), ("2x5", "is not"), ("q8kv4", "KV >= Q"), ("0q4", "COUNT >= 1")):
        with pytest.raises(SweepError, match=says):
            mixed.parse_batch_spec(bad)


def test_flops_and_bytes_count_real_tokens():
    one = mixed.parse_batch_spec("q1kv4")  # 1 token over 4 keys, d_model 8
    assert mixed.mixed_flops(one, 8) == 2 * 1 * 8 * 8 * 4 + 4 * 8 * 4
    prefill = mixed.parse_batch_spec("q3")  # causal pairs 1 + 2 + 3
    assert mixed.mixed_flops(prefill, 8) == 2 * 3 * 8 * 8 * 4 + 4 * 8 * 6
    assert mixed.mixed_flops(prefill, 8, num_kv_heads_ratio=0.5) == 2 * 3 * 8 * 8 * 3 + 4 * 8 * 6
    assert mixed.mixed_kv_bytes(mixed.parse_batch_spec("2q1kv4"), kv_width=8, element_bytes=4) == 2 * 4 * 2 * 8 * 4


def test_check_runs_the_mixed_step_on_paged_caches(repo_cwd):
    assert {c.shape.id for c in cases(["mixed_step"])} == {"mixed_gqa", "mixed_mha_window"}
    df = run_matrix(["paged_sdpa", "kv_concat", BUGGY], kinds=["mixed_step"])
    status = df.groupby("impl").status.agg(set).to_dict()
    assert status == {"paged_sdpa": {"pass"}, "kv_concat": {"skip"}, BUGGY: {"fail"}}
    fail = df[df.impl == BUGGY].message.iloc[0]
    assert "request 0 (prefill of 5, positions 0-4)" in fail and "pages of 4" in fail


def test_time_step_counts_the_step():
    got = mixed.time_step("paged_sdpa", "2q8_4q1kv16", d_model=16, num_heads=2, page_size=4, repeats=2)
    assert (got["requests"], got["tokens"]) == (6, 20) and got["median_s"] > 0
    assert got["flops"] == mixed.mixed_flops(mixed.parse_batch_spec("2q8_4q1kv16"), 16)
    with pytest.raises(UnavailableError, match="runs no mixed step"):
        mixed.time_step("sdpa", "q4", d_model=16, num_heads=2, repeats=1)
