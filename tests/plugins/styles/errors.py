"""Modules attnbench cannot set up: each must give one clear error line and exit 2."""

from __future__ import annotations

from torch import nn


class ConstructorRaises(nn.Module):
    """The constructor refuses every size (as a failed assertion would)."""

    def __init__(self, d_in, d_out, num_heads, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        raise RuntimeError("ConstructorRaises: unsupported configuration")


class NoRecognisableProjections(nn.Module):
    """Projections under names that say nothing about their role."""

    def __init__(self, d_in, d_out, num_heads, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.alpha = nn.Linear(d_in, d_out)
        self.beta = nn.Linear(d_in, d_out)
        self.gamma = nn.Linear(d_in, d_out)
        self.delta = nn.Linear(d_out, d_out)

    def forward(self, x):
        return self.delta(self.gamma(x))


class TwoCandidateLayouts(nn.Module):
    """Both a fused ``qkv`` and separate ``q_proj``/``k_proj``/``v_proj``: which one holds the weights?"""

    def __init__(self, d_in, d_out, num_heads, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.qkv = nn.Linear(d_in, 3 * d_out)
        self.q_proj = nn.Linear(d_in, d_out)
        self.k_proj = nn.Linear(d_in, d_out)
        self.v_proj = nn.Linear(d_in, d_out)
        self.out_proj = nn.Linear(d_out, d_out)

    def forward(self, x):
        return self.out_proj(self.v_proj(x))
