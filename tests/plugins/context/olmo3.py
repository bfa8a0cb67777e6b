"""OLMo 3 style: QK-norm over the whole projection (``q_norm = RMSNorm(d_out)``, ``k_norm = RMSNorm(kv width)``),
always on, before the heads are split and rotated; ``forward(x, mask, cos, sin)``."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # in float32 whatever the input, as OLMo's; the epsilon is not the attention's argument
        in_dtype, xf = x.dtype, x.float()
        return (self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).to(in_dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, emb_dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, emb_dim // n_heads
        self.q_proj = nn.Linear(emb_dim, emb_dim, bias=False)
        self.k_proj = nn.Linear(emb_dim, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(emb_dim, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(emb_dim, emb_dim, bias=False)
        self.q_norm = RMSNorm(emb_dim)
        self.k_norm = RMSNorm(n_kv_heads * self.head_dim)

    def forward(self, x, mask, cos, sin):
        b, T, _ = x.shape
        q = self.q_norm(self.q_proj(x)).view(b, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_norm(self.k_proj(x)).view(b, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        assert self.head_dim % 2 == 0, "head dim must be even"
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, T, -1))
