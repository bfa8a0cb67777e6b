"""One key/value head for every query head, by construction: ``to_kv = Linear(dim, 2 * dim_head)`` and no parameter
for the kv heads (the convention of lucidrains/memorizing-transformers-pytorch ``Attention``, second held-out corpus,
round 10, as its run described it; a class of our own, no code copied)."""

from __future__ import annotations

import torch
from torch import nn


class MultiQueryAttention(nn.Module):
    def __init__(self, *, dim, heads=8, dim_head=64, dropout=0.0):
        super().__init__()
        self.heads, self.scale = heads, dim_head ** -0.5
        self.dropout = nn.Dropout(dropout)
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, 2 * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.to_q(x).view(b, n, self.heads, -1).transpose(1, 2) * self.scale  # (b, h, n, d)
        k, v = self.to_kv(x).chunk(2, dim=-1)  # (b, n, d): one head, shared
        sim = torch.einsum("bhid,bjd->bhij", q, k)
        future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        attn = self.dropout(sim.masked_fill(future, -torch.finfo(sim.dtype).max).softmax(dim=-1))
        out = torch.einsum("bhij,bjd->bhid", attn, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))
