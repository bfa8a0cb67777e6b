"""A chapter-4-style "optimized" KV cache: buffers preallocated for ``window_size`` tokens and a position pointer.

``window_size`` sizes the cache (it defaults to ``max_seq_len``, which defaults to ``context_length``); it
is not a sliding window over the attention. No ``rewind_cache``.
"""

from __future__ import annotations

import torch
from torch import nn


class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, max_seq_len=None,
                 window_size=None):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.max_seq_len = max_seq_len or context_length
        self.window_size = window_size or self.max_seq_len
        self.register_buffer("cache_k", None, persistent=False)
        self.register_buffer("cache_v", None, persistent=False)

    def forward(self, x, use_cache=False):
        b, num_tokens, _ = x.shape
        keys_new = self.W_key(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)  # (b, nh, t, hd)
        values_new = self.W_value(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        if use_cache:
            if self.cache_k is None or self.cache_k.size(0) != b:
                # no dtype: the default dtype
                self.cache_k = torch.zeros(b, self.num_heads, self.window_size, self.head_dim, device=x.device)
                self.cache_v = torch.zeros_like(self.cache_k)
                self.ptr_cur = 0  # next free slot
            if self.ptr_cur + num_tokens > self.window_size:  # full: drop the oldest tokens
                overflow = self.ptr_cur + num_tokens - self.window_size
                self.cache_k[:, :, :-overflow] = self.cache_k[:, :, overflow:].clone()
                self.cache_v[:, :, :-overflow] = self.cache_v[:, :, overflow:].clone()
                self.ptr_cur -= overflow
            self.cache_k[:, :, self.ptr_cur:self.ptr_cur + num_tokens] = keys_new
            self.cache_v[:, :, self.ptr_cur:self.ptr_cur + num_tokens] = values_new
            self.ptr_cur += num_tokens
            keys, values = self.cache_k[:, :, :self.ptr_cur], self.cache_v[:, :, :self.ptr_cur]  # (b, nh, L, hd)
            q_positions = torch.arange(self.ptr_cur - num_tokens, self.ptr_cur, device=x.device)
        else:
            keys, values = keys_new, values_new
            self.ptr_cur = 0
            q_positions = torch.arange(num_tokens, device=x.device)
        k_positions = torch.arange(keys.shape[2], device=x.device)
        mask_bool = q_positions.unsqueeze(-1) < k_positions.unsqueeze(0)  # (t, L): True = a future token
        attn_scores = (queries @ keys.transpose(2, 3)).masked_fill(mask_bool, -torch.inf)
        attn_weights = self.dropout(torch.softmax(attn_scores / self.head_dim ** 0.5, dim=-1))
        context_vec = (attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, self.d_out)  # (b, t, d_out)
        return self.out_proj(context_vec)

    def reset_cache(self):
        self.cache_k, self.cache_v = None, None
