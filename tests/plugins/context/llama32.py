"""Chapter-5 style (Llama 3.2) grouped-query attention: ``forward(x, mask, cos, sin)``, the mask a bool
``(T, T)`` with True = hidden and the rotary tables computed by the model (here: by attnbench), rotate-half."""

from __future__ import annotations

import torch
from torch import nn


def apply_rope(x, cos, sin):
    # x: (b, heads, T, head_dim); cos, sin: (>= T, head_dim), sliced to the sequence
    assert x.shape[-1] % 2 == 0, "Head dimension must be even"
    T, half = x.shape[2], x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    cos, sin = cos[:T][None, None], sin[:T][None, None]
    return (x * cos + rotated * sin).to(x.dtype)


class GroupedQueryAttention(nn.Module):
    def __init__(self, d_in, d_out, num_heads, num_kv_groups, dtype=None):
        super().__init__()
        assert d_out % num_heads == 0 and num_heads % num_kv_groups == 0
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.num_kv_groups, self.group_size = num_kv_groups, num_heads // num_kv_groups
        self.W_key = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False, dtype=dtype)
        self.W_value = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False, dtype=dtype)
        self.W_query = nn.Linear(d_in, d_out, bias=False, dtype=dtype)
        self.out_proj = nn.Linear(d_out, d_out, bias=False, dtype=dtype)

    def forward(self, x, mask, cos, sin):
        b, num_tokens, _ = x.shape
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        keys = self.W_key(x).view(b, num_tokens, self.num_kv_groups, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, num_tokens, self.num_kv_groups, self.head_dim).transpose(1, 2)
        keys, queries = apply_rope(keys, cos, sin), apply_rope(queries, cos, sin)
        keys = keys.repeat_interleave(self.group_size, dim=1)  # (b, heads, T, head_dim)
        values = values.repeat_interleave(self.group_size, dim=1)
        attn_scores = (queries @ keys.transpose(2, 3)).masked_fill(mask, -torch.inf)
        attn_weights = torch.softmax(attn_scores / self.head_dim ** 0.5, dim=-1)
        context = (attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, self.d_out)
        return self.out_proj(context)


class QueriesNotRotated(GroupedQueryAttention):
    """Bug: the keys are rotated, the queries are not."""

    def forward(self, x, mask, cos, sin):
        b, T, _ = x.shape
        q = self.W_query(x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = apply_rope(self.W_key(x).view(b, T, self.num_kv_groups, self.head_dim).transpose(1, 2), cos, sin)
        v = self.W_value(x).view(b, T, self.num_kv_groups, self.head_dim).transpose(1, 2)
        k, v = k.repeat_interleave(self.group_size, dim=1), v.repeat_interleave(self.group_size, dim=1)
        w = torch.softmax((q @ k.transpose(2, 3)).masked_fill(mask, -torch.inf) / self.head_dim ** 0.5, dim=-1)
        return self.out_proj((w @ v).transpose(1, 2).reshape(b, T, self.d_out))


class NeedsTemperature(GroupedQueryAttention):
    """Takes an argument attnbench cannot supply."""

    def forward(self, x, mask, cos, sin, temperature):
        return super().forward(x, mask, cos, sin) / temperature
