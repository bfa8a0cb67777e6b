"""Reproduces the conventions of lucidrains/x-transformers ``Attention`` (no code copied; written for attnbench's tests).

* ctor ``(dim, dim_head=64, heads=8, causal=False, kv_heads=None)``: causal only by the flag; no q/k/v bias and no
  output bias;
* grouped-query attention where query head ``h`` reads kv head ``h % kv_heads`` (keys and values expanded as einops'
  ``repeat(k, 'b kvh n d -> b (r kvh) n d')`` does: the kv heads tiled, not each repeated in place);
* with one head (and ``dim_out == dim``) there is no output projection at all: ``to_out`` is ``nn.Identity``.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class StridedKVAttention(nn.Module):
    def __init__(self, dim, dim_head=64, heads=8, causal=False, kv_heads=None, dim_out=None):
        super().__init__()
        self.heads, self.kv_heads, self.dim_head, self.causal = heads, kv_heads or heads, dim_head, causal
        self.to_q = nn.Linear(dim, dim_head * heads, bias=False)
        self.to_k = nn.Linear(dim, dim_head * self.kv_heads, bias=False)
        self.to_v = nn.Linear(dim, dim_head * self.kv_heads, bias=False)
        dim_out = dim_out or dim
        self.to_out = nn.Linear(dim_head * heads, dim_out, bias=False) if heads > 1 or dim_out != dim else nn.Identity()

    def forward(self, x, context=None):
        kv_input = x if context is None else context
        B, T, _ = x.shape  # (B, T, dim)
        q = self.to_q(x).view(B, T, self.heads, self.dim_head).transpose(1, 2)  # (B, h, T, d)
        k, v = (p(kv_input).view(B, -1, self.kv_heads, self.dim_head).transpose(1, 2) for p in (self.to_k, self.to_v))
        r = self.heads // self.kv_heads
        k, v = k.repeat(1, r, 1, 1), v.repeat(1, r, 1, 1)  # (B, h, S, d): head h reads kv head h % kv_heads
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.to_out(out.transpose(1, 2).reshape(B, T, -1))
