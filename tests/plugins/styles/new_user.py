"""A class written as a new user would: correct except that it scales the scores by sqrt(d_model) (its d_out),
not sqrt(head_dim). attnbench must fail it and name that as the likely cause, verified (issue 35)."""

from __future__ import annotations

import torch
from torch import nn


class ScaledByModelWidth(nn.Module):
    """Correct except that it scales the scores by sqrt(d_model) instead of sqrt(head_dim)."""
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))
    def forward(self, x):
        b, T, _ = x.shape
        q = self.W_query(x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.W_key(x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.W_value(x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
        s = (q @ k.transpose(2, 3)).masked_fill(self.mask.bool()[:T, :T], -torch.inf)
        w = self.dropout(torch.softmax(s / self.d_out ** 0.5, dim=-1))
        return self.out_proj((w @ v).transpose(1, 2).reshape(b, T, self.d_out))
