"""A ModuleList of single-head modules, concatenated and projected (the "Head" style of GPT tutorials)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Head(nn.Module):
    """One head of causal self-attention: key/query/value Linears of width head_size, no biases."""

    def __init__(self, n_embd, head_size, block_size, dropout):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))
        self.dropout = nn.Dropout(dropout)

    def queries(self, x):
        return self.query(x)

    def forward(self, x):
        B, T, C = x.shape
        k = self.key(x)  # (B, T, hs)
        q = self.queries(x)  # (B, T, hs)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5  # (B, T, T)
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        wei = self.dropout(F.softmax(wei, dim=-1))
        return wei @ self.value(x)  # (B, T, hs)


class UntransposedHead(Head):
    """Bug: queries as ``x @ query.weight.view(C, -1)``: reshaped instead of transposed."""

    def queries(self, x):
        return x @ self.query.weight.reshape(x.shape[-1], -1)


class PerHeadModuleList(nn.Module):
    """``heads = nn.ModuleList(Head(...) for _ in range(num_heads))``, concatenated, then ``proj``."""

    head_class = Head

    def __init__(self, d_in, d_out, num_heads, context_length, dropout=0.0):
        super().__init__()
        self.heads = nn.ModuleList([self.head_class(d_in, d_out // num_heads, context_length, dropout)
                                    for _ in range(num_heads)])
        self.proj = nn.Linear(d_out, d_out)

    def forward(self, x):
        return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))  # (B, T, d_out)


class PerHeadModuleListUntransposed(PerHeadModuleList):
    """Bug: every head's query weight is reshaped, not transposed (see :class:`UntransposedHead`)."""

    head_class = UntransposedHead
