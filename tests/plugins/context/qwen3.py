"""Qwen3 style: ``GroupedQueryAttention(d_in, num_heads, num_kv_groups, head_dim=None, qk_norm=False)``,
``forward(x, mask, cos, sin, start_pos=0, cache=None) -> (out, next_cache)``: the full ``(context_length,
head_dim)`` rotary tables indexed at ``start_pos``, rotated keys cached as a ``(keys, values)`` tuple."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    # the book's numerics: normalised in float32 whatever the input (its qwen3_compatible default), the gain applied in
    # the parameter's dtype, the result cast back to the input's dtype; the epsilon is fixed (not a constructor argument
    # of the attention class)
    def __init__(self, dim, eps=1e-6, qwen3_compatible=True):
        super().__init__()
        self.eps, self.qwen3_compatible = eps, qwen3_compatible
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        in_dtype = x.dtype
        if self.qwen3_compatible:
            x = x.to(torch.float32)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        return (x * torch.rsqrt(variance + self.eps) * self.scale).to(in_dtype)


def rotate(x, cos, sin):
    head_dim = x.shape[-1]
    assert head_dim % 2 == 0, "head dim must be even"
    half = head_dim // 2
    return (x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin).to(x.dtype)


class GroupedQueryAttention(nn.Module):
    def __init__(self, d_in, num_heads, num_kv_groups, head_dim=None, qk_norm=False, dtype=None):
        super().__init__()
        assert num_heads % num_kv_groups == 0
        self.num_heads, self.num_kv_groups = num_heads, num_kv_groups
        self.group_size = num_heads // num_kv_groups
        self.head_dim = head_dim or d_in // num_heads
        self.d_out = num_heads * self.head_dim
        self.W_query = nn.Linear(d_in, self.d_out, bias=False, dtype=dtype)
        self.W_key = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False, dtype=dtype)
        self.W_value = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False, dtype=dtype)
        self.out_proj = nn.Linear(self.d_out, d_in, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(self.head_dim) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim) if qk_norm else None

    def project(self, x):
        b, T, _ = x.shape
        q = self.W_query(x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.W_key(x).view(b, T, self.num_kv_groups, self.head_dim).transpose(1, 2)
        v = self.W_value(x).view(b, T, self.num_kv_groups, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def positions(self, cos, sin, start_pos, T):
        return cos[start_pos:start_pos + T], sin[start_pos:start_pos + T]

    def attend(self, q, k, v, mask):
        k = k.repeat_interleave(self.group_size, dim=1)
        v = v.repeat_interleave(self.group_size, dim=1)
        scores = (q @ k.transpose(2, 3)).masked_fill(mask, -torch.inf)
        w = torch.softmax(scores / self.head_dim ** 0.5, dim=-1)
        b, _, T, _ = q.shape
        return self.out_proj((w @ v).transpose(1, 2).reshape(b, T, self.d_out))

    def forward(self, x, mask, cos, sin, start_pos=0, cache=None):
        q, k, v = self.project(x)
        c, s = self.positions(cos, sin, start_pos, x.shape[1])
        q, k = rotate(q, c, s), rotate(k, c, s)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        return self.attend(q, k, v, mask), (k, v)


class StartPosIgnored(GroupedQueryAttention):
    """Bug: rotates every call's tokens from position 0 (the decode offset is ignored)."""

    def positions(self, cos, sin, start_pos, T):
        return cos[:T], sin[:T]


class CachedKeyRotatedAgain(GroupedQueryAttention):
    """Bug: caches the rotated keys, then rotates the whole cache again at positions 0 .. T_total - 1."""

    def forward(self, x, mask, cos, sin, start_pos=0, cache=None):
        q, k, v = self.project(x)
        T = x.shape[1]
        q = rotate(q, cos[start_pos:start_pos + T], sin[start_pos:start_pos + T])
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        total = k.shape[2]
        k_rot = rotate(k, cos[:total], sin[:total])
        return self.attend(q, k_rot, v, mask), (k_rot, v)
