"""Plug-ins that cannot be benchmarked, for testing the error messages users get."""

from __future__ import annotations

import torch
from torch import nn

NOT_A_CLASS = 3  # `bad.py:NOT_A_CLASS` names something that is neither a class nor a factory


class RaisesInInit(nn.Module):
    """Its constructor raises, the way a user's shape assertion would."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        raise ValueError("RaisesInInit refuses to be built")


class NoBookNames(nn.Module):
    """Correct-looking layer whose projections are not called W_query/W_key/W_value/out_proj, and no adapter."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.q = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.k = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.v = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.o = nn.Linear(d_out, d_out)

    def forward(self, x):
        return self.o(self.v(x))


class ExtraParameter(nn.Module):
    """Book names, plus a trainable parameter the canonical layout knows nothing about."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.out_proj(self.W_value(x)) * self.temperature
