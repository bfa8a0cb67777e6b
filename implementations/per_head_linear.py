"""The Head / MultiHeadAttention / Block design (per-head key/query/value Linears, ``tril`` mask).

From the train-llm-from-scratch design in ``shared/reference/003_*``: each ``Head`` owns
``key``/``query``/``value`` ``nn.Linear(d_in, head_size)``, scales by ``head_size ** -0.5`` and masks
with a lower-triangular ``tril`` buffer; ``MultiHeadAttention`` concatenates the heads and projects.
Dropout sits where that design puts it: on the attention weights and after the projection.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from attnbench.implementations._common import AttentionModule, per_head_adapter
from attnbench.plugins.catalog import register


class Head(nn.Module):
    """One head of causal self-attention with its own key, query and value projections."""

    def __init__(self, head_size: int, d_in: int, context_length: int, dropout: float, bias: bool = False):
        super().__init__()
        self.key = nn.Linear(d_in, head_size, bias=bias)
        self.query = nn.Linear(d_in, head_size, bias=bias)
        self.value = nn.Linear(d_in, head_size, bias=bias)
        self.register_buffer("tril", torch.tril(torch.ones(context_length, context_length)))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        k = self.key(x)  # (B, T, hs)
        q = self.query(x)  # (B, T, hs)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5  # (B, T, T)
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        wei = self.dropout(F.softmax(wei, dim=-1))
        v = self.value(x)  # (B, T, hs)
        return wei @ v  # (B, T, hs)


class PerHeadMultiHeadAttention(AttentionModule):
    """n_head Head modules (one Linear per head and role), concatenated, then a projection."""

    weight_adapter = per_head_adapter("heads.{i}.query", "heads.{i}.key", "heads.{i}.value", "proj.weight", "proj.bias")

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        self.heads = nn.ModuleList(
            [Head(self.head_dim, d_in, context_length, dropout, qkv_bias) for _ in range(num_heads)]
        )
        self.proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        self.check_input(x)
        out = torch.cat([h(x) for h in self.heads], dim=-1)  # (B, T, d_out)
        return self.dropout(self.proj(out))


register("per_head_linear", PerHeadMultiHeadAttention,
         source="Head/MultiHeadAttention design (train-llm-from-scratch, src/models/attention.py)")
