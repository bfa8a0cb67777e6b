"""Reproduces the conventions of lucidrains/MEGABYTE-pytorch's ``Attention`` (no code copied; written for attnbench's
tests): keyword-only ``(dim, dim_head, heads, dropout, flash)``; an RMSNorm of its own (gain ``g``, ``x / (|x| /
sqrt(dim))``) applied to the input before the projections; ``to_q``, ``to_kv`` (keys, then values), ``to_out``, no
biases; always causal; an optional ``rotary_emb`` it rotates with when given (None here). Apart from the norm it is a
correct causal multi-head attention: ``PreNormAttention`` with its norm replaced by ``nn.Identity()`` passes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GainRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-8):
        super().__init__()
        self.scale, self.eps = dim ** -0.5, eps
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x / (x.norm(dim=-1, keepdim=True) * self.scale).clamp(min=self.eps) * self.g


class PreNormAttention(nn.Module):
    def __init__(self, *, dim, dim_head=64, heads=8, dropout=0.0, flash=False):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        inner = dim_head * heads
        self.norm = GainRMSNorm(dim)
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, 2 * inner, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x, rotary_emb=None):
        x = self.norm(x)
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in (self.to_q(x), *self.to_kv(x).chunk(2, -1)))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))
