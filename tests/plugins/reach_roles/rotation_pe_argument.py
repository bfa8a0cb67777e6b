"""Reproduces the conventions of black-forest-labs/flux's ``SelfAttention`` (no code copied; written for attnbench's
tests): ctor ``(dim, num_heads=8, qkv_bias=False)``, a fused ``qkv`` and ``proj``; ``forward(x, pe)`` where ``pe`` (a
name attnbench does not know) holds each frequency's 2x2 rotation matrix ``[[cos, -sin], [sin, cos]]``, built by the
model's ``EmbedND`` as ``(B, 1, T, head_dim/2, 2, 2)`` (any shape that broadcasts so works), applied to interleaved
pairs in float32: ``out_i = pe[..., i, 0] * x_0 + pe[..., i, 1] * x_1``.

``PeTableAttention`` is causal (SDPA with ``is_causal=True``): with ``pe`` found to be rotation matrices it is a correct
causal attention with RoPE. ``NeverCausalPeAttention`` is flux's own case: SDPA with no mask and no flag, and a QK
RMSNorm with weights (``norm.query_norm.scale``, ``norm.key_norm.scale``): never causal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rotate(t: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
    pairs = t.float().reshape(*t.shape[:-1], -1, 1, 2)  # (B, H, T, hd/2, 1, 2)
    out = pe[..., 0] * pairs[..., 0] + pe[..., 1] * pairs[..., 1]  # (B, H, T, hd/2, 2)
    return out.reshape(*t.shape).type_as(t)


class PeTableAttention(nn.Module):
    causal = True

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = self.qk(q, k, v)
        out = F.scaled_dot_product_attention(rotate(q, pe), rotate(k, pe), v, is_causal=self.causal)
        return self.proj(out.transpose(1, 2).reshape(B, L, -1))

    def qk(self, q, k, v):
        return q, k


class ScaledRMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.scale


class QKNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.query_norm, self.key_norm = ScaledRMSNorm(dim), ScaledRMSNorm(dim)

    def forward(self, q, k, v):
        return self.query_norm(q).to(v), self.key_norm(k).to(v)


class NeverCausalPeAttention(PeTableAttention):
    causal = False

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False):
        super().__init__(dim, num_heads, qkv_bias)
        self.norm = QKNorm(dim // num_heads)

    def qk(self, q, k, v):
        return self.norm(q, k, v)
