"""Gemma 3 style: ``query_pre_attn_scalar`` sets the score scale (Gemma 2's ``attn_logit_softcapping`` caps it),
QK-norm per head whose RMSNorm stores ``scale``
around zero and multiplies by ``1 + scale``, and a ``forward(x, mask, cos, sin)`` the model gives a sliding-window
mask (local layers) or a causal one (global layers). Its RMSNorm computes in float32 whatever the input, as Gemma's
does to match the released checkpoints (attnbench observes that and judges its float64 cases at that precision)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        in_dtype, xf = x.dtype, x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.scale.float())).to(in_dtype)


def apply_rope(x, cos, sin):
    assert x.shape[-1] % 2 == 0, "head dim must be even"
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[: x.shape[2]] + rotated * sin[: x.shape[2]]


class GroupedQueryAttention(nn.Module):
    def __init__(self, d_in, num_heads, num_kv_groups, head_dim=None, qk_norm=False, query_pre_attn_scalar=None,
                 attn_logit_softcapping=None, dtype=None):
        super().__init__()
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
        self.scaling = (query_pre_attn_scalar or self.head_dim) ** -0.5
        self.softcap = attn_logit_softcapping  # Gemma 2: cap * tanh(scores / cap)

    def heads(self, x):
        b, T, _ = x.shape
        q = self.W_query(x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.W_key(x).view(b, T, self.num_kv_groups, self.head_dim).transpose(1, 2)
        v = self.W_value(x).view(b, T, self.num_kv_groups, self.head_dim).transpose(1, 2)
        return q, k, v

    def norms(self, q, k):
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k

    def forward(self, x, mask, cos, sin):
        b, T, _ = x.shape
        q, k, v = self.heads(x)
        q, k = self.norms(q, k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = k.repeat_interleave(self.group_size, dim=1), v.repeat_interleave(self.group_size, dim=1)
        scores = (q * self.scaling) @ k.transpose(2, 3)
        if self.softcap is not None:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        w = torch.softmax(scores.masked_fill(mask, -torch.inf), dim=-1)
        return self.out_proj((w @ v).transpose(1, 2).reshape(b, T, self.d_out))


class KNormReusesQNormGain(GroupedQueryAttention):
    """Bug: the keys go through q_norm (k_norm exists but is never used)."""

    def norms(self, q, k):
        return (self.q_norm(q), self.q_norm(k)) if self.q_norm is not None else (q, k)


class ScaleIgnored(GroupedQueryAttention):
    """Bug: takes query_pre_attn_scalar but scales by head_dim ** -0.5."""

    def __init__(self, d_in, num_heads, num_kv_groups, head_dim=None, qk_norm=False, query_pre_attn_scalar=None):
        super().__init__(d_in, num_heads, num_kv_groups, head_dim, qk_norm, query_pre_attn_scalar)
        self.scaling = self.head_dim ** -0.5


class NormAfterRope(GroupedQueryAttention):
    """Bug: QK-norm applied after RoPE (the rotation mixes the pairs the per-element gain then scales)."""

    def forward(self, x, mask, cos, sin):
        b, T, _ = x.shape
        q, k, v = self.heads(x)
        q, k = self.norms(apply_rope(q, cos, sin), apply_rope(k, cos, sin))
        k, v = k.repeat_interleave(self.group_size, dim=1), v.repeat_interleave(self.group_size, dim=1)
        w = torch.softmax(((q * self.scaling) @ k.transpose(2, 3)).masked_fill(mask, -torch.inf), dim=-1)
        return self.out_proj((w @ v).transpose(1, 2).reshape(b, T, self.d_out))
