"""A correct attention class that owns its rotary tables, built once in ``__init__`` (issue 46, item 5).

``inv_freq`` is computed in float32, as the book's ``compute_rope_params`` does (``.float()`` whatever the table
dtype); the angles, cos and sin are then taken in float64. Cast with ``.double()`` the tables stay accurate to
float32 only (about 1e-7), although they are float64 tensors whose values are not float32 numbers: no op in
``forward`` shows it. ``ExactTables`` is the same class with ``inv_freq`` in float64: its tables are exact.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def rope_tables(head_dim: int, context_length: int, theta: float, dtype=torch.float32):
    """``cos, sin`` of shape ``(context_length, head_dim)`` (rotate-half layout) from ``inv_freq`` in ``dtype``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=dtype) / head_dim))
    positions = torch.arange(context_length, dtype=torch.float64)  # exact positions at any length
    angles = positions[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=1)
    return torch.cos(angles), torch.sin(angles)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class RopeAttention(nn.Module):
    table_dtype = torch.float32

    def __init__(self, d_in, d_out, context_length, num_heads, rope_theta=10_000.0, qkv_bias=False):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_out // num_heads
        self.q_proj = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.k_proj = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.v_proj = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        cos, sin = rope_tables(self.head_dim, context_length, rope_theta, self.table_dtype)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = (proj(x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(out.transpose(1, 2).reshape(b, T, -1))


class ExactTables(RopeAttention):
    """The same tables with ``inv_freq`` in float64: exact, so the class is judged at float64."""

    table_dtype = torch.float64


class KeysNotRotated(RopeAttention):
    """Bug: the keys are not rotated. The float32 working precision its tables earn must not excuse it."""

    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = (proj(x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
        q = q * cos + rotate_half(q) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(out.transpose(1, 2).reshape(b, T, -1))
