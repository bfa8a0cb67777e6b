"""Chapter-4-style sliding-window attention: each token sees itself and the previous ``sliding_window_size - 1``;
the ``torch.cat`` KV cache keeps only the last ``sliding_window_size`` tokens. No ``rewind_cache``."""

from __future__ import annotations

import torch
from torch import nn


class MultiHeadAttentionWithSWA(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, sliding_window_size=None):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.sliding_window_size = sliding_window_size or context_length
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("cache_k", None, persistent=False)
        self.register_buffer("cache_v", None, persistent=False)
        self.ptr_current_pos = 0

    def forward(self, x, use_cache=False):
        b, num_tokens, _ = x.shape
        keys_new = self.W_key(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)  # (b, nh, t, hd)
        values_new = self.W_value(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        if use_cache:
            start = self.ptr_current_pos - (0 if self.cache_k is None else self.cache_k.shape[2])  # first cached position
            if self.cache_k is None:
                keys, values = keys_new, values_new
            else:
                keys = torch.cat([self.cache_k, keys_new], dim=2)  # (b, nh, L + t, hd)
                values = torch.cat([self.cache_v, values_new], dim=2)
            q_positions = torch.arange(self.ptr_current_pos, self.ptr_current_pos + num_tokens, device=x.device)
            self.ptr_current_pos += num_tokens
            self.cache_k = keys[:, :, -self.sliding_window_size:]  # what a later token can still see
            self.cache_v = values[:, :, -self.sliding_window_size:]
        else:
            keys, values, start = keys_new, values_new, 0
            q_positions = torch.arange(num_tokens, device=x.device)
        k_positions = torch.arange(start, start + keys.shape[2], device=x.device)
        distance = q_positions.unsqueeze(1) - k_positions.unsqueeze(0)  # (t, L)
        mask = (distance < 0) | (distance >= self.sliding_window_size)  # True = may not attend
        attn_scores = (queries @ keys.transpose(2, 3)).masked_fill(mask, -torch.inf)
        attn_weights = self.dropout(torch.softmax(attn_scores / self.head_dim ** 0.5, dim=-1))
        context = (attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, self.d_out)  # (b, t, d_out)
        return self.out_proj(context)

    def reset_cache(self):
        self.cache_k, self.cache_v = None, None
        self.ptr_current_pos = 0
