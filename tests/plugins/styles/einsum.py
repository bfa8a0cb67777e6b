"""Every projection as ``torch.einsum`` over raw Parameters stored (d_in, d_out)."""

from __future__ import annotations

import torch
from torch import nn


class EinsumParams(nn.Module):
    """``W_query`` etc. are Parameters of shape (d_in, d_out) contracted with ``einsum("btd,di->bti")``."""

    def __init__(self, d_in, d_out, num_heads, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_out // num_heads
        self.W_query = nn.Parameter(self.init(d_in, d_out))
        self.W_key = nn.Parameter(self.init(d_in, d_out))
        self.W_value = nn.Parameter(self.init(d_in, d_out))
        if qkv_bias:
            self.bias_q = nn.Parameter(torch.zeros(d_out))
            self.bias_k = nn.Parameter(torch.zeros(d_out))
            self.bias_v = nn.Parameter(torch.zeros(d_out))
        else:
            self.register_parameter("bias_q", None)
            self.register_parameter("bias_k", None)
            self.register_parameter("bias_v", None)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def init(self, d_in, d_out):
        return torch.randn(d_in, d_out) * d_in ** -0.5

    def forward(self, x):
        b, T, _ = x.shape
        q = torch.einsum("btd,di->bti", x, self.W_query)  # (b, T, d_out)
        k = torch.einsum("btd,di->bti", x, self.W_key)
        v = torch.einsum("btd,di->bti", x, self.W_value)
        if self.bias_q is not None:
            q, k, v = q + self.bias_q, k + self.bias_k, v + self.bias_v
        q, k, v = (t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (b, nh, T, hd)
        scores = torch.einsum("bhid,bhjd->bhij", q, k) / self.head_dim ** 0.5  # (b, nh, T, T)
        scores = scores.masked_fill(self.mask[:T, :T].bool(), -torch.inf)
        weights = self.dropout(torch.softmax(scores, dim=-1))
        context = torch.einsum("bhij,bhjd->bhid", weights, v).transpose(1, 2).reshape(b, T, -1)  # (b, T, d_out)
        return self.out_proj(context)


class EinsumParamsUntransposed(EinsumParams):
    """Bug: the Parameters are stored (d_out, d_in) but contracted as if (d_in, d_out): right only when d_in == d_out."""

    def init(self, d_in, d_out):
        return torch.randn(d_out, d_in) * d_in ** -0.5
