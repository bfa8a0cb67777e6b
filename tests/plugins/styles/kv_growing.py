"""A chapter-4-style KV cache: ``forward(x, use_cache=False)``, ``reset_cache()``, a ``torch.cat`` cache, no rewind."""

from __future__ import annotations

import torch
from torch import nn


class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1), persistent=False)
        self.register_buffer("cache_k", None, persistent=False)
        self.register_buffer("cache_v", None, persistent=False)
        self.ptr_current_pos = 0

    def forward(self, x, use_cache=False):
        b, num_tokens, _ = x.shape
        keys_new = self.W_key(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)  # (b, nh, t, hd)
        values_new = self.W_value(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        if use_cache:
            if self.cache_k is None:
                self.cache_k, self.cache_v = keys_new, values_new
            else:
                self.cache_k = torch.cat([self.cache_k, keys_new], dim=2)  # (b, nh, L + t, hd)
                self.cache_v = torch.cat([self.cache_v, values_new], dim=2)
            keys, values = self.cache_k, self.cache_v
        else:
            keys, values = keys_new, values_new
        attn_scores = queries @ keys.transpose(2, 3)  # (b, nh, t, L)
        num_tokens_K = keys.shape[2]
        if use_cache:
            mask_bool = self.mask.bool()[self.ptr_current_pos:self.ptr_current_pos + num_tokens, :num_tokens_K]
            self.ptr_current_pos += num_tokens
        else:
            mask_bool = self.mask.bool()[:num_tokens, :num_tokens_K]
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = self.dropout(torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1))
        context_vec = (attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, self.d_out)  # (b, t, d_out)
        return self.out_proj(context_vec)

    def reset_cache(self):
        self.cache_k, self.cache_v = None, None
        self.ptr_current_pos = 0
