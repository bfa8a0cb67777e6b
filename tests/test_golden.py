"""The book's printed chapter-3 values, reproduced by the book's classes (GOLDEN.md)."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch

from attnbench import registry
from attnbench.correctness import golden
from attnbench.correctness.matrix import Case, cases, run_case

pytestmark = pytest.mark.usefixtures("single_thread")

# importlib rather than `from attnbench.implementations.book import ...`: ruff's isort sees the package
# (mapped from ./implementations) as third-party today, first-party once configured; this reads the same either way
book = importlib.import_module("attnbench.implementations.book")
CausalAttention, MultiHeadAttention = book.CausalAttention, book.MultiHeadAttention
ChapterMultiHeadAttentionWrapper = book.ChapterMultiHeadAttentionWrapper

BUILDS = {
    "CausalAttention": (lambda: CausalAttention(3, 2, 6, 0.0), golden.CAUSAL_ATTENTION, (2, 6, 2)),
    "ChapterMultiHeadAttentionWrapper": (lambda: ChapterMultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2),
                                         golden.WRAPPER, (2, 6, 4)),
    "MultiHeadAttention": (lambda: MultiHeadAttention(3, 2, 6, 0.0, num_heads=2), golden.MULTI_HEAD_ATTENTION,
                           (2, 6, 2)),
}


def test_book_inputs():
    batch = golden.batch()
    assert batch.shape == (2, 6, 3) and batch.dtype == torch.float32
    assert torch.equal(batch[0], batch[1])
    assert batch[0, 1].tolist() == pytest.approx([0.55, 0.87, 0.66])  # "journey"


@pytest.mark.parametrize("name", list(BUILDS))
def test_book_class_prints_the_book_values(name):
    build, expected, shape = BUILDS[name]
    torch.manual_seed(123)
    module = build()
    with torch.no_grad():
        out = module(golden.batch())
    assert tuple(out.shape) == shape
    want = torch.tensor(expected)
    for row in range(2):  # both batch rows print the book's values to 4 decimals
        assert torch.equal(torch.round(out[row], decimals=4), want), f"{name} row {row}:\n{out[row]}"
        assert float((out[row] - want).abs().max()) <= 5e-5 + 1e-7
    same, worst = golden.matches(out, expected)
    assert same and worst <= 5e-5 + 1e-7


def test_seed_matters():
    torch.manual_seed(124)
    module = MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)
    with torch.no_grad():
        out = module(golden.batch())
    assert not golden.matches(out, golden.MULTI_HEAD_ATTENTION)[0]


def test_matches_rejects_a_wrong_row():
    good = torch.tensor(golden.MULTI_HEAD_ATTENTION)
    same, worst = golden.matches(torch.stack([good, good]), golden.MULTI_HEAD_ATTENTION)
    assert same and worst < 1e-7
    bad = good.clone()
    bad[3, 1] += 1e-3
    same, worst = golden.matches(torch.stack([good, bad]), golden.MULTI_HEAD_ATTENTION)
    assert not same and worst == pytest.approx(1e-3, rel=1e-3)


def test_golden_case_of_the_matrix():
    (case,) = cases(["golden"])
    assert run_case("weight_split", case).status == "pass"
    assert "weight_split" in golden.GOLDEN_IMPLEMENTATIONS
    skipped = run_case("sdpa", case)
    assert skipped.status == "skip" and "book" in skipped.message


def test_golden_case_fails_when_the_weights_are_not_the_books():
    """A right function with weights drawn differently from the book's order does not print the book's values."""

    class Redrawn(MultiHeadAttention):
        def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
            super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
            torch.nn.init.normal_(self.W_query.weight)

    impl = replace(registry.get("weight_split"), factory=lambda spec: Redrawn(**spec.kwargs()))
    result = run_case(impl, Case("golden", cases(["golden"])[0].shape, "float32"))
    assert result.status == "fail" and "4 decimals" in result.message
