"""The book's printed values (chapter 3; ``shared/reference/GOLDEN.md``) that every port must reproduce."""

from __future__ import annotations

import torch

INPUTS = [[0.43, 0.15, 0.89],  # Your
          [0.55, 0.87, 0.66],  # journey
          [0.57, 0.85, 0.64],  # starts
          [0.22, 0.58, 0.33],  # with
          [0.77, 0.25, 0.10],  # one
          [0.05, 0.80, 0.55]]  # step

CAUSAL_ATTENTION = [[-0.4519, 0.2216], [-0.5874, 0.0058], [-0.6300, -0.0632],
                    [-0.5675, -0.0843], [-0.5526, -0.0981], [-0.5299, -0.1081]]
WRAPPER = [[-0.4519, 0.2216, 0.4772, 0.1063], [-0.5874, 0.0058, 0.5891, 0.3257],
           [-0.6300, -0.0632, 0.6202, 0.3860], [-0.5675, -0.0843, 0.5478, 0.3589],
           [-0.5526, -0.0981, 0.5321, 0.3428], [-0.5299, -0.1081, 0.5077, 0.3493]]
MULTI_HEAD_ATTENTION = [[0.3190, 0.4858], [0.2943, 0.3897], [0.2856, 0.3593],
                        [0.2693, 0.3873], [0.2639, 0.3928], [0.2575, 0.4028]]

SEED = 123
ARGS = {"d_in": 3, "d_out": 2, "context_length": 6, "dropout": 0.0, "num_heads": 2}
"""The book's constructor arguments for the multi-head classes (CausalAttention takes no num_heads)."""

GOLDEN_IMPLEMENTATIONS = {"weight_split": MULTI_HEAD_ATTENTION}
"""Registered implementations that are the book's class and must print the book's values."""


def batch() -> torch.Tensor:
    """The book's ``(2, 6, 3)`` batch: the six embeddings stacked twice."""
    inputs = torch.tensor(INPUTS)
    return torch.stack((inputs, inputs), dim=0)


def matches(output: torch.Tensor, expected: list[list[float]], decimals: int = 4) -> tuple[bool, float]:
    """Whether both batch rows of ``output`` print as ``expected`` to ``decimals``; and the worst difference."""
    want = torch.tensor(expected, dtype=torch.float64)
    got = output.detach().to(torch.float64)
    worst = max(float((got[i] - want).abs().max()) for i in range(got.shape[0]))
    same = all(torch.equal(torch.round(got[i], decimals=decimals), torch.round(want, decimals=decimals))
               for i in range(got.shape[0]))
    return same, worst
