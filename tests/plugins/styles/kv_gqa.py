"""Chapter-4-style grouped-query attention: ``num_kv_groups`` is the number of key/value heads; a ``torch.cat``
KV cache with ``forward(x, use_cache=False)`` and ``reset_cache()``; no dropout, no context length."""

from __future__ import annotations

import torch
from torch import nn


class GroupedQueryAttention(nn.Module):
    def __init__(self, d_in, d_out, num_heads, num_kv_groups, dtype=None, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        assert num_heads % num_kv_groups == 0, "num_heads must be divisible by num_kv_groups"
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.num_kv_groups, self.group_size = num_kv_groups, num_heads // num_kv_groups
        self.W_key = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=qkv_bias, dtype=dtype)
        self.W_value = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=qkv_bias, dtype=dtype)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias, dtype=dtype)
        self.out_proj = nn.Linear(d_out, d_out, dtype=dtype)
        self.register_buffer("cache_k", None, persistent=False)
        self.register_buffer("cache_v", None, persistent=False)
        self.ptr_current_pos = 0

    def forward(self, x, use_cache=False):
        b, num_tokens, _ = x.shape
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)  # (b, nh, t, hd)
        keys_new = self.W_key(x).view(b, num_tokens, self.num_kv_groups, self.head_dim).transpose(1, 2)  # (b, g, t, hd)
        values_new = self.W_value(x).view(b, num_tokens, self.num_kv_groups, self.head_dim).transpose(1, 2)
        if use_cache:
            if self.cache_k is None:
                self.cache_k, self.cache_v = keys_new, values_new
            else:
                self.cache_k = torch.cat([self.cache_k, keys_new], dim=2)
                self.cache_v = torch.cat([self.cache_v, values_new], dim=2)
            keys, values = self.cache_k, self.cache_v
        else:
            keys, values = keys_new, values_new
        keys = keys.repeat_interleave(self.group_size, dim=1)  # (b, nh, L, hd): query head h reads group h // size
        values = values.repeat_interleave(self.group_size, dim=1)
        num_tokens_K = keys.shape[2]
        if use_cache:
            q_positions = torch.arange(self.ptr_current_pos, self.ptr_current_pos + num_tokens, device=x.device)
            self.ptr_current_pos += num_tokens
        else:
            q_positions = torch.arange(num_tokens, device=x.device)
            self.ptr_current_pos = 0
        k_positions = torch.arange(num_tokens_K, device=x.device)
        mask = q_positions.unsqueeze(1) < k_positions.unsqueeze(0)  # (t, L)
        attn_scores = (queries @ keys.transpose(2, 3)).masked_fill(mask, -torch.inf)
        attn_weights = torch.softmax(attn_scores / self.head_dim ** 0.5, dim=-1)
        context = (attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, self.d_out)  # (b, t, d_out)
        return self.out_proj(context)

    def reset_cache(self):
        self.cache_k, self.cache_v = None, None
        self.ptr_current_pos = 0
