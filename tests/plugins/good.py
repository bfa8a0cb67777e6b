"""Correct multi-head attention plug-ins, written independently of the built-ins.

Each class has the book's constructor ``(d_in, d_out, context_length, dropout, num_heads, qkv_bias=False)``
and the book's attribute names, so canonical weights load without an adapter. The test suite loads
them the way a user would: ``tests/plugins/good.py:PlainAttention`` or, with this folder on
``sys.path``, ``good:PlainAttention``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class PlainAttention(nn.Module):
    """Causal multi-head attention written out step by step (masked_fill with a tril mask)."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.num_heads, self.head_dim, self.d_out = num_heads, d_out // num_heads, d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("allowed", torch.ones(context_length, context_length, dtype=torch.bool).tril(),
                             persistent=False)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, T, _ = t.shape
        return t.reshape(b, T, self.num_heads, self.head_dim).permute(0, 2, 1, 3)  # (b, nh, T, hd)

    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = self._heads(self.W_query(x)), self._heads(self.W_key(x)), self._heads(self.W_value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)  # (b, nh, T, T)
        scores = scores.masked_fill(~self.allowed[:T, :T], float("-inf"))
        weights = self.dropout(torch.softmax(scores, dim=-1))
        context = torch.matmul(weights, v).permute(0, 2, 1, 3).reshape(b, T, self.d_out)  # (b, T, d_out)
        return self.out_proj(context)


class SDPAAttention(nn.Module):
    """Causal multi-head attention through F.scaled_dot_product_attention(is_causal=True)."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.num_heads, self.d_out, self.dropout = num_heads, d_out, dropout
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)

    def forward(self, x):
        b, T, _ = x.shape

        def heads(t):
            return t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # (b, nh, T, hd)

        context = F.scaled_dot_product_attention(heads(self.W_query(x)), heads(self.W_key(x)), heads(self.W_value(x)),
                                                 dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.out_proj(context.transpose(1, 2).flatten(2))  # (b, T, d_out)
